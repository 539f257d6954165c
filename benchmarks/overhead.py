"""Per-call runtime overhead of aotforge's wrappers, against calling the compiled graph itself.

    python benchmarks/overhead.py

For a tiny function (so that the work is negligible), times: the captured FX graph called
directly, and the same graph behind aot_function, for inference (no_grad) and training
(forward + backward through the autograd.Function), plus mutation/aliasing variants whose
epilogues do work, and PyTorch's own functorch.compile.aot_function on the same function for
reference. Prints microseconds per call (median of repeats) as a markdown table.
"""
from __future__ import annotations

import statistics
import time

import torch

from aotforge import aot_function


def _time_us(fn, iterations=2000, repeats=7) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        samples.append((time.perf_counter() - start) / iterations * 1e6)
    return statistics.median(samples)


def _caller(compiled, args, train: bool):
    if train:
        return lambda: compiled(*args)

    def call():
        with torch.no_grad():
            compiled(*args)

    return call


def measure(name, fn, make_args, train: bool) -> tuple[str, float, float, float]:
    from functorch.compile import aot_function as torch_aot_function
    from functorch.compile import make_boxed_func

    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return gm
        return compiler

    compiled = aot_function(fn, capture("fw"), capture("bw"), inference_compiler=capture("inf"))
    reference = torch_aot_function(fn, lambda gm, _: make_boxed_func(gm))
    args = make_args()
    for f in (compiled, reference):  # compile (forward and backward when training)
        if train:
            f(*args).sum().backward()
        else:
            with torch.no_grad():
                f(*args)
    graph = graphs["fw" if train else "inf"]
    direct_us = _time_us(_caller(graph, args, train))
    wrapped_us = _time_us(_caller(compiled, args, train))
    torch_us = _time_us(_caller(reference, args, train))
    return name, direct_us, wrapped_us, torch_us


def main() -> None:
    torch.set_num_threads(1)
    x = lambda grad: (torch.randn(8, requires_grad=grad),)
    rows = [
        measure("inference: x.sin()", lambda a: a.sin(), lambda: x(False), train=False),
        measure("training forward: x.sin()", lambda a: a.sin(), lambda: x(True), train=True),
        measure("inference: mutate input + view output", lambda a: (a.mul_(1.0), a.view(2, 4))[1], lambda: x(False), train=False),
        measure("inference: 4 inputs, 2 outputs", lambda a, b, c, d: (a + b, c * d), lambda: tuple(torch.randn(8) for _ in range(4)), train=False),
    ]
    print(f"torch {torch.__version__}")
    print(f"| case | graph called directly (us) | aotforge aot_function (us) | overhead (us) | torch's aot_function (us) |")
    print("|---|---|---|---|---|")
    for name, direct_us, wrapped_us, torch_us in rows:
        print(f"| {name} | {direct_us:.1f} | {wrapped_us:.1f} | {wrapped_us - direct_us:.1f} | {torch_us:.1f} |")


if __name__ == "__main__":
    main()
