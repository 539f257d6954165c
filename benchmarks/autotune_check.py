"""Does autotuning choose well, and what does it buy? (GPU; issue 10's steady-state check.)

Compiles a workload with aotforge, then for every kernel that autotunes, times each candidate
with triton.testing.do_bench (L2 flushed before each launch; the reference) and reports where
aotforge's own choice differs and what that costs per step. Step times: with aotforge's
choices, with do_bench's best, and with the heuristic's first candidate everywhere.

    python benchmarks/autotune_check.py --workload nanogpt124m
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def step_ms(step, repeat: int = 15) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="nanogpt124m")
    parser.add_argument("--mode", default="train")
    args = parser.parse_args()
    import aotforge  # noqa: F401
    from aotforge.bench.suites import load_workloads
    from aotforge.compiler import observe
    from triton.testing import do_bench

    workload = next(w for w in load_workloads() if w.name == args.workload)
    torch.manual_seed(0)
    case = workload.build(args.mode, False)
    model = case.module.cuda().train(args.mode == "train")
    inputs = tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in case.inputs)
    compiled = torch.compile(model, backend="aotforge")

    def step():
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(*inputs)
        if args.mode == "train":
            out.float().backward()

    started = time.perf_counter()
    with observe() as graphs:
        step()
    torch.cuda.synchronize()
    print(f"first step {time.perf_counter() - started:.1f} s")
    chosen_ms = step_ms(step)
    from aotforge.compiler.runtime import compile_pool

    compile_pool.shutdown()  # do idle workers (each with its CUDA driver loaded) cost anything?
    without_pool_ms = step_ms(step)
    print(f"step ms with the pool's workers alive {chosen_ms:.2f}, after shutting them down {without_pool_ms:.2f}")

    # every call of each tuned launcher, with the arguments of its last call recorded
    launchers = {}
    for graph in graphs:
        for kernel in graph.launchers.values():
            launchers[id(kernel)] = kernel
    tuned = [k for k in launchers.values() if k.tunes() and len(k.configs) > 1]
    recorded = {}
    for kernel in tuned:
        original = kernel._launch

        def record(call_args, chosen, kernel=kernel, original=original):
            recorded.setdefault(id(kernel), (list(call_args), 0))
            recorded[id(kernel)] = (recorded[id(kernel)][0], recorded[id(kernel)][1] + 1)
            original(call_args, chosen)
        kernel._launch = record
    step()
    torch.cuda.synchronize()
    for kernel in tuned:
        del kernel._launch
    print(f"{len(launchers)} launchers, {len(tuned)} autotuned")
    lost_ms = 0.0
    best_choice = {}
    rows = []
    for kernel in tuned:
        if id(kernel) not in recorded:
            continue
        call_args, calls = recorded[id(kernel)]
        times = []
        for candidate in kernel.configs:
            try:
                times.append(do_bench(lambda: kernel._launch(call_args, candidate), warmup=10, rep=50,
                                      return_mode="median"))
            except Exception:  # noqa: BLE001
                times.append(float("inf"))
        best = min(range(len(times)), key=times.__getitem__)
        ours = kernel.configs.index(kernel.best)
        best_choice[id(kernel)] = kernel.configs[best]
        lost_ms += (times[ours] - times[best]) * calls
        rows.append((kernel.name, kernel.numel, kernel.rnumel, calls, ours, best,
                     " ".join(f"{t * 1000:.1f}" for t in times)))
    for row in sorted(rows, key=lambda r: r[0]):
        print("%-40s numel=%-8d rnumel=%-6d calls=%-3d ours=%d best=%d  us: %s" % row)
    print(f"time lost per step to autotune choices (do_bench's view): {lost_ms:.2f} ms")
    for kernel in tuned:
        if id(kernel) in best_choice:
            kernel.best = best_choice[id(kernel)]
    best_ms = step_ms(step)
    for kernel in launchers.values():
        kernel.best = kernel.configs[0]
    heuristic_ms = step_ms(step)
    print(f"step ms: aotforge's choices {chosen_ms:.2f}, do_bench's best {best_ms:.2f}, "
          f"heuristic first candidate {heuristic_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
