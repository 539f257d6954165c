"""The command line of ``python -m aotforge bench``."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from aotforge.bench import profile, report, runner
from aotforge.bench.suites import load_workloads
from aotforge.bench.workload import DEFAULT_SUITES, MODES, SUITES, select

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _comma_list(choices: Sequence[str] | None = None):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if choices is not None:
            if "all" in items:
                return list(choices)
            bad = [item for item in items if item not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad} not in {', '.join(choices)} (or all)")
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return items

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aotforge bench",
        description="Benchmark eager vs torch.compile (inductor) vs aotforge on the workloads "
        "in aotforge/bench/workloads; check each backend against eager, then time it.",
    )
    p.add_argument("--suite", type=_comma_list(SUITES), default=None,
                   help=f"comma-separated suites: {', '.join(SUITES)} or all (default: {', '.join(DEFAULT_SUITES)}; "
                   "with --workloads: every suite)")
    p.add_argument("--workloads", type=_comma_list(), default=[],
                   help="comma-separated workload names (default: every workload of the suites)")
    p.add_argument("--backends", type=_comma_list(), default=list(runner.DEFAULT_BACKENDS),
                   help="comma-separated: eager, inductor, aotforge_eager, aotforge, or any "
                   "torch.compile backend, each optionally with a torch.compile mode as backend:mode "
                   "(inductor:reduce-overhead) (default: the first four)")
    p.add_argument("--modes", type=_comma_list(MODES), default=list(MODES),
                   help="train (forward + backward), infer, or both (default)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed rounds; each times every backend once, in rotating order (default 20; 10 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before timing (default 3; 1 with --quick)")
    p.add_argument("--json", type=Path, default=None,
                   help="where to write the results (default bench_out/bench-<device>-<dtype>.json); "
                   "the PNG chart goes beside it")
    p.add_argument("--quick", action="store_true", help="small sizes: for the CPU and CI smoke runs")
    p.add_argument("--no-float64-check", dest="float64_reference", action="store_false",
                   help="skip the float64 eager run that measures eager's own error")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start nothing new after this many seconds; what is left is SKIPPED")
    p.add_argument("--backend-timeout", type=float, default=None, metavar="SECONDS",
                   help="FAIL a backend that takes longer than this on one workload and mode")
    p.add_argument("--stabilize", type=float, default=None, metavar="SECONDS",
                   help="when rows are still NOISY after --repeat rounds, time more rounds for up to this "
                   "many seconds per workload and mode (default 10; 0: never)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch threads, and the process pinned to as many CPUs (default: 1 with --quick, "
                   "whose steps are too small to share; else torch's count, at most the CPUs this process may use)")
    p.add_argument("--autocast", action="store_true",
                   help="keep weights and inputs in float32 and run each step under torch.autocast(--dtype), "
                        "as mixed-precision training does (default: convert the model to --dtype)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile each backend's step: device time per step by category (generated "
                        "kernels, libraries, copies, other ATen), host time to enqueue it, launches, top kernels")
    p.add_argument("--cold-caches", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each backend of each row against new empty caches (aotforge's, inductor's "
                   "and Triton's folders; inductor's FX graph and AOTAutograd caches off), so that first call s "
                   "is a cold compile (default: on when every workload run is of the cpu suite)")
    p.add_argument("--list", action="store_true", help="list the workloads and exit")
    return p


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench: --device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cuda", "cpu"):
        raise SystemExit(f"bench: --device {name!r} is not supported; use cuda or cpu")
    return device


def _git_revision() -> str:
    # A copy without .git (the GPU machine) can be told its revision through the environment.
    if os.environ.get("AOTFORGE_BENCH_REVISION"):
        return os.environ["AOTFORGE_BENCH_REVISION"]
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def describe_environment(device: torch.device) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "aotforge_git": _git_revision(),
        "device": device.type,
    }
    for package in ("triton", "transformers", "timm", "torchvision"):
        try:
            meta[package] = __import__(package).__version__
        except Exception:
            meta[package] = None
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
    else:
        meta["cpu"] = platform.processor() or platform.machine()
        meta["threads"] = torch.get_num_threads()
    return meta


def _busy_warning(threads: int) -> tuple[float | None, str]:
    """The 1-minute load average, and a warning when other processes already keep the CPUs
    busy while the run uses several threads: a parallel region then waits for its threads'
    time slices, and a 20 us step can take 16 ms (measured on a 2-CPU machine at load 2.5: the
    rows show the scheduler, not the step). One thread is not held up that way."""
    if not hasattr(os, "getloadavg"):
        return None, ""
    load = round(os.getloadavg()[0], 2)
    cpus = os.cpu_count() or 1  # the load average counts the whole machine's runnable threads
    if threads > 1 and load > cpus - threads + 0.5:
        return load, (f"the load average is {load:g} on {cpus} CPU(s) before the run starts: with {threads} "
                      "threads, a parallel region can wait a whole time slice (milliseconds) for a CPU another "
                      "process holds, and a step of microseconds is timed as that wait; "
                      "--threads 1 gives steadier numbers on a shared machine")
    return load, ""


def _cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    spans: list[list[int]] = []
    for cpu in cpus:
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    args = parser().parse_args(argv)
    try:
        suites = args.suite or (SUITES if args.workloads else DEFAULT_SUITES)
        workloads = select(load_workloads(), suites, args.workloads)
        runner.check_backends(args.backends)
    except (ValueError, FileNotFoundError) as error:
        print(f"bench: {error}", file=sys.stderr)
        return 2
    if args.list:
        for w in load_workloads():
            print(f"{w.name:16} {w.suite:7} {w.description}")
        return 0
    if not workloads:
        print(f"bench: no workload in suites {list(suites)} matches {args.workloads}", file=sys.stderr)
        return 2
    device = _device(args.device)
    dtype = DTYPES[args.dtype]
    if device.type == "cuda" and dtype == torch.float32 and not args.autocast:
        # float32 means float32: with TF32 matmuls and convolutions every backend sits about 1e-3
        # from float64, which hides real differences at float32's tolerance.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    for name, value, least in (("--repeat", args.repeat, 1), ("--warmup", args.warmup, 0), ("--threads", args.threads, 1)):
        if value is not None and value < least:
            print(f"bench: {name} must be at least {least}, got {value}", file=sys.stderr)
            return 2
    settings = runner.Settings(
        device=device, dtype=dtype, quick=args.quick,
        warmup=args.warmup if args.warmup is not None else (1 if args.quick else 3),
        repeat=args.repeat if args.repeat is not None else (10 if args.quick else 20),
        float64_reference=args.float64_reference,
        stabilize_s=10.0 if args.stabilize is None else max(0.0, args.stabilize),
        deadline=None if args.time_budget is None else time.monotonic() + args.time_budget,
        backend_timeout=args.backend_timeout,
        profile=args.profile,
        autocast=args.autocast,
        cold_caches=all(w.suite == "cpu" for w in workloads) if args.cold_caches is None else args.cold_caches,
    )
    pinned = None
    if device.type == "cpu":
        # Fixed for the whole run, so that every backend's steps use the same threads and CPUs.
        # Quick sizes gain nothing from a second thread (the same medians within 20% at 1 and 2
        # threads on a 2-CPU machine), but on a busy machine every parallel region can wait a
        # time slice for it: 20 us steps timed at 16 ms, and ratios of 0.003x between two runs.
        threads, pinned = runner.measure.pin_cpu_threads(args.threads or (1 if args.quick else None))
        if args.threads is not None and threads < args.threads:
            print(f"bench: --threads {args.threads} is more than the {threads} CPU(s) this process may use; "
                  f"using {threads}", file=sys.stderr)
    meta = describe_environment(device)
    if device.type == "cpu":
        meta["cpus"] = None if pinned is None else _cpu_list(pinned)
        busy = _busy_warning(meta["threads"])
        meta["load_average"] = busy[0]
        meta["cpu_count"] = os.cpu_count()
        if busy[1]:
            print(f"bench: {busy[1]}", file=sys.stderr, flush=True)
    meta.update(dtype=args.dtype, autocast=args.autocast, cold_caches=settings.cold_caches, quick=args.quick, warmup=settings.warmup, repeat=settings.repeat,
                min_batch_ms=runner.measure.MIN_BATCH_S * 1e3, backends=args.backends, modes=args.modes)
    copy_bytes_per_s = None
    if device.type == "cuda" and any(w.suite == "micro" for w in workloads):
        numel = 2**20 if args.quick else 2**26
        copy_bytes_per_s = runner.measure.copy_bandwidth(device, dtype, numel)
        meta["copy_GBps"] = round(copy_bytes_per_s / 1e9, 1)
    print(f"bench: {len(workloads)} workload(s) x {len(args.modes)} mode(s) x {len(args.backends)} backend(s) "
          f"on {meta.get('gpu', device.type)}, {args.dtype}", file=sys.stderr, flush=True)

    json_path = args.json or Path("bench_out") / f"bench-{device.type}-{args.dtype}.json"
    results = runner.run_all(
        workloads, args.modes, args.backends, settings, copy_bytes_per_s,
        on_progress=lambda so_far: report.write_json(json_path, meta, so_far),
    )

    memory = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "the process's peak resident set size"
    threads = ""
    if "threads" in meta:
        count = meta["threads"]
        threads = f", {count} thread{'s' if count != 1 else ''} (pinned" + (f" to CPU{'s' if count > 1 else ''} {meta['cpus']})" if meta["cpus"] else ")")
        if meta.get("load_average") is not None:
            threads += f", load average {meta['load_average']:g} at the start"
    print(f"\n## {meta['date']}: {meta.get('gpu', meta.get('cpu'))}{threads}, torch {meta['torch']}, {args.dtype}"
          f"{', quick sizes' if args.quick else ''}{', empty caches for each first call' if settings.cold_caches else ''}\n")
    gpu = device.type == "cuda"
    print(report.table(results, bandwidth=gpu))
    print("\n" + report.LEGEND.format(memory=memory, min_batch_ms=runner.measure.MIN_BATCH_S * 1e3) + (report.LEGEND_BANDWIDTH if gpu else ""))
    profiled = [(r.workload, r.mode, r.backend, profile.Profile(**r.profile)) for r in results if r.profile]
    if profiled:
        print("\n### Profile (per step)\n\n" + profile.table(profiled))
    report.write_json(json_path, meta, results)
    written = [str(json_path)]
    chart = json_path.with_suffix(".png")
    if report.write_chart(chart, results, f"{meta.get('gpu', device.type)}, {args.dtype}, torch {meta['torch']}"):
        written.append(str(chart))
    summary = report.noisy_summary(results, meta)
    if summary:
        print(f"\n{summary}")
    print(f"\nwrote {', '.join(written)} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    if len(written) == 1:
        print(f"bench: {report.NO_CHART}", file=sys.stderr)
    return 0
