"""Steps of the CPU suite's conv net (aotforge/bench/workloads/cpu.py) in one process, for
timing whole processes from outside (``/usr/bin/time -v``, or a tool that repeats a command)
where the in-process harness (benchmarks/cpu_codegen.sh) is too noisy to separate two
versions: compile once, a few warm-up steps, then ``--steps`` steps, and print the steps'
median and minimum. With ``AOTFORGE_CACHE_DIR`` pointing at a warm cache the compile is a
cache hit, so the process's time is mostly the steps.

    PYTHONPATH=. python benchmarks/cpu_conv_steps.py --backend aotforge --mode infer --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="aotforge", help="eager, aotforge or any torch.compile backend")
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from aotforge.bench.workloads.cpu import ConvNet

    torch.manual_seed(0)
    model = ConvNet((32, 64, 128), 10).train(args.mode == "train")
    images, labels = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    if args.backend != "eager":
        import aotforge  # noqa: F401  (registers the backend)
    run = model if args.backend == "eager" else torch.compile(model, backend=args.backend)

    def step() -> None:
        if args.mode == "infer":
            with torch.no_grad():
                run(images)
            return
        for parameter in model.parameters():
            parameter.grad = None
        run(images, labels).backward()

    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    print(f"{args.backend} {args.mode} threads={args.threads}: median {statistics.median(times) * 1e3:.2f} ms, "
          f"min {min(times) * 1e3:.2f} ms over {args.steps} steps")


if __name__ == "__main__":
    main()
