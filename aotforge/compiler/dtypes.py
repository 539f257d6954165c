"""Dtype rules every stage and every target shares: which dtypes generated kernels handle,
and in which dtype arithmetic on a value runs (half types are computed, and held in
registers, as float32, as eager's CUDA kernels do)."""
from __future__ import annotations

import torch

# real floating, integer and bool dtypes; anything else (complex, float8, unsigned wider than
# 8 bits) runs through ATen
KERNEL_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool,
})

LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic on ``dtype`` values runs in (and a kernel holds them in)."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


_SHORT_DTYPE = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
                torch.uint8: "u8", torch.bool: "b8"}


def short_dtype(dtype: torch.dtype) -> str:
    """The dtype as the printed records spell it (``f32``)."""
    return _SHORT_DTYPE.get(dtype, str(dtype).replace("torch.", ""))
