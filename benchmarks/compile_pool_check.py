"""Compile-pool check on the GPU (issue 10): N distinct small Triton kernels compiled serially
in this process (each at its first launch, as without the pool) and through aotforge's
compile pool (workers compile into Triton's cache; the first launches then only load).

Triton's cache starts empty (a fresh TRITON_CACHE_DIR) and the two halves use different
kernels, so neither finds the other's binaries. Every launch is checked against torch.

    python benchmarks/compile_pool_check.py [--kernels 64] [--workers 16] [--reductions]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

ROWS, COLUMNS = 256, 1024

POINTWISE = '''
@triton.jit
def {name}(in_ptr, out_ptr, xnumel, XBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    xmask = xindex < xnumel
    value = tl.load(in_ptr + xindex, xmask, other=0.0)
    tl.store(out_ptr + xindex, tl.sin(value * {scale}) + {shift}, xmask)
'''

REDUCTION = '''
@triton.jit
def {name}(in_ptr, out_ptr, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    rindex = tl.arange(0, RBLOCK)[None, :]
    rmask = rindex < rnumel
    value = tl.load(in_ptr + xindex * rnumel + rindex, xmask & rmask, other=0.0)
    value = tl.where(xmask & rmask, tl.sin(value * {scale}) + {shift}, 0.0)
    tl.store(out_ptr + xindex, tl.sum(value, 1)[:, None], xmask)
'''


def make_kernels(count: int, salt: int, reductions: bool):
    """A module of ``count`` distinct kernels and the Kernel objects that launch them."""
    from aotforge.compiler.runtime import launch, modules

    template, kind = (REDUCTION, "persistent") if reductions else (POINTWISE, "pointwise")
    parts = ["import triton\nimport triton.language as tl\n"]
    constants = []
    for index in range(count):
        scale, shift = 1.0 + index / 1000.0, float(salt)
        constants.append((scale, shift))
        parts.append(template.format(name=f"kernel{index}", scale=scale, shift=shift))
    source = "\n".join(parts)
    module = modules.load_module(source, f"pool_check_{salt}")
    numel, rnumel = (ROWS, COLUMNS) if reductions else (ROWS * COLUMNS, 1)
    kernels = [launch.Kernel(getattr(module, f"kernel{i}"), f"kernel{i}", source, kind, numel, rnumel, True, False)
               for i in range(count)]
    return module, kernels, constants


def launch_and_check(kernels, constants, reductions: bool) -> None:
    x = torch.randn(ROWS, COLUMNS, device="cuda")
    for kernel, (scale, shift) in zip(kernels, constants):
        out = torch.empty(ROWS if reductions else (ROWS, COLUMNS), device="cuda")
        kernel.run(x, out)
        expected = torch.sin(x * scale) + shift
        expected = expected.sum(-1) if reductions else expected
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)
    torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=64)
    parser.add_argument("--workers", type=int, default=None, help="default: min(cores, 16)")
    parser.add_argument("--reductions", action="store_true", help="persistent row sums instead of pointwise")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.workers is not None:
        os.environ["AOTFORGE_COMPILE_WORKERS"] = str(args.workers)
    # before Triton is imported: an empty cache of our own, shared with the pool's workers
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="aotforge_pool_check_triton_")
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    from aotforge.compiler.runtime import compile_pool
    from aotforge.config import config

    config.autotune = False  # one configuration per kernel: this measures compiles only
    print(f"{args.kernels} {'reduction' if args.reductions else 'pointwise'} kernels, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"Triton cache {os.environ['TRITON_CACHE_DIR']}")

    torch.zeros(1, device="cuda")  # CUDA context outside the timings
    _, kernels, constants = make_kernels(args.kernels, salt=1, reductions=args.reductions)
    started = time.perf_counter()
    launch_and_check(kernels, constants, args.reductions)
    serial = time.perf_counter() - started
    print(f"serial (first launches compile, one after another): {serial:8.2f} s")

    started = time.perf_counter()
    pool = compile_pool.get_pool()
    if pool is None:
        print("the compile pool is off (AOTFORGE_COMPILE_WORKERS=0)")
        return 1
    [f.result() for f in [pool.submit(os.getpid) for _ in range(pool.size)]]
    boot = time.perf_counter() - started
    print(f"pool of {pool.size} workers started:                      {boot:8.2f} s")

    started = time.perf_counter()
    module, kernels, constants = make_kernels(args.kernels, salt=2, reductions=args.reductions)
    dtypes = [torch.float32, torch.float32]
    for kernel in kernels:
        kernel.start_precompile(module.__file__, dtypes)
    submitted = time.perf_counter()
    failures = 0
    for kernel in kernels:
        for future in kernel.pending:
            try:
                future.result()
            except Exception as error:  # noqa: BLE001
                failures += 1
                print(f"  {kernel.name}: {error}")
    compiled = time.perf_counter()
    launch_and_check(kernels, constants, args.reductions)
    done = time.perf_counter()
    print(f"pool: submit {submitted - started:.2f} s, compile {compiled - submitted:.2f} s, "
          f"first launches {done - compiled:.2f} s (should only load binaries)")
    print(f"pool total (without start):                        {done - started:8.2f} s  "
          f"speed-up {serial / (done - started):.1f}x, {failures} worker failures")
    compile_pool.shutdown()
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
