"""First-call (compile) time and steady-state step time, eager vs inductor vs aotforge, each
backend in a fresh process with empty caches (issue 10's measurement).

For every workload and mode, one child process per backend builds the case from the fixed
seed, moves it to the GPU, and runs under bf16 autocast (weights stay float32, as in mixed-
precision training):

1. the first step, timed end to end (Dynamo, AOT autograd, compilation, Triton's compiles and
   autotuning, the step itself), with every cache directory new and empty;
2. correctness: the loss and every gradient of that first step against eager's, as a relative
   error (||a - e|| / ||e||);
3. ``--warmup`` further steps, then the median of ``--repeat`` timed steps and the peak memory.

For aotforge the child also reports the compile-time breakdown per stage (summed over the
graphs: trace, partition, post-grad passes, lower, schedule, codegen, load, first run), read
from ``aotforge.compiler.observe()``. A child that runs past ``--timeout`` is killed and its
row says so.

    python benchmarks/first_call.py --workloads nanogpt124m,hf_gpt2 --modes train --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from aotforge.bench.suites import load_workloads

    workload = next(w for w in load_workloads() if w.name == args.workload)
    torch.manual_seed(0)
    case = workload.build(args.mode, args.quick)
    model = case.module.cuda()
    inputs = tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in case.inputs)
    train = args.mode == "train"
    model.train(train)
    if args.backend != "eager":
        if args.backend.startswith("aotforge"):
            import aotforge  # noqa: F401
        model_call = torch.compile(model, backend=args.backend)
    else:
        model_call = model

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model_call(*inputs)
        if train:
            out.float().backward()
        return out

    graphs: list = []
    # inference runs under no_grad from the first call on: a first call with grad enabled would
    # compile a training graph that the timed steps (no_grad) never use
    grad_mode = torch.enable_grad() if train else torch.no_grad()
    started = time.perf_counter()
    if args.backend == "aotforge":
        from aotforge.compiler import observe

        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        with observe() as graphs, grad_mode:
            out = step()
        if profiler is not None:
            import io
            import pstats

            profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("cumulative").print_stats(60)
            stats.sort_stats("tottime").print_stats(40)
            Path(args.result + ".profile.txt").write_text(text.getvalue())
    else:
        with grad_mode:
            out = step()
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    values = {"out": out.detach().float().cpu()}
    if train:
        values.update({name: p.grad.float().cpu() for name, p in model.named_parameters() if p.grad is not None})
    torch.save(values, args.values)

    def timed_step() -> None:
        if train:
            for p in model.parameters():
                p.grad = None
            step()
        else:
            with torch.no_grad():
                step()
    for _ in range(args.warmup):
        timed_step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeat):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        timed_step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    result = dict(first_call_s=first, median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                  peak_mib=torch.cuda.max_memory_allocated() / 2**20)
    if graphs:
        breakdown: dict[str, float] = {}
        for graph in graphs:
            for stage, seconds in graph.timings.items():
                breakdown[stage] = breakdown.get(stage, 0.0) + seconds
        result["breakdown"] = breakdown
        result["graphs"] = [dict(kind=g.kind, path=g.path, kernels=len(g.kernels),
                                 unique_kernels=len({k.name for k in g.kernels}),
                                 pool_jobs=len({id(k) for k in g.launchers.values()}),
                                 pool_worker_s=round(g.pool_seconds, 2)) for g in graphs]
    return result


def _relative_error(values: dict, reference: dict) -> float:
    import torch

    worst = 0.0
    for name, expected in reference.items():
        actual = values.get(name)
        if actual is None:
            return float("inf")
        scale = expected.double().norm().clamp_min(1e-12)
        worst = max(worst, ((actual.double() - expected.double()).norm() / scale).item())
    return worst


def _run(workload: str, mode: str, backend: str, args: argparse.Namespace, scratch: Path) -> dict:
    caches = scratch / f"{workload}-{mode}-{backend}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_CACHE_DIR=str(caches / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), AOTFORGE_CACHE_DIR=str(caches / "aotforge"))
    values = scratch / f"{workload}-{mode}-{backend}.pt"
    output = scratch / f"{workload}-{mode}-{backend}.json"
    command = [sys.executable, __file__, "--child", "--workload", workload, "--mode", mode, "--backend", backend,
               "--values", str(values), "--result", str(output), "--warmup", str(args.warmup),
               "--repeat", str(args.repeat)] + (["--quick"] if args.quick else []) \
        + (["--profile"] if args.profile and backend == "aotforge" else [])
    row = dict(workload=workload, mode=mode, backend=backend)
    try:
        done = subprocess.run(command, env=env, timeout=args.timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return dict(row, status=f"TIMEOUT after {args.timeout} s")
    if done.returncode != 0 or not output.exists():
        return dict(row, status="FAILED", error=(done.stderr or done.stdout)[-1500:])
    row.update(json.loads(output.read_text()), status="OK", values=str(values))
    profile = Path(str(output) + ".profile.txt")
    if profile.exists() and args.json:
        target = Path(args.json).parent / f"profile-{workload}-{mode}.txt"
        target.write_text(profile.read_text())
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="nanogpt124m,hf_gpt2,hf_bert,timm_resnet50")
    parser.add_argument("--backends", default="eager,inductor,aotforge")
    parser.add_argument("--modes", default="train")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="")
    # cProfile of aotforge's first step (slows it): <json dir>/profile-<workload>-<mode>.txt
    parser.add_argument("--profile", action="store_true")
    # internal: one measurement in this process
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--workload")
    parser.add_argument("--mode")
    parser.add_argument("--backend")
    parser.add_argument("--values")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(_child(args)))
        return 0

    import torch

    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="first_call_"))
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            reference = None
            for backend in args.backends.split(","):
                row = _run(workload, mode, backend, args, scratch)
                if row["status"] == "OK":
                    values = torch.load(row.pop("values"))
                    if backend == "eager":
                        reference = values
                    elif reference is not None:
                        row["rel_error"] = _relative_error(values, reference)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| workload | mode | backend | status | first call s | median ms | vs inductor | peak MiB | rel. error vs eager | aotforge compile breakdown (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    inductor = {(r["workload"], r["mode"]): r.get("median_ms") for r in rows if r["backend"] == "inductor"}
    for r in rows:
        base = inductor.get((r["workload"], r["mode"]))
        ratio = f"{base / r['median_ms']:.2f}x" if base and r.get("median_ms") else ""
        breakdown = ", ".join(f"{k} {v:.1f}" for k, v in r.get("breakdown", {}).items())
        error = f"{r['rel_error']:.1e}" if "rel_error" in r else ""
        first = f"{r['first_call_s']:.1f}" if "first_call_s" in r else ""
        median = f"{r['median_ms']:.1f}" if "median_ms" in r else ""
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else ""
        lines.append(f"| {r['workload']} | {r['mode']} | {r['backend']} | {r['status']} | {first} | {median} | "
                     f"{ratio} | {peak} | {error} | {breakdown} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
