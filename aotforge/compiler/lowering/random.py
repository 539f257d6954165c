"""Lowering of functionalized RNG's draws: ``aotforge::philox_rand`` (aotforge/philox.py) is
generated inside the kernel that uses it, from the seed and the element's counter.

    philox_rand(seed, offset, size, dtype)[i] = uniform(philox(seed, offset + i))

The kernel computes Triton's ``tl.randint(seed, counter)`` (instruction ``philox_bits``) and
turns the 32 bits into a float32 in [0, 1) with the same arithmetic as the reference
implementation, so the generated numbers equal the ATen ones bit for bit. Being a pure function
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


def _uniform_from_bits(bits: Any) -> Any:
    """uint32 held in int64 -> float32 in [0, 1), as ``philox.uint32_to_uniform``."""
    int64 = torch.int64
    signed = ops.where(ops.ge(bits, ops.constant(2**31, int64)), ops.sub(bits, ops.constant(2**32, int64)), bits)
    folded = ops.where(ops.lt(signed, ops.constant(0, int64)),
                       ops.sub(ops.neg(signed), ops.constant(1, int64)), signed)
    as_float = ops.to_dtype(folded, torch.float32, int64)
    return ops.mul(as_float, ops.constant(philox.UNIFORM_SCALE, torch.float32))


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

    def fn(index):
        linear = sum((i * s for i, s in zip(index, strides)), sympy.Integer(0))
        counter = ops.add(ops.index_expr(linear, torch.int64), ops.constant(offset, torch.int64))
        uniform = _uniform_from_bits(ops.philox_bits(load_seed([]), counter))
        return ops.to_dtype(uniform, dtype, torch.float32) if dtype != torch.float32 else uniform

    return Pointwise(shape, dtype, seed.device, fn)
