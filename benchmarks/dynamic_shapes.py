"""Dynamic shapes on nanoGPT-124M training: one ``dynamic=True`` compile serving T=512, 768
and 1024 against a ``dynamic=False`` compile per T, eager vs inductor vs aotforge (issue 14's
measurement).

Each (backend, mode) runs in a fresh child process with empty Triton, Inductor and aotforge
caches and a time limit; bf16 autocast, float32 weights, training steps (forward, loss,
backward; no optimizer, so every step computes the same thing):

- ``eager``: the model as is, at every T (the correctness reference and a baseline).
- ``dynamic``: ``torch.compile(model, backend=b, dynamic=True)`` once, then the sequence
  lengths in the given order: the first call at each T is timed (the first one compiles; a
  later one that compiles again shows as new graphs), then steady steps.
- ``static``: per T, ``torch._dynamo.reset()`` and ``torch.compile(model, backend=b,
  dynamic=False)``: each T compiled on its own, as a fixed-shape training run would be.

Per T a child reports: first-call seconds, the graphs compiled during that T (Dynamo graphs,
and the forward/backward graphs the backend compiled), the median step over ``--steps`` timed
steps after ``--warmup`` (CUDA events, synchronized), the peak memory over those steps, and,
before the timings, the first step's loss and a few gradients (and the norm of all of them)
against eager's at the same T, as relative errors (allowed: 2e-2, bf16's tolerance in
``aotforge.bench.measure``). Rows are printed and written to ``--json`` as they finish; a
child cut off by its limit keeps the rows of the T it finished. At the end a table gives
aotforge's dynamic step over its static step per T (target at most 1.10) and inductor's
dynamic step over aotforge's (target at least 1.00x).

    python benchmarks/dynamic_shapes.py --json out.json          # GPU, full size
    python benchmarks/dynamic_shapes.py --small --device cpu --backends eager,aotforge_eager
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = "nanogpt124m"
# The issue's sequence lengths, and their stand-ins for the tiny --small model (block size 16).
SEQLENS, SMALL_SEQLENS = "512,768,1024", "8,12,16"
MODES = ("dynamic", "static")
DYN_OVER_STATIC_TARGET = 1.10
VS_INDUCTOR_TARGET = 1.00


# --- the child: one backend, one mode, every T -----------------------------------------------


def _child(args: argparse.Namespace) -> None:
    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(ROOT))
    from aotforge.bench import measure
    from aotforge.bench.suites import load_workloads

    if args.backend.startswith("aotforge"):
        import aotforge  # noqa: F401  (registers the backends)
    device = torch.device(args.device)
    workload = next(w for w in load_workloads() if w.name == WORKLOAD)
    torch.manual_seed(0)
    model = workload.build("train", args.small).module.to(device).train()
    seqlens = [int(t) for t in args.seqlens.split(",")]
    longest = model.wpe.num_embeddings
    if max(seqlens) > longest:
        raise SystemExit(f"sequence length {max(seqlens)} is longer than the model's block size {longest}")
    parameters = [p for p in model.parameters() if p.requires_grad]
    checked = _checked_parameters(model)
    reference_dir = Path(args.reference)
    compiled = model
    if args.mode == "dynamic":
        compiled = torch.compile(model, backend=args.backend, dynamic=True)

    for length in seqlens:
        generator = torch.Generator().manual_seed(length)  # the same data in every child
        vocab = model.wte.num_embeddings
        idx, targets = (torch.randint(0, vocab, (args.batch, length), generator=generator).to(device) for _ in range(2))
        if args.mode == "static":
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=args.backend, dynamic=False)
        call = compiled

        def step() -> torch.Tensor:
            for p in parameters:
                p.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = call(idx, targets)
            loss.float().backward()
            return loss

        graphs_before = _graph_counts(counters)
        with _observe(args.backend) as observed:
            loss, first_s = measure.time_first_call(step, device)
            values = _values(loss, model, checked)
            row = dict(backend=args.backend, mode=args.mode, T=length, batch=args.batch, first_call_s=first_s)
            row.update(_correctness(values, reference_dir / f"eager-T{length}.pt", args.backend == "eager"))
            print(_correctness_line(row), flush=True)
            with measure.PeakMemory(device) as peak:
                times = measure.time_steps(step, device, args.warmup, args.steps)
        graphs_after = _graph_counts(counters)
        row.update(dynamo_graphs=graphs_after["dynamo"] - graphs_before["dynamo"],
                   backend_graphs=graphs_after["backend"] - graphs_before["backend"],
                   dynamo_graphs_total=graphs_after["dynamo"],
                   median_ms=measure.median(times), min_ms=min(times), max_ms=max(times),
                   peak_mib=None if peak.bytes is None else peak.bytes / 2**20,
                   status="OK" if row.get("correct", True) else "WRONG")
        if args.backend == "aotforge":
            # which path each graph the compiler saw took: "triton" (kernels) or "aten" (fallback)
            row["backend_graphs"] = len(observed)
            row["aotforge_graphs"] = [dict(kind=getattr(g, "kind", "?"), path=getattr(g, "path", "?"),
                                           kernels=len(getattr(g, "kernels", ()) or ())) for g in observed]
        print("ROW " + json.dumps(row), flush=True)
        with open(args.result, "a") as handle:
            handle.write(json.dumps(row) + "\n")


def _checked_parameters(model) -> list[str]:
    """Gradients compared in full: the position embedding, the first block's attention input,
    the last block's MLP output and the final LayerNorm. The tied token embedding (38M values
    at full size) is left to the norm of all gradients together, which every step also compares."""
    last = len(model.blocks) - 1
    return ["wpe.weight", "blocks.0.attn.qkv.weight", f"blocks.{last}.mlp.2.weight", "ln_f.weight"]


def _values(loss, model, checked: list[str]) -> dict:
    """The first step's loss, the checked parameters' gradients, and the norm of all of them."""
    import torch

    named = dict(model.named_parameters())
    values = {"loss": loss.detach().float().cpu()}
    for name in checked:
        grad = named[name].grad
        values[f"grad {name}"] = None if grad is None else grad.detach().float().cpu()
    grads = [p.grad.detach().float() for p in named.values() if p.grad is not None]
    values["grad norm (all)"] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).cpu()
    return values


def _correctness(values: dict, reference: Path, is_eager: bool) -> dict:
    import torch

    from aotforge.bench import measure

    if is_eager:
        torch.save(values, reference)
        return {"loss": values["loss"].item()}
    if not reference.exists():
        return {"loss": values["loss"].item(), "errors": None}
    expected = torch.load(reference)
    allowed = measure.TOLERANCES[torch.bfloat16]
    errors = {}
    for name, value in expected.items():
        actual = values.get(name)
        errors[name] = math.inf if actual is None or value is None else measure.relative_error(actual, value)
    worst = max(errors.values())
    return {"loss": values["loss"].item(), "errors": errors, "max_rel_error": worst, "allowed": allowed,
            "correct": worst <= allowed}


def _correctness_line(row: dict) -> str:
    head = f"[{row['backend']} {row['mode']} T={row['T']}] first call {row['first_call_s']:.1f} s, loss {row['loss']:.4f}"
    if row["backend"] == "eager":
        return head + " (reference)"
    if row.get("errors") is None:
        return head + ", no eager reference to compare with"
    errors = ", ".join(f"{name.removeprefix('grad ')} {error:.1e}" for name, error in row["errors"].items())
    verdict = "OK" if row["correct"] else f"WRONG (allowed {row['allowed']:.0e})"
    return f"{head}; relative error vs eager (loss, grads): {errors}: {verdict}"


def _graph_counts(counters) -> dict:
    """Dynamo graphs compiled so far, and the forward/backward graphs Inductor compiled (its
    FX graph cache sees every one; aotforge's are counted through ``observe``)."""
    inductor = counters["inductor"]
    return {"dynamo": counters["stats"]["unique_graphs"],
            "backend": sum(inductor[k] for k in ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass"))}


def _observe(backend: str):
    import contextlib

    if backend == "aotforge":
        from aotforge.compiler import observe

        return observe()
    return contextlib.nullcontext([])


# --- the parent: one child per (backend, mode), rows as they finish --------------------------


def plan(backends: list[str]) -> list[tuple[str, str]]:
    """Eager first (the reference), then every dynamic run, then every static run: the
    measurements the targets need most come before a time budget can run out."""
    compiled = [b for b in backends if b != "eager"]
    # aotforge before inductor within each mode
    compiled.sort(key=lambda b: 0 if b.startswith("aotforge") else 1)
    steps = [("eager", "eager")] if "eager" in backends else []
    return steps + [(b, mode) for mode in MODES for b in compiled]


def _run_child(backend: str, mode: str, args: argparse.Namespace, scratch: Path, limit: float) -> list[dict]:
    name = f"{backend}-{mode}"
    caches = scratch / name
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_CACHE_DIR=str(caches / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), AOTFORGE_CACHE_DIR=str(caches / "aotforge"))
    result, log = scratch / f"{name}.jsonl", scratch / f"{name}.stderr"
    command = [sys.executable, __file__, "--child", "--backend", backend, "--mode", mode,
               "--seqlens", args.seqlens, "--batch", str(args.batch), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--device", args.device, "--result", str(result),
               "--reference", str(scratch)] + (["--small"] if args.small else [])
    print(f"== {name}: limit {limit:.0f} s", flush=True)
    started = time.perf_counter()
    with open(log, "w") as stderr:
        # its own session, so that a timeout ends the child's compile workers too
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                 start_new_session=True)
        status = _relay(child, limit)
    rows = [json.loads(line) for line in result.read_text().splitlines()] if result.exists() else []
    done = {row["T"] for row in rows}
    missing = [int(t) for t in args.seqlens.split(",") if int(t) not in done]
    error = ""
    if status != "OK" or missing:
        error = log.read_text()[-1500:] if log.exists() else ""
        print(f"== {name}: {status}, no row for T={missing}\n{error}", flush=True)
    for length in missing:
        rows.append(dict(backend=backend, mode=mode, T=length, batch=args.batch,
                         status=status if status != "OK" else "FAILED", error=error))
        print(table_line(rows[-1]), flush=True)
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        text = log.read_text() if log.exists() else ""
        (Path(args.logs) / f"{name}.stderr").write_text(text[-200_000:])
    print(f"== {name}: {status} in {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def _relay(child: subprocess.Popen, limit: float) -> str:
    """Echo the child's lines until it ends or ``limit`` seconds pass (then end its process
    group): ``"OK"``, ``"FAILED (exit N)"`` or ``"TIMEOUT after N s"``."""
    import threading

    def echo() -> None:
        for line in child.stdout:
            if line.startswith("ROW "):  # a finished T: its line of the table, now
                print(table_line(json.loads(line[4:])), flush=True)
            else:
                print("   " + line, end="", flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        code = child.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
        reader.join(timeout=5)
        return f"TIMEOUT after {round(limit, 1):g} s"
    reader.join(timeout=5)
    return "OK" if code == 0 else f"FAILED (exit {code})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="eager,inductor,aotforge")
    parser.add_argument("--modes", default=",".join(MODES), help="dynamic,static (eager always runs once)")
    parser.add_argument("--seqlens", default=None, help=f"in this order (default {SEQLENS}; --small: {SMALL_SEQLENS})")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; --small: 2)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per T (the median is reported)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per child (one backend and mode)")
    parser.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: none); "
                        "children that would start with less than 30 s left are skipped")
    parser.add_argument("--device", default=None, help="cuda if available, else cpu")
    parser.add_argument("--small", action="store_true", help="the tiny nanoGPT config (CPU smoke runs)")
    parser.add_argument("--json", default="")
    parser.add_argument("--logs", default="", help="folder for each child's stderr")
    # internal: one backend and mode in this process
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--backend")
    parser.add_argument("--mode")
    parser.add_argument("--result")
    parser.add_argument("--reference")
    args = parser.parse_args(argv)
    args.seqlens = args.seqlens or (SMALL_SEQLENS if args.small else SEQLENS)
    args.batch = args.batch or (2 if args.small else 8)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        _child(args)
        return 0

    backends = args.backends.split(",")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    meta = dict(workload=WORKLOAD, device=args.device, small=args.small, seqlens=args.seqlens, batch=args.batch,
                warmup=args.warmup, steps=args.steps, autocast="bfloat16", started=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"nanoGPT-124M{' (small)' if args.small else ''} training, batch {args.batch}, T={args.seqlens}, "
          f"bf16 autocast, device {args.device}, {args.warmup} warm-up + {args.steps} timed steps", flush=True)
    rows: list[dict] = []
    scratch = Path(tempfile.mkdtemp(prefix="dynamic_shapes_"))
    started = time.perf_counter()
    try:
        for backend, mode in [(b, m) for b, m in plan(backends) if m == "eager" or m in modes]:
            left = args.budget - (time.perf_counter() - started) if args.budget else math.inf
            if left < 30:
                print(f"== {backend}-{mode}: SKIPPED, {left:.0f} s of the budget left", flush=True)
                rows += [dict(backend=backend, mode=mode, T=int(t), batch=args.batch, status="SKIPPED (budget)")
                         for t in args.seqlens.split(",")]
            else:
                rows += _run_child(backend, mode, args, scratch, min(args.timeout, left))
            if args.json:
                Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(table(rows))
    print()
    print(ratio_table(rows, backends))
    return 0


# --- tables ------------------------------------------------------------------------------------

HEADER = ("| backend | mode | T | status | first call s | Dynamo graphs (new / total) | backend graphs | "
          "median ms | min-max ms | peak MiB | loss | max rel. error vs eager |")


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table_line(r: dict) -> str:
    graphs = f"{r['dynamo_graphs']} / {r['dynamo_graphs_total']}" if "dynamo_graphs" in r else ""
    paths = ", ".join(f"{g['kind']} {g['path']} ({g['kernels']} kernels)" for g in r.get("aotforge_graphs", []))
    backend_graphs = f"{r['backend_graphs']}" + (f": {paths}" if paths else "") if "backend_graphs" in r else ""
    spread = f"{r['min_ms']:.1f}-{r['max_ms']:.1f}" if "min_ms" in r else ""
    return (f"| {r['backend']} | {r['mode']} | {r['T']} | {r['status']} | {_fmt(r.get('first_call_s'), '.1f')} | "
            f"{graphs} | {backend_graphs} | {_fmt(r.get('median_ms'), '.2f')} | {spread} | "
            f"{_fmt(r.get('peak_mib'), '.0f')} | {_fmt(r.get('loss'), '.4f')} | {_fmt(r.get('max_rel_error'), '.1e')} |")


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"] + [table_line(r) for r in rows])


def ratio_table(rows: list[dict], backends: list[str]) -> str:
    """Step ms per T for every backend and mode, each compiled backend's dynamic step over its
    static one (target <= 1.10), and inductor's dynamic step over each other backend's (target
    >= 1.00x: faster than inductor). A ratio from a WRONG row is marked."""
    ms = {(r["backend"], r["mode"], r["T"]): r for r in rows if r.get("median_ms") is not None}
    compiled = [b for b in backends if b != "eager"]
    seqlens = sorted({r["T"] for r in rows}, key=[r["T"] for r in rows].index)
    columns = (["eager ms"] if "eager" in backends else []) + [f"{b} {m} ms" for b in compiled for m in MODES]
    columns += [f"{b} dynamic/static (<= {DYN_OVER_STATIC_TARGET:.2f})" for b in compiled]
    rivals = [b for b in compiled if b != "inductor"] if "inductor" in compiled else []
    columns += [f"{b} dynamic vs inductor dynamic (>= {VS_INDUCTOR_TARGET:.2f}x)" for b in rivals]
    lines = ["| T | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]

    def cell(key) -> str:
        r = ms.get(key)
        return "" if r is None else f"{r['median_ms']:.2f}" + ("" if r["status"] == "OK" else " WRONG")

    def ratio(top, bottom, target, higher_is_better) -> str:
        a, b = ms.get(top), ms.get(bottom)
        if a is None or b is None:
            return ""
        value = a["median_ms"] / b["median_ms"]
        met = value >= target if higher_is_better else value <= target
        wrong = "" if a["status"] == b["status"] == "OK" else " (WRONG row)"
        return f"{value:.2f}{'x' if higher_is_better else ''} {'met' if met else 'MISSED'}{wrong}"

    for length in seqlens:
        cells = [cell(("eager", "eager", length))] if "eager" in backends else []
        cells += [cell((b, m, length)) for b in compiled for m in MODES]
        cells += [ratio((b, "dynamic", length), (b, "static", length), DYN_OVER_STATIC_TARGET, False) for b in compiled]
        cells += [ratio(("inductor", "dynamic", length), (b, "dynamic", length), VS_INDUCTOR_TARGET, True) for b in rivals]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    totals = []
    for b in compiled:
        dynamic = [r for r in rows if r["backend"] == b and r["mode"] == "dynamic" and "dynamo_graphs_total" in r]
        if dynamic:
            last = dynamic[-1]
            compiles = sum(r["backend_graphs"] for r in dynamic)
            totals.append(f"{b} dynamic: {last['dynamo_graphs_total']} Dynamo graph(s), {compiles} backend graph(s) "
                          f"compiled for {len(dynamic)} sequence length(s)")
    return "\n".join(lines + ([""] + totals if totals else []))


if __name__ == "__main__":
    sys.exit(main())
