"""Lowering of functionalized RNG's draws: ``aotforge::philox_rand`` (aotforge/philox.py) is
generated inside the kernel that uses it, from the seed and the element's counter.

    philox_rand(seed, offset, size, dtype)[i] = uniform(philox(seed, offset + i))

The kernel computes the draw and its float32 in [0, 1) in one instruction (``philox_uniform``:
Triton's ``tl.rand(seed, counter)``, a C++ helper on the CPU) with the same arithmetic as the
reference implementation, so the generated numbers equal the ATen ones bit for bit. Being a pure function
of the index, a draw fuses into its users and may be recomputed, like any pointwise op.
"""
from __future__ import annotations

from typing import Any, Sequence

import sympy
import torch

from ... import philox
from ..ir import Pointwise, Value, contiguous_strides
from ..ops import ops
from .registry import LoweringContext, NotLowerable, as_value, register, static_ints


@register(philox.philox_rand)
def philox_rand(ctx: LoweringContext, seed: Any, offset: Any, size: Sequence[Any], dtype: torch.dtype) -> Value:
    seed = as_value(seed)
    if seed.size or seed.dtype != torch.int64:
        raise NotLowerable("the seed must be a 0-d int64 tensor")
    if not isinstance(offset, int):
        raise NotLowerable("symbolic counter offsets are not lowered")
    shape = static_ints(size)
    strides = contiguous_strides(shape)
    load_seed = seed.make_loader()
    # 32-bit counters where every counter fits (the same draws: Philox keys on the value); the
    # GPU emulates 64-bit integer arithmetic
    numel = 1
    for dim in shape:
        numel *= dim
    counter_dtype = torch.int32 if 0 <= offset and offset + numel < 2**31 else torch.int64

    def fn(index):
        linear = sum((i * s for i, s in zip(index, strides)), sympy.Integer(0))
        counter = ops.add(ops.index_expr(linear, counter_dtype), ops.constant(offset, counter_dtype))
        uniform = ops.philox_uniform(load_seed([]), counter)
        return ops.to_dtype(uniform, dtype, torch.float32) if dtype != torch.float32 else uniform

    return Pointwise(shape, dtype, seed.device, fn)
