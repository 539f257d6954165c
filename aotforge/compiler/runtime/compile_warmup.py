"""Imported by each compile-pool worker at boot (never by the main process): gets Triton's
one-time costs out of the way while the main process is still tracing the model, so that the
first real kernel a worker compiles does not pay them (the CUDA driver and target query,
Triton's backend, LLVM and ptxas start-up: a few seconds per worker).
"""
import triton
import triton.language as tl


@triton.jit
def _warm_up_kernel(in_ptr, out_ptr, xnumel, XBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    xmask = xindex < xnumel
    tl.store(out_ptr + xindex, tl.load(in_ptr + xindex, xmask) + 1.0, xmask)


def _warm_up() -> None:
    import torch

    if not torch.cuda.is_available():
        return
    try:
        _warm_up_kernel.warmup(torch.float32, torch.float32, 1024, grid=(1,), XBLOCK=1024)
    except Exception:  # noqa: BLE001  a warm-up only: real compiles report their own errors
        pass


_warm_up()
