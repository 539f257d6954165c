"""Lowerings that build tensors or gather from them: full, arange, cat, pad, index, gather,
scatter-by-slice, and ``copy_`` into a graph input (the one mutation a graph may contain)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import sympy
import torch

from ..dtypes import compute_dtype
from ..expr import FloorDiv
from ..index_checks import index_check
from ..ir import Pointwise, StorageView, Value, same_size, static_int, sympify_size
from ..ops import ops
from .pointwise import _cast
from .registry import (LoweringContext, NotLowerable, broadcast_loader, broadcast_shapes, normalize_dim, register,
                       size_exprs, static, static_ints)

aten = torch.ops.aten
prims = torch.ops.prims


def _meta_device(ctx: LoweringContext) -> torch.device:
    val = ctx.value
    if not isinstance(val, torch.Tensor):
        raise NotLowerable("creation op without a tensor result")
    return val.device


@register(aten.full.default)
def full(ctx: LoweringContext, size: Sequence[Any], fill_value: Any, **kwargs: Any) -> Value:
    dtype = ctx.result_dtype()
    return Pointwise(size_exprs(size), dtype, _meta_device(ctx), lambda index: ops.constant(fill_value, dtype))


@register(aten.full_like.default)
def full_like(ctx: LoweringContext, x: Value, fill_value: Any, **kwargs: Any) -> Value:
    dtype = ctx.result_dtype()
    return Pointwise(x.size, dtype, _meta_device(ctx), lambda index: ops.constant(fill_value, dtype))


@register(aten.scalar_tensor.default)
def scalar_tensor(ctx: LoweringContext, value: Any, **kwargs: Any) -> Value:
    dtype = ctx.result_dtype()
    return Pointwise([], dtype, _meta_device(ctx), lambda index: ops.constant(value, dtype))


@register(aten.arange.default)
def arange_end(ctx: LoweringContext, end: Any, **options: Any) -> Value:
    return arange(ctx, 0, end, 1)


@register(prims.iota.default)
def iota(ctx: LoweringContext, length: Any, *, start: Any, step: Any, **options: Any) -> Value:
    return arange(ctx, start, None, step)


@register(aten.arange.start, aten.arange.start_step)
def arange(ctx: LoweringContext, start: Any, end: Any, step: Any = 1, **options: Any) -> Value:
    """``start + step * i``; the length comes from the node's value. ``start`` and ``step`` are
    read by the overload's schema (either may be a symbolic size: ``arange(n - 1, -1, -1)``)."""
    dtype = ctx.result_dtype()
    length = sympify_size(ctx.value.shape)[0]
    if isinstance(step, sympy.Expr) and not step.is_Number:
        raise NotLowerable("arange with a symbolic step")
    compute = compute_dtype(dtype)
    integral = not compute.is_floating_point and not isinstance(start, float) and not isinstance(step, float)

    def fn(index):
        position = ops.index_expr(index[0], torch.int64)
        if integral:
            value = ops.add(ops.mul(position, value_of(step, torch.int64)), value_of(start, torch.int64))
            return _to(value, dtype, torch.int64)
        value = ops.add(ops.mul(ops.to_dtype(position, compute, torch.int64), value_of(step, compute)),
                        value_of(start, compute))
        return _to(value, dtype, compute)
    return Pointwise([length], dtype, _meta_device(ctx), fn)


def value_of(number: Any, dtype: torch.dtype) -> Any:
    """A number in a kernel: a constant, or (a symbolic size) the kernel's size argument."""
    if isinstance(number, sympy.Expr) and not number.is_Number:
        return _to(ops.index_expr(number, torch.int64), dtype, torch.int64)
    return ops.constant(int(number) if isinstance(number, sympy.Expr) else number, dtype)


def _at_least(size: Any, bound: Any) -> bool:
    """``size >= bound`` for every value of their symbols (as far as we can tell)."""
    if same_size(size, bound):
        return True
    return static_int(size) is not None and static_int(bound) is not None and int(size) >= int(bound)


def _to(value, dtype, source):
    return ops.to_dtype(value, dtype, source) if dtype != source else value


@register(aten.cat.default)
def cat(ctx: LoweringContext, tensors: Sequence[Value], dim: int = 0) -> Value:
    """Each output element loads from the one input whose range along ``dim`` holds it."""
    tensors = [t for t in tensors if not (len(t.size) == 1 and t.size[0] == 0)]
    if not tensors:
        raise NotLowerable("cat of empty tensors")
    dtype = ctx.result_dtype()
    dim = normalize_dim(dim, len(tensors[0].size))
    starts, total = [], sympy.Integer(0)
    for t in tensors:
        starts.append(total)
        total = total + t.size[dim]
    size = list(tensors[0].size)
    size[dim] = total
    loaders = [broadcast_loader(t, t.size, dtype) for t in tensors]

    def fn(index):
        position = index[dim]
        result = None
        for t, start, load in zip(tensors, starts, loaders):
            end = start + t.size[dim]
            shifted = index[:dim] + [position - start] + index[dim + 1:]
            where_ = ops.index_expr(position, torch.int64)
            inside = None
            if start != 0:
                inside = ops.ge(where_, value_of(start, torch.int64))
            if not same_size(end, total):
                below = ops.lt(where_, value_of(end, torch.int64))
                inside = below if inside is None else ops.logical_and(inside, below)
            if inside is None:
                return load(shifted)
            value = ops.masked(inside, lambda s=shifted, l=load: l(s), 0)
            result = value if result is None else ops.where(inside, value, result)
        return result
    return Pointwise(size, dtype, ctx.device(tensors), fn)


@register(aten.constant_pad_nd.default)
def constant_pad_nd(ctx: LoweringContext, x: Value, pad: Sequence[int], value: Any = 0) -> Value:
    pad = static_ints(pad)
    rank = len(x.size)
    size = list(x.size)
    lows = [0] * rank
    for i in range(len(pad) // 2):
        d = rank - 1 - i
        lows[d] = pad[2 * i]
        size[d] = size[d] + pad[2 * i] + pad[2 * i + 1]
    load, dtype = x.make_loader(), x.dtype

    def fn(index):
        source = [i - low for i, low in zip(index, lows)]
        mask = None
        for d, (i, low) in enumerate(zip(source, lows)):
            if low == 0 and same_size(size[d], x.size[d]):
                continue
            position = ops.index_expr(i, torch.int64)
            inside = ops.logical_and(ops.ge(position, ops.constant(0, torch.int64)),
                                     ops.lt(position, value_of(x.size[d], torch.int64)))
            mask = inside if mask is None else ops.logical_and(mask, inside)
        if mask is None:
            return load(source)
        return ops.where(mask, ops.masked(mask, lambda: load(source), value), ops.constant(value, dtype))
    return Pointwise(size, dtype, x.device, fn)


def _indirect(index_value: Value, index_at, size: Any, check: str):
    # ``check``: the op's bounds rule and error (index_checks.py: eager's differ by op)
    load = index_value.make_loader()
    return ops.indirect_indexing(load(index_at), size, check)


@register(aten.index.Tensor)
def index(ctx: LoweringContext, x: Value, indices: Sequence[Optional[Value]]) -> Value:
    """Advanced indexing with integer index tensors (boolean masks are data-dependent and run
    as ATen calls)."""
    indices = list(indices) + [None] * (len(x.size) - len(indices))
    positions = [d for d, i in enumerate(indices) if i is not None]
    if any(indices[d].dtype == torch.bool for d in positions):
        raise NotLowerable("boolean mask indexing")
    broadcast = broadcast_shapes(*[indices[d].size for d in positions])
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    rest = [d for d in range(len(x.size)) if indices[d] is None]
    if adjacent:
        first = positions[0]
        size = x.size[:first] + broadcast + x.size[positions[-1] + 1:]
    else:
        first = 0
        size = broadcast + [x.size[d] for d in rest]
    load = x.make_loader()

    def fn(index_):
        bidx = index_[first:first + len(broadcast)]
        other = index_[:first] + index_[first + len(broadcast):]
        full: list[Any] = [None] * len(x.size)
        for d in positions:
            t = indices[d]
            at = [sympy.Integer(0) if n == 1 else bidx[len(broadcast) - len(t.size) + k] for k, n in enumerate(t.size)]
            full[d] = _indirect(t, at, x.size[d], index_check("index", d))
        for d, i in zip(rest, other):
            full[d] = i
        return load(full)
    return Pointwise(size, x.dtype, x.device, fn)


@register(aten.gather.default)
def gather(ctx: LoweringContext, x: Value, dim: int, index_: Value, *, sparse_grad: bool = False) -> Value:
    if not x.size or not index_.size:
        raise NotLowerable("gather on a 0-d tensor (ATen checks its index)")
    dim = normalize_dim(dim, len(x.size))
    load = x.make_loader()

    def fn(position):
        full = list(position)
        full[dim] = _indirect(index_, position, x.size[dim], index_check("gather", dim))
        return load(full)
    return Pointwise(index_.size, x.dtype, x.device, fn)


@register(aten.index_select.default)
def index_select(ctx: LoweringContext, x: Value, dim: int, index_: Value) -> Value:
    if not x.size:
        raise NotLowerable("index_select of a 0-d tensor")
    dim = normalize_dim(dim, len(x.size))
    load = x.make_loader()
    size = list(x.size)
    size[dim] = index_.size[0] if index_.size else sympy.Integer(1)
    # (eager's kernel for dimension 1 of a tensor of 2 or more dimensions has its own message)
    check = index_check("select_dim1" if dim == 1 and len(x.size) > 1 else "select")

    def fn(position):
        full = list(position)
        full[dim] = _indirect(index_, [position[dim]] if index_.size else [], x.size[dim], check)
        return load(full)
    return Pointwise(size, x.dtype, x.device, fn)


@register(aten.embedding.default)
def embedding(ctx: LoweringContext, weight: Value, indices: Value, padding_idx: int = -1, scale_grad: bool = False,
              sparse: bool = False) -> Value:
    load = weight.make_loader()
    size = list(indices.size) + [weight.size[1]]

    def fn(position):
        return load([_indirect(indices, position[:-1], weight.size[0], index_check("select")), position[-1]])
    return Pointwise(size, weight.dtype, weight.device, fn)


@register(aten.slice_scatter.default)
def slice_scatter(ctx: LoweringContext, x: Value, source: Value, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Value:
    dim = normalize_dim(dim, len(x.size))
    length = static(x.size[dim])
    start = 0 if start is None else static(start)
    end = length if end is None else static(end)
    start, end = (start + length if start < 0 else start), min(length, end + length if end < 0 else end)
    load_x, load_source = x.make_loader(), broadcast_loader(source, source.size, x.dtype)

    def fn(index_):
        position = ops.index_expr(index_[dim], torch.int64)
        inside = ops.logical_and(ops.ge(position, ops.constant(start, torch.int64)),
                                 ops.lt(position, ops.constant(end, torch.int64)))
        if step != 1:
            offset = ops.sub(position, ops.constant(start, torch.int64))
            inside = ops.logical_and(inside, ops.eq(ops.remainder(offset, ops.constant(step, torch.int64)),
                                                    ops.constant(0, torch.int64)))
        shifted = index_[:dim] + [FloorDiv(index_[dim] - start, step)] + index_[dim + 1:]
        return ops.where(inside, ops.masked(inside, lambda: load_source(shifted), 0), load_x(index_))
    return Pointwise(x.size, x.dtype, x.device, fn)


@register(aten.select_scatter.default)
def select_scatter(ctx: LoweringContext, x: Value, source: Value, dim: int, position: int) -> Value:
    dim = normalize_dim(dim, len(x.size))
    position = static(position) + (static(x.size[dim]) if static(position) < 0 else 0)
    load_x, load_source = x.make_loader(), broadcast_loader(source, source.size, x.dtype)

    def fn(index_):
        here = ops.eq(ops.index_expr(index_[dim], torch.int64), ops.constant(position, torch.int64))
        return ops.where(here, ops.masked(here, lambda: load_source(index_[:dim] + index_[dim + 1:]), 0), load_x(index_))
    return Pointwise(x.size, x.dtype, x.device, fn)


@register(aten.copy_.default)
def copy_(ctx: LoweringContext, destination: Value, source: Value, non_blocking: bool = False) -> Value:
    """``copy_`` into a graph input: the kernel writes the new values into the input itself."""
    graph = ctx.graph
    if not (isinstance(destination, StorageView) and destination.buffer.name in graph.input_names):
        raise NotLowerable("copy_ into something other than a graph input")
    value = _cast(Pointwise(destination.size, source.dtype, destination.device,
                            broadcast_loader(source, destination.size, source.dtype)), destination.dtype)
    graph.add_mutation(destination, value)
    return destination



@register(aten.scatter.value, aten.scatter.src)
def scatter(ctx: LoweringContext, x: Value, dim: int, index_: Value, source: Any) -> Value:
    """One index per row along ``dim`` (a one-hot, as in cross-entropy's backward) is a gather
    seen from the output: element i takes the source where i[dim] == index[i with dim=0]."""
    if not x.size or not index_.size:
        raise NotLowerable("scatter into a 0-d tensor (ATen checks its index)")
    dim = normalize_dim(dim, len(x.size))
    expected = [sympy.Integer(1) if d == dim else x.size[d] for d in range(len(x.size))]
    if list(index_.size) != expected:
        raise NotLowerable("scatter with more than one index per row")
    if isinstance(source, Value) and (len(source.size) != len(expected)
                                      or not all(_at_least(s, e) for s, e in zip(source.size, expected))):
        raise NotLowerable("scatter source smaller than its index")
    load_x, load_index = x.make_loader(), index_.make_loader()
    load_source = source.make_loader() if isinstance(source, Value) else None

    def fn(position):
        row = position[:dim] + [sympy.Integer(0)] + position[dim + 1:]
        here = ops.eq(ops.index_expr(position[dim], torch.int64),
                      ops.to_dtype(load_index(row), torch.int64, index_.dtype))
        value = (ops.to_dtype(load_source(row), x.dtype, source.dtype) if load_source is not None
                 else ops.constant(source, x.dtype))
        return ops.where(here, value, load_x(position))
    return Pointwise(x.size, x.dtype, x.device, fn)
