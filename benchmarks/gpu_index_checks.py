"""What the GPU index checks of issue 37 cost and do (needs a CUDA GPU).

Generated Triton kernels that read an index from a tensor (embedding, index_select, gather)
check it with a device assert, compiled in by launching them with ``debug=True,
sanitize_overflow=False`` (runtime/launch.py). This script

1. times the compiled forward and backward of an embedding + gather + index_select graph with
   the checks on, and with them off (the launcher not asking for debug: no assert compiled in),
   medians of CUDA-event timings;
2. checks the outputs against eager;
3. in a child process (a device assert leaves the CUDA context unusable), runs the compiled
   graph on a negative index and on one past the end and prints what is raised, beside what
   eager raises for the same call.

    python benchmarks/gpu_index_checks.py            # all three
"""
from __future__ import annotations

import statistics
import subprocess
import sys

import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler.runtime import launch

VOCAB, DIM, TOKENS = 50_000, 768, 16_384


def model(table, tokens, rows):
    embedded = torch.nn.functional.embedding(tokens, table)            # (TOKENS, DIM)
    picked = table.index_select(0, rows)                               # (len(rows), DIM)
    gathered = embedded.gather(1, (tokens % DIM).view(-1, 1).expand(-1, 8))
    return (embedded * 2).sum() + picked.sum() + gathered.sum()


def inputs(bad: str = ""):
    generator = torch.Generator(device="cuda").manual_seed(0)
    table = torch.randn(VOCAB, DIM, device="cuda", generator=generator, requires_grad=True)
    tokens = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=generator)
    rows = torch.randint(0, VOCAB, (1024,), device="cuda", generator=generator)
    if bad == "negative":
        tokens[5] = -1
    elif bad == "too_large":
        rows[7] = VOCAB
    return table, tokens, rows


def time_steps(checks: bool, repeats: int = 50) -> float:
    saved = launch.CHECKS_INDICES
    if not checks:
        launch.CHECKS_INDICES = "\0no kernel has this\0"  # the launcher asks for no debug build
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aotforge")
        table, tokens, rows = inputs()
        for _ in range(3):
            compiled(table, tokens, rows).backward()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compiled(table, tokens, rows).backward()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    finally:
        launch.CHECKS_INDICES = saved


def child(bad: str) -> None:
    table, tokens, rows = inputs(bad)
    which = sys.argv[3]
    try:
        if which == "eager":
            model(table, tokens, rows)
        else:
            torch.compile(model, backend="aotforge")(table, tokens, rows)
        torch.cuda.synchronize()
        print(f"{which} {bad}: no error")
    except Exception as error:  # noqa: BLE001
        print(f"{which} {bad}: {type(error).__module__}.{type(error).__name__}: {str(error).splitlines()[0]}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    on, off = time_steps(True), time_steps(False)
    print(f"forward+backward, median of 50: checks on {on:.3f} ms, off {off:.3f} ms ({(on / off - 1) * 100:+.1f}%)")
    torch._dynamo.reset()
    table, tokens, rows = inputs()
    torch.testing.assert_close(torch.compile(model, backend="aotforge")(table, tokens, rows), model(table, tokens, rows),
                               rtol=1e-4, atol=1e-2)
    print("outputs match eager")
    for bad in ("negative", "too_large"):
        for which in ("eager", "aotforge"):
            result = subprocess.run([sys.executable, __file__, "--child", bad, which], capture_output=True, text=True)
            lines = [line for line in result.stdout.splitlines() if line.startswith(which)]
            print(lines[-1] if lines else f"{which} {bad}: exit {result.returncode}: {result.stderr.strip()[-300:]}")


if __name__ == "__main__":
    main()
