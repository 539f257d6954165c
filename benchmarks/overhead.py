"""Per-call runtime overhead of aotforge's wrappers, against calling the compiled graph itself.

    python benchmarks/overhead.py

For a tiny function (so that the work is negligible), times: the captured FX graph called
directly, and the same graph behind aot_function, for inference (no_grad) and training
(forward + backward through the autograd.Function), plus mutation/aliasing variants whose
epilogues do work. Prints microseconds per call (median of repeats).
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


def measure(name, fn, make_args, train: bool) -> tuple[str, float, float]:
    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return gm
        return compiler

    compiled = aot_function(fn, capture("fw"), capture("bw"), inference_compiler=capture("inf"))
    args = make_args()
    if train:
        compiled(*args).sum().backward()  # compile forward and backward
        forward = graphs["fw"]
        direct = lambda: forward(*args)
        wrapped = lambda: compiled(*args)
    else:
        with torch.no_grad():
            compiled(*args)
        graph = graphs["inf"]

        def direct():
            with torch.no_grad():
                graph(*args)

        def wrapped():
            with torch.no_grad():
                compiled(*args)

    direct_us = _time_us(direct)
    wrapped_us = _time_us(wrapped)
    return name, direct_us, wrapped_us


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
    print(f"{'case':<42} {'graph direct (us)':>18} {'aot_function (us)':>18} {'overhead (us)':>14}")
    for name, direct_us, wrapped_us in rows:
        print(f"{name:<42} {direct_us:>18.1f} {wrapped_us:>18.1f} {wrapped_us - direct_us:>14.1f}")


if __name__ == "__main__":
    main()
