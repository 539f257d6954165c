"""Reductions: each becomes a ``ReductionBody`` over (kept dims, reduced dims); the values
being reduced are computed inline (a pointwise prologue), so ``sum(x * y)`` reads x and y
once and never stores ``x * y``."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import sympy
import torch

from ...config import config
from ..dtypes import compute_dtype
from ..expr import FloorDiv
from ..ir import Pointwise, StorageView, Value, contiguous_strides, product, static_int
from ..indexing import split_flat
from ..ops import ops
from ..reduction_kinds import REDUCTIONS
from .pointwise import _cast as cast_value
from .registry import LoweringContext, NotLowerable, normalize_dim, register
from .views import squeeze

aten = torch.ops.aten


def reduce(ctx: LoweringContext, x: Value, dims: Optional[Sequence[int]], keepdim: bool, reduction_type: str,
           out_dtype: torch.dtype, source_dtype: torch.dtype) -> Value:
    """Reduce ``x`` over ``dims`` (None or [] = all) with ``reduction_type``."""
    rank = len(x.size)
    dims = sorted({normalize_dim(d, rank) for d in dims}) if dims and rank else list(range(rank))
    kept = [d for d in range(rank) if d not in dims]
    ranges = [x.size[d] for d in kept]
    reduction_ranges = [x.size[d] for d in dims]
    if product(reduction_ranges) == 0 or product(ranges) == 0:
        raise NotLowerable("empty reductions run as ATen calls")
    load, source = x.make_loader(), x.dtype
    if product(reduction_ranges) == 1:
        return _reduce_single(x, dims, kept, keepdim, reduction_type, out_dtype, source_dtype)

    def value_at(index, rindex):
        full: list[Any] = [None] * rank
        for d, i in zip(kept, index):
            full[d] = i
        for d, i in zip(dims, rindex):
            full[d] = i
        value = load(full)
        return ops.to_dtype(value, source_dtype, source) if source != source_dtype else value

    # symbolic sizes: as many pieces as the hints ask for; the last piece may be short
    # a GPU reduction that keeps the last dim runs down the columns of a row-major tensor
    column = x.device.type == "cuda" and rank - 1 not in dims
    splits = _split_count(ctx.hint(product(ranges)), ctx.hint(product(reduction_ranges)), reduction_type,
                          exact=static_int(product(reduction_ranges)) is not None, column=column)
    if splits > 1:
        out = _split_reduction(ctx.graph, ranges, reduction_ranges, reduction_type, value_at, source_dtype, out_dtype,
                               x.device, splits)
    else:
        out = ctx.graph.add_reduction(ranges, reduction_ranges, reduction_type, value_at,
                                      source_dtype, out_dtype, x.device)
    if keepdim:
        # the kept dims of a reduction's buffer are contiguous; the size-1 dims get the strides
        # eager gives them, so a graph output (or a view's base) has eager's exact layout
        size = list(out.size)
        for d in dims:
            size.insert(d, sympy.Integer(1))
        out = StorageView(out.buffer, size, contiguous_strides(size), out.offset)
    return out


def _split_count(numel: int, rnumel: int, reduction_type: str, exact: bool = True, column: bool = False) -> int:
    """How many pieces to cut each reduction into. A few long reductions (the column sums of
    a layer norm's backward: 4096 outputs over 16384 rows each) leave most of a GPU idle; cut
    into pieces they become many short reductions plus a small second pass. ``exact``: the
    pieces must divide the reduced length (static sizes; symbolic ones mask the last piece).

    ``column``: a GPU reduction down columns. Its kernel walks 64 columns per program
    (runtime/launch.py), so even 30,000 columns (BERT's MLM bias gradient: 30,522 over 8,192
    rows) make ~500 programs that each walk every row, too few loads in flight: 1.85 ms on an
    H200 for 500 MB. Those are cut until there are about 4,096 programs."""
    if not REDUCTIONS[reduction_type].splittable or rnumel < config.split_reduction_threshold:
        return 1
    if column:
        target = min(128, rnumel // 256, max(1, 4096 * 64 // max(numel, 1)))
    elif numel >= 16384:
        return 1
    else:
        target = min(128, rnumel // 256, max(1, 65536 // max(numel, 1)))
    splits = 1
    while splits * 2 <= target and (not exact or rnumel % (splits * 2) == 0):
        splits *= 2
    return splits


def _split_reduction(graph: Any, ranges, reduction_ranges, reduction_type, value_at, source_dtype, out_dtype, device,
                     splits: int) -> StorageView:
    """reduce(x) over R elements -> reduce over ``splits`` partials of R/splits elements each::

        partial[s, i] = reduce(value_at(i, r) for r in [s*R/splits, (s+1)*R/splits))
        out[i] = reduce(partial[s, i] for s)

    A symbolic R is cut into pieces of ceil(R/splits); elements past R are masked off."""
    rnumel = sympy.expand(product(reduction_ranges))
    exact = rnumel.is_Integer and int(rnumel) % splits == 0
    piece = FloorDiv(rnumel + splits - 1, splits)

    def partial_value(index, rindex):
        flat = index[0] * piece + rindex[0]
        if exact:
            return value_at(index[1:], split_flat(flat, reduction_ranges))
        inside = ops.lt(ops.index_expr(flat, torch.int64), ops.index_expr(rnumel, torch.int64))
        value = ops.masked(inside, lambda: value_at(index[1:], split_flat(flat, reduction_ranges)),
                           REDUCTIONS[reduction_type].identity_value(source_dtype))
        return value
    partial = graph.add_reduction([sympy.Integer(splits)] + list(ranges), [piece], reduction_type,
                                  partial_value, source_dtype, source_dtype, device)
    load = partial.make_loader()
    return graph.add_reduction(list(ranges), [sympy.Integer(splits)], reduction_type,
                               lambda index, rindex: load([rindex[0]] + list(index)), source_dtype, out_dtype, device)


def _reduce_single(x: Value, dims, kept, keepdim, reduction_type, out_dtype, source_dtype) -> Value:
    """Reducing one element is elementwise: the element itself (or index 0)."""
    rank = len(x.size)
    size = [x.size[d] if d in kept else sympy.Integer(1) for d in range(rank)] if keepdim else [x.size[d] for d in kept]
    load, source = x.make_loader(), x.dtype

    def fn(index):
        if REDUCTIONS[reduction_type].returns_index:
            return ops.constant(0, out_dtype)
        full = list(index) if keepdim else [sympy.Integer(0)] * rank
        if not keepdim:
            for d, i in zip(kept, index):
                full[d] = i
        full = [sympy.Integer(0) if d in dims else full[d] for d in range(rank)]
        value = load(full)
        return ops.to_dtype(value, out_dtype, source) if out_dtype != source else value
    return Pointwise(size, out_dtype, x.device, fn)


def _dims_arg(dims: Any) -> Optional[list[int]]:
    if dims is None:
        return None
    return [dims] if isinstance(dims, int) else list(dims)


@register(aten.sum.dim_IntList, aten.sum.default)
def sum_(ctx: LoweringContext, x: Value, dims: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Value:
    out = ctx.result_dtype(dtype or x.dtype)
    return reduce(ctx, x, _dims_arg(dims), keepdim, "sum", out, compute_dtype(out))


@register(aten.prod.dim_int, aten.prod.default)
def prod(ctx: LoweringContext, x: Value, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Value:
    out = ctx.result_dtype(dtype or x.dtype)
    return reduce(ctx, x, _dims_arg(dim), keepdim, "prod", out, compute_dtype(out))


@register(aten.mean.dim, aten.mean.default)
def mean(ctx: LoweringContext, x: Value, dims: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Value:
    out = ctx.result_dtype(dtype or x.dtype)
    if not out.is_floating_point:
        raise NotLowerable("mean of an integer tensor")
    rank = len(x.size)
    dims = _dims_arg(dims) or list(range(rank))
    count = product([x.size[normalize_dim(d, rank)] for d in dims]) if rank else 1
    total = reduce(ctx, x, dims, keepdim, "sum", compute_dtype(out), compute_dtype(out))
    return _divide(total, count, out)


def _divide(total: Value, count: Any, out: torch.dtype) -> Value:
    """``total / count``; a symbolic count is read as an index expression (a kernel argument)."""
    load, source = total.make_loader(), total.dtype

    def divisor():
        if not isinstance(count, sympy.Expr) or count.is_Number:
            return ops.constant(count if not isinstance(count, sympy.Expr) else int(count), source)
        return ops.to_dtype(ops.index_expr(count, torch.int64), source, torch.int64)
    return Pointwise(total.size, out, total.device, lambda index: _cast(
        ops.truediv(load(index), divisor()), out, source))


def _cast(value, dtype, source):
    return ops.to_dtype(value, dtype, source) if dtype != source else value


@register(aten.amax.default, kind="max")
@register(aten.amin.default, kind="min")
def amax_amin(ctx: LoweringContext, x: Value, dims: Any = (), keepdim: bool = False, *, kind: str) -> Value:
    return reduce(ctx, x, _dims_arg(dims), keepdim, kind, x.dtype, compute_dtype(x.dtype))


@register(aten.max.default, kind="max")
@register(aten.min.default, kind="min")
def max_min_all(ctx: LoweringContext, x: Value, *, kind: str) -> Value:
    return reduce(ctx, x, None, False, kind, x.dtype, compute_dtype(x.dtype))


@register(aten.max.dim, kind="max")
@register(aten.min.dim, kind="min")
def max_min_dim(ctx: LoweringContext, x: Value, dim: int, keepdim: bool = False, *, kind: str) -> tuple:
    values = reduce(ctx, x, [dim], keepdim, kind, x.dtype, compute_dtype(x.dtype))
    indices = reduce(ctx, x, [dim], keepdim, "arg" + kind, torch.int64, compute_dtype(x.dtype))
    return values, indices


@register(aten.argmax.default, kind="argmax")
@register(aten.argmin.default, kind="argmin")
def argmax_argmin(ctx: LoweringContext, x: Value, dim: Any = None, keepdim: bool = False, *, kind: str) -> Value:
    if x.dtype == torch.bool:
        raise NotLowerable("argmax/argmin of bool: eager has no kernel for it and raises")
    if dim is None and keepdim:
        raise NotLowerable("argmax over all dims with keepdim")
    return reduce(ctx, x, _dims_arg(dim), keepdim, kind, torch.int64, compute_dtype(x.dtype))


@register(aten.any.default, aten.any.dim, aten.any.dims, kind="max")  # any: the max of 0/1
@register(aten.all.default, aten.all.dim, aten.all.dims, kind="min")
def any_all(ctx: LoweringContext, x: Value, dims: Any = None, keepdim: bool = False, *, kind: str) -> Value:
    load, source = x.make_loader(), x.dtype
    truth = Pointwise(x.size, torch.bool, x.device,
                      lambda index: ops.ne(load(index), ops.constant(0, compute_dtype(source))))
    if source != torch.bool:
        truth = Pointwise(x.size, torch.bool, x.device,
                          lambda index: ops.ne(ops.to_dtype(load(index), compute_dtype(source), source),
                                               ops.constant(0, compute_dtype(source))))
    else:
        truth = x
    as_int = Pointwise(x.size, torch.int32, x.device,
                       lambda index: ops.to_dtype(truth.make_loader()(index), torch.int32, torch.bool))
    # any/all of uint8 return uint8 (eager's legacy rule), of anything else bool
    return reduce(ctx, as_int, _dims_arg(dims), keepdim, kind, ctx.result_dtype(torch.bool), torch.int32)


@register(aten.var.correction, with_mean=False)
@register(aten.var_mean.correction, with_mean=True)
def var(ctx: LoweringContext, x: Value, dims: Any = None, *, correction: Any = None, keepdim: bool = False,
        with_mean: bool) -> Any:
    """Two reductions over the same rows (mean, then squared deviations); the scheduler puts
    both in one kernel, so a row is read from memory once."""
    out = x.dtype
    if not out.is_floating_point:
        raise NotLowerable("var of an integer tensor")
    compute = compute_dtype(out)
    rank = len(x.size)
    dims = _dims_arg(dims) or list(range(rank))
    count = product([x.size[normalize_dim(d, rank)] for d in dims]) if rank else 1
    correction = 1 if correction is None else correction
    average = _divide(reduce(ctx, x, dims, True, "sum", compute, compute), count, compute)
    average = ctx.realize(average)
    load_x, load_mean = x.make_loader(), average.make_loader()
    mean_size = average.size

    def squared_deviation(index):
        centered = ops.sub(_cast(load_x(index), compute, x.dtype),
                           load_mean([i if n != 1 else sympy.Integer(0) for i, n in zip(index, mean_size)]))
        return ops.mul(centered, centered)
    deviations = Pointwise(x.size, compute, x.device, squared_deviation)
    total = reduce(ctx, deviations, dims, keepdim, "sum", compute, compute)
    if static_int(count) is not None:
        divisor = max(int(count) - correction, 0)
    elif float(correction).is_integer():
        divisor = count - int(correction)
    else:
        raise NotLowerable("a fractional correction over a symbolic count")
    variance = _divide(total, divisor, out)
    if with_mean:
        mean_out = average if keepdim else reduce_view_squeeze(ctx, average, dims)
        return variance, cast_value(mean_out, out)
    return variance


def reduce_view_squeeze(ctx: LoweringContext, x: Value, dims: Sequence[int]) -> Value:
    return squeeze(ctx, x, [normalize_dim(d, len(x.size)) for d in dims])

