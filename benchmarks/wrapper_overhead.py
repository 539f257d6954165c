"""Host time of a compiled graph's wrapper per step and per kernel launch, on the CPU.

    TRITON_INTERPRET=1 python benchmarks/wrapper_overhead.py [--layers 8] [--steps 200]

A small transformer's forward and backward graphs are compiled on the Triton path (the
interpreter), then every kernel's launch is replaced by a no-op that still goes through
``Kernel.run`` and the direct-launch lookup as it does on a GPU. What is left is what the GPU
path pays in Python: input layout checks, allocations, frees, extern (ATen) calls on tiny
tensors, and per launch what our launch path does before Triton's launcher. Prints
microseconds per step and per launch (median of repeats; per launch: the step against the
same step with every kernel call replaced by a bare no-op). Times are this process's CPU
time, on one torch thread, so that other work on a shared machine moves them less.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import aotforge  # noqa: E402,F401
from aotforge.compiler import observe  # noqa: E402
from aotforge.compiler.runtime.direct import DirectLauncher, make_launch  # noqa: E402
from aotforge.config import config  # noqa: E402


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))

    def forward(self, x):
        q, k, v = self.attn(self.norm1(x)).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(-1)
        x = x + self.proj(scores @ v)
        return x + self.mlp(self.norm2(x))


class _NoopCompiled:
    """Triton's compiled kernel as a direct launch sees it, with a launcher that does nothing."""

    function, packed_metadata = None, None

    @staticmethod
    def run(*launch_args) -> None:
        return None


class _AlwaysNoop(dict):
    """A direct launcher's table that has a launch for every specialization: ours
    (``direct.make_launch``: grid, stream, argument list), ending in a no-op launcher."""

    def __init__(self, tail: tuple) -> None:
        super().__init__()
        self.launch = make_launch(_NoopCompiled(), lambda args: 1, tail, 0, current_stream=lambda device: 0)

    def get(self, key, default=None):
        return self.launch


def _time_us(fn, repeats: int, steps: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(steps):
            fn()
        samples.append((time.process_time() - start) / steps * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[_Block(16) for _ in range(args.layers)])
    x = torch.randn(2, 8, 16, requires_grad=True)
    with config.patch(triton_on_cpu=True), observe() as graphs:
        compiled = torch.compile(model, backend="aotforge")
        compiled(x).sum().backward()
    launches = 0
    for graph in graphs:
        for kernel in graph.launchers.values():
            kernel.direct = DirectLauncher()
            kernel.direct.launches = _AlwaysNoop(kernel.sizes)
            launches += 1
    forward, backward = [g for g in graphs if g.kind == "forward"], [g for g in graphs if g.kind == "backward"]

    def step():
        compiled(x).sum().backward()

    with config.patch(triton_on_cpu=True):
        for _ in range(5):
            step()
        step_us = _time_us(step, args.repeats, args.steps)
        # the same steps with every kernel call a bare no-op: the difference is the launch path
        for graph in graphs:
            namespace = graph.call.__globals__
            for group in graph.launchers:
                namespace[group] = _Bare
        bare_us = _time_us(step, args.repeats, args.steps)
    eager_us = _time_us(lambda: model(x).sum().backward(), args.repeats, args.steps)
    kernels = sum(len(g.launchers) for g in forward + backward)
    externs = sum(g.stats["externs"] for g in forward + backward)
    print(f"{args.layers} layers: {kernels} kernel launches and {externs} extern calls per step")
    print("| | us per step | us per launch |")
    print("|---|---|---|")
    print(f"| aotforge, launches through our launch path to a no-op launcher | {step_us:.0f} | "
          f"{(step_us - bare_us) / kernels:.2f} |")
    print(f"| aotforge, every kernel call a bare no-op | {bare_us:.0f} | |")
    print(f"| eager (same model, real CPU kernels) | {eager_us:.0f} | |")


class _Bare:
    @staticmethod
    def run(*args) -> None:
        return None

if __name__ == "__main__":
    main()
