"""``python -m aotforge demo``: train a small model eagerly and through
``torch.compile(model, backend="aotforge")`` from the same weights, print both losses side by
side, what aotforge did (graphs, kernels or why none, compile time) and the step times.

``--graphs`` also prints the forward and backward graphs aotforge captured (with their
source lines); ``--device cuda`` runs on a GPU, where aotforge generates fused kernels.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class DemoNet(nn.Module):
    """A small classifier: the ops a transformer block's MLP uses (matmul, LayerNorm, GELU,
    cross-entropy), small enough to compile in seconds on a CPU."""

    def __init__(self, features: int = 128, width: int = 256, classes: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(features, width)
        self.norm = nn.LayerNorm(width)
        self.fc2 = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.gelu(self.norm(self.fc1(x)))), target)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer(model: Callable, parameters, x, target, device: torch.device):
    """One SGD step of ``model``: returns (loss, seconds)."""
    optimizer = torch.optim.SGD(parameters, lr=0.1)

    def step() -> tuple[float, float]:
        _synchronize(device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, target)
        loss.backward()
        optimizer.step()
        _synchronize(device)
        return loss.item(), time.perf_counter() - started
    return step


def _describe(report, device: torch.device) -> list[str]:
    """What aotforge did, from ``aotforge.inspect``: per compiled graph, its ops and kernels."""
    lines = [f"  Dynamo graphs compiled: {len(report.records)}"]
    for record in report.records:
        if record.cached:
            lines.append(f"  graph {record.number}: loaded from aotforge's on-disk cache (an earlier run "
                         "compiled it: no tracing, no compiling; `python -m aotforge cache clear` empties it)")
        for kind in ("forward", "backward", "inference"):
            gm = record.graphs.get(kind)
            if gm is not None:
                ops = sum(1 for node in gm.graph.nodes
                          if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload))
            elif kind in record.graph_code:
                ops = record.graph_code[kind].count("torch.ops.aten.")
            elif kind in record.compiled:
                ops = None  # a compiled program from the cache: its graph was not kept
            else:
                continue
            part = record.compiled.get(kind)
            compiled = getattr(part, "compiled_graph", None) if part is not None else None
            kernels = getattr(compiled, "kernels", None) if compiled is not None else None
            if kernels:
                language = {"cpp": "C++", "triton": "Triton"}.get(kernels[0].language, kernels[0].language)
                what = f"{len(kernels)} generated {language} kernels"
            elif getattr(compiled, "path", None) == "cpp":
                what = ("no kernels: each op is a library call or keeps eager's CPU kernel for eager's "
                        "bits (config.cpu_eager_bits: GELU, LayerNorm, softmax, exp...)")
            else:
                what = ("no kernels: on CPU the graph runs as plain ATen calls (eager's own "
                        "kernels)" if device.type == "cpu" else "no kernels generated")
            source = f"{ops:>3} ATen ops" if ops is not None else "(cached)"
            lines.append(f"  graph {record.number} {kind:<8} {source} -> {what}")
    return lines


def _generated_kernels(report) -> bool:
    return any(getattr(part.compiled_graph, "kernels", None)
               for record in report.records for part in record.compiled.values())


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:8.3f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aotforge demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--graphs", action="store_true",
                        help="also print the forward and backward graphs aotforge captured")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step includes compilation)")
    device = torch.device(args.device)
    if device.type == "cpu":
        # Steps of a millisecond: more threads only add waiting on a shared machine.
        torch.set_num_threads(1)

    import aotforge  # noqa: F401  (not needed for backend="aotforge"; for aotforge.inspect)

    torch.manual_seed(0)
    eager_model = DemoNet().to(device)
    compiled_inner = copy.deepcopy(eager_model)  # the same weights
    x = torch.randn(512, 128, device=device)
    target = torch.randint(0, 16, (512,), device=device)

    print(f"Training DemoNet ({sum(p.numel() for p in eager_model.parameters())} parameters) "
          f"for {args.steps} SGD steps on {device}, eagerly and through\n"
          f"torch.compile(model, backend=\"aotforge\"), from the same weights.\n")
    compiled_model = torch.compile(compiled_inner, backend="aotforge")
    steps = {"eager": _trainer(eager_model, eager_model.parameters(), x, target, device),
             "aotforge": _trainer(compiled_model, compiled_inner.parameters(), x, target, device)}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    started = time.perf_counter()
    for _ in range(args.steps):  # interleaved, so that a busy machine slows both alike
        for name, step in steps.items():
            loss, took = step()
            losses[name].append(loss)
            seconds[name].append(took)
    total = time.perf_counter() - started
    eager_losses, compiled_losses = losses["eager"], losses["aotforge"]
    eager_seconds, compiled_seconds = seconds["eager"], seconds["aotforge"]

    print(f"{'step':>4}  {'eager loss':>11}  {'aotforge loss':>13}  {'|diff|':>8}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(eager_losses, compiled_losses)):
        worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
        if step < 5 or step == args.steps - 1:
            print(f"{step:>4}  {a:>11.6f}  {b:>13.6f}  {abs(a - b):>8.1e}")
        elif step == 5:
            print(f"{'...':>4}")
    ok = worst <= 1e-4
    print(f"losses {'match' if ok else 'DIFFER'} (largest relative difference {worst:.1e}, "
          f"float32; tolerance 1e-4)\n")

    report = aotforge.inspect(compiled_model)
    print("What aotforge did:")
    for line in _describe(report, device):
        print(line)
    stages: dict[str, float] = {}
    for record in report.records:  # aotforge's own compile seconds, per stage
        for stage, seconds in record.timings.items():
            stages[stage] = stages.get(stage, 0.0) + seconds
    print(f"  compile time: the first step took {compiled_seconds[0]:.2f} s (Dynamo, AOT autograd and "
          f"the compilers), a later one {_ms(compiled_seconds[1:]).strip()}")
    if stages and _generated_kernels(report):  # (on the ATen path the compilers do nothing)
        print("    aotforge's compilers: " + ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in stages.items()))
    print(f"  the whole run (both models, {args.steps} steps each): {total:.2f} s\n")

    print("Step time (median and fastest of the steps after the first, interleaved):")
    later_eager, later_compiled = eager_seconds[1:], compiled_seconds[1:]
    print(f"  eager     {_ms(later_eager)}  (fastest {min(later_eager) * 1e3:.3f} ms)")
    print(f"  aotforge  {_ms(later_compiled)}  (fastest {min(later_compiled) * 1e3:.3f} ms)   "
          f"{statistics.median(later_eager) / statistics.median(later_compiled):.2f}x eager")
    if device.type == "cpu" and not _generated_kernels(report):
        print("  On CPU aotforge runs the graphs as ATen calls made one by one from Python: about "
              "eager's speed\n  on large steps, slower on small ones (a few µs per op that "
              "eager's C++ autograd does not pay).\n  Its fused kernels are generated for CUDA "
              "tensors (see benchmarks/RESULTS.md).")

    if args.graphs:
        for record in report.records:
            for kind in ("forward", "backward", "inference"):
                gm = record.graphs.get(kind)
                code = gm.code if gm is not None else record.graph_code.get(kind)
                part = record.compiled.get(kind)
                if code is not None:
                    print(f"\n===== graph {record.number}: {kind} =====")
                    print(code.strip())
                elif part is not None and part.compiled_graph is not None:  # the cache kept the program
                    print(f"\n===== graph {record.number}: {kind} (its compiled program, from the cache) =====")
                    print(part.compiled_graph.wrapper_source.strip())
    else:
        print("\n(python -m aotforge demo --graphs prints the graphs; AOTFORGE_LOG=all shows "
              "every stage)")
    return 0 if ok else 1
