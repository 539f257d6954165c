"""Warm start on the CPU: a training step's first call in a fresh process, three ways:

* ``off``: aotforge's caches off (what every restart cost before them);
* ``cold``: caches on, empty folder (the first process: what storing entries costs);
* ``warm``: caches on, filled by the ``cold`` process (a restarted job).

Each runs in its own interpreter with ``torch.compile(backend="aotforge")`` (``--path
dynamic``: with ``dynamic=True``; ``--path aot_function``: ``aot_module(model,
compile_fx_inner)``; ``--path function`` / ``function_dynamic``: ``aot_function(step,
compile_fx_inner)`` over the parameters, without and with ``dynamic=True``), on the CPU through the Triton interpreter, or on ``--device cuda``
(``--dropout`` adds dropout to the model, which issue 33's AOT cache entries now hold).
The interpreter runs each kernel at its first launch (stages
``triton_compile`` and ``first_run``), which has nothing to do with compiling; "first call
without kernel runs" leaves those out (Dynamo + AOT + compiler + caches). Per stage: the
seconds each compiled graph's breakdown records, summed over the graphs.

    python benchmarks/warm_start.py [--layers 2] [--repeat 1] [--device cpu|cuda]
                                    [--path compile|dynamic|aot_function|function|function_dynamic]
                                    [--dropout 0.1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(mode: str, directory: str, layers: int, device: str = "cpu", path: str = "compile",
          dropout: float = 0.0) -> None:
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    import aotforge
    from aotforge.compiler import compile_fx_inner, observe
    from aotforge.bench.workloads.models import NanoGPT

    aotforge.config.triton_on_cpu = device == "cpu"
    aotforge.config.cache, aotforge.config.cache_dir = mode != "off", directory
    torch.manual_seed(0)
    model = NanoGPT(128, 16, layers, 2, 32).to(device)
    for module in model.modules():  # dropout: functionalized RNG in the graphs
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
    idx = torch.randint(0, 128, (1, 16), device=device)
    if path == "aot_function":
        compiled = aotforge.aot_module(model, compile_fx_inner)
    elif path.startswith("function"):  # aot_function over the parameters (dynamic=True: function_dynamic)
        names = [name for name, _ in model.named_parameters()]
        params = list(model.parameters())

        def step(idx, targets, *values):
            return torch.func.functional_call(model, dict(zip(names, values)), (idx, targets))

        function = aotforge.aot_function(step, compile_fx_inner, dynamic=path == "function_dynamic")
        # (the targets as a tensor of their own: inputs that share memory are not AOT-cached)
        compiled = lambda idx, targets: function(idx, targets.clone() if targets is idx else targets,  # noqa: E731
                                                 *params)
    else:
        compiled = torch.compile(model, backend="aotforge", dynamic=path == "dynamic")
    with observe() as graphs:
        started = time.perf_counter()
        compiled(idx, idx).backward()
        first = time.perf_counter() - started
    started = time.perf_counter()
    compiled(idx, idx).backward()
    second = time.perf_counter() - started
    stages: dict = {}
    for graph in graphs:
        for stage, seconds in graph.timings.items():
            stages[stage] = stages.get(stage, 0.0) + seconds
    kernels = stages.get("triton_compile", 0.0) + stages.get("first_run", 0.0)
    print(json.dumps(dict(first=first, second=second, stages=stages, compile=first - kernels)))


def run(mode: str, directory: str, layers: int, device: str = "cpu", path: str = "compile",
        dropout: float = 0.0) -> dict:
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    environment.pop("AOTFORGE_CACHE", None)
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--dir", directory, "--layers", str(layers),
                          "--device", device, "--path", path, "--dropout", str(dropout)],
                         capture_output=True, text=True, env=environment, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--child", default="")
    parser.add_argument("--dir", default="")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--path", default="compile", choices=["compile", "dynamic", "aot_function", "function",
                                                                  "function_dynamic"])
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dir, args.layers, args.device, args.path, args.dropout)
        return
    results: dict = {}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as directory:
            for mode in ("off", "cold", "warm"):
                results.setdefault(mode, []).append(run(mode, directory, args.layers, args.device, args.path,
                                                        args.dropout))
    where = "CPU (Triton interpreter)" if args.device == "cpu" else args.device
    print(f"nanoGPT-style, {args.layers} layers, d=32, {where}, {args.path}, dropout {args.dropout}; seconds, "
          f"best of {args.repeat}")
    best = {mode: min(runs, key=lambda r: r["compile"]) for mode, runs in results.items()}
    print("| process | first call | first call without kernel runs | second call |")
    print("|---|---|---|---|")
    for mode, result in best.items():
        print(f"| {mode} | {result['first']:.2f} | {result['compile']:.2f} | {result['second']:.2f} |")
    stages = [s for s in sorted({s for r in best.values() for s in r["stages"]},
                                key=lambda s: -best["off"]["stages"].get(s, 0)) if s not in KERNEL_RUNS]
    print("\n| stage (all graphs) | " + " | ".join(best) + " |")
    print("|---|" + "---|" * len(best))
    for stage in stages:
        print(f"| {stage} | " + " | ".join(f"{best[m]['stages'].get(stage, 0.0):.3f}" for m in best) + " |")


KERNEL_RUNS = ("triton_compile", "first_run", "pool_wait", "autotune")


if __name__ == "__main__":
    main()
