"""Where aotforge's own compile time goes, on the CPU: nanoGPT-124M's graph structure
(12 layers, d=768; a short sequence, since only the graph's shape matters here) through
Dynamo, AOT autograd and every compiler stage up to the loaded kernels, Triton's compile
excluded (the interpreter runs nothing at compile time). The compiled graphs are not run:
the step itself runs the graphs' own ATen calls.

    TRITON_INTERPRET=1 python benchmarks/compile_profile.py [--profile out.txt] [--layers 12]
    TRITON_INTERPRET=1 python benchmarks/compile_profile.py --resnet   # ResNet-18's graphs, 8 images
    TRITON_INTERPRET=1 python benchmarks/compile_profile.py --cache DIR  # twice: a miss, then a hit

Without ``--cache`` the compiled-graph cache is off (this measures the compiler); with it, the
cache lives in DIR: the first process fills it, the next one loads from it.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import aotforge  # noqa: E402
from aotforge.compiler import compile_fx, compile_fx_inner  # noqa: E402
from aotforge.bench.workloads.models import NanoGPT, ResNet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--resnet", action="store_true")
    parser.add_argument("--cache", default="", help="use the compiled-graph cache in this folder")
    args = parser.parse_args()
    aotforge.config.cache, aotforge.config.cache_dir = bool(args.cache), args.cache
    torch.manual_seed(0)
    if args.resnet:
        model = ResNet((64, 128, 256, 512), 2, 1000)
        inputs = (torch.randn(8, 3, 64, 64), torch.randint(0, 1000, (8,)))
    else:
        model = NanoGPT(50304, 64, args.layers, 12, 768)
        inputs = (torch.randint(0, 50304, (1, 64)),) * 2
    timings: list[tuple[str, dict]] = []

    def inner(gm, example_inputs, **kwargs):
        run_fx = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # the step runs this copy
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        timings.append(("backward" if kwargs.get("is_backward") else "forward", compiled.compiled_graph.timings))

        def run(args):
            values = list(args)
            args.clear()
            return run_fx(*values)
        run._boxed_call = True
        return run

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    compiled = torch.compile(model, backend=backend)
    profiler = cProfile.Profile() if args.profile else None
    with aotforge.config.patch(triton_on_cpu=True):
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        compiled(*inputs).backward()
        if profiler:
            profiler.disable()
        total = time.perf_counter() - started
    for kind, stages in timings:
        print(kind, ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
    print(f"first step (Dynamo + AOT + compile + ATen step): {total:.2f} s")
    if profiler:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(80)
        stats.sort_stats("tottime").print_stats(50)
        Path(args.profile).write_text(text.getvalue())


if __name__ == "__main__":
    main()
