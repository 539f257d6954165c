"""Views: new index maps over the same data, never copies.

A view of a realized buffer is a new ``StorageView`` (size, stride, offset); a view of a lazy
``Pointwise`` wraps its loader with an index remapping::

    permute(StorageView(buf0, [4, 8], [8, 1]), [1, 0]) -> StorageView(buf0, [8, 4], [1, 8])
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import sympy
import torch

from ..expr import ModularIndexing
from ..ir import (Pointwise, StorageView, Value, contiguous_strides, product, same_size,
                  static_int, strided_index, sympify_size)
from ..indexing import split_flat
from .registry import LOWERINGS, LoweringContext, NotLowerable, normalize_dim, register, size_exprs, static, static_ints

aten = torch.ops.aten


def remap(x: Value, size: Sequence[Any], index_map, reapply=None) -> Pointwise:
    """A lazy view: element ``index`` of the result is element ``index_map(index)`` of x.

    ``reapply`` (for views that keep every element: permute, expand, reshape, unsqueeze,
    squeeze) redoes the view on x's buffer, so that when the view must be realized (an ATen
    matmul reads ``grad.t()``), x is computed once in its own layout and the view stays a view
    rather than becoming a transposing copy."""
    load = x.make_loader()
    out = Pointwise(size, x.dtype, x.device, lambda index: load(index_map(index)))
    if reapply is not None:
        out.view_of = (x, reapply)
    return out


def _meta_view(x: StorageView, method: str, *args: Any) -> StorageView:
    """Let torch's own view rules compute the strides, on a meta tensor."""
    meta = torch.empty_strided([int(s) for s in x.size], [int(s) for s in x.stride], dtype=x.dtype, device="meta")
    out = getattr(meta, method)(*args)
    return StorageView(x.buffer, list(out.shape), list(out.stride()), x.offset + out.storage_offset())


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view(ctx: LoweringContext, x: Value, size: Sequence[Any]) -> Value:
    size = size_exprs(size)
    if -1 in size:
        known = product([s for s in size if s != -1])
        size[size.index(-1)] = _exact_quotient(product(x.size), known) if known != 0 else sympy.Integer(0)
    all_static = all(s.is_Integer for s in list(size) + list(x.size))
    if isinstance(x, StorageView):
        if all_static and all(s.is_Integer for s in x.stride):
            try:
                return _meta_view(x, "view", [int(s) for s in size])
            except RuntimeError:
                pass  # not expressible as strides: fall through to an index remap
        else:
            strides = _view_strides(x, size, _reshape_groups(x.size, size, ctx.hint))
            if strides is not None:
                return StorageView(x.buffer, size, strides, x.offset)
    return remap(x, size, _reshape_index_map(x.size, size, ctx.hint), lambda base: view(ctx, base, size))


def _exact_quotient(total: Any, known: Any) -> sympy.Expr:
    quotient = sympy.cancel(total / known)
    if sympy.fraction(quotient)[1] != 1:
        raise NotLowerable(f"cannot divide the size {total} by {known} exactly")
    return sympy.expand(quotient)


def _view_strides(x: StorageView, new_size: list, groups: list) -> Optional[list]:
    """Strides for viewing ``x`` as ``new_size`` without a copy (symbolic sizes), or None:
    within each group of merged or split dimensions the old dimensions must be one
    contiguous run, which the new dimensions then subdivide."""
    strides: list = [sympy.Integer(0)] * len(new_size)
    for old_group, new_group in groups:
        real = [d for d in old_group if x.size[d] != 1]
        for outer, inner in zip(real, real[1:]):
            if not same_size(x.stride[outer], x.stride[inner] * x.size[inner]):
                return None
        running = x.stride[real[-1]] if real else sympy.Integer(1)
        for d in reversed(new_group):
            strides[d] = running
            running = running * new_size[d]
    return strides


def _reshape_groups(old_size, new_size, hint) -> list:
    """Dimensions of a reshape's input and output, in groups of equal element count
    (``[2, 16, 32] -> [32, 32]``: ``([0, 1], [0]), ([2], [1])``). Symbolic sizes are ordered by
    their hints; a group whose counts are not equal for every size is refused."""
    groups, old, new = [], 0, 0
    while old < len(old_size) or new < len(new_size):
        old_group, new_group = [], []
        old_product = new_product = sympy.Integer(1)
        while True:
            if hint(old_product) <= hint(new_product) and old < len(old_size) and (
                    hint(old_product) < hint(new_product) or not old_group or old_size[old] == 1):
                old_group.append(old)
                old_product = old_product * old_size[old]
                old += 1
            elif new < len(new_size) and (hint(new_product) < hint(old_product) or not new_group or new_size[new] == 1):
                new_group.append(new)
                new_product = new_product * new_size[new]
                new += 1
            else:
                break
            if same_size(old_product, new_product) and (old >= len(old_size) or old_size[old] != 1) \
                    and (new >= len(new_size) or new_size[new] != 1):
                break
        if not same_size(old_product, new_product):
            raise NotLowerable(f"reshape {list(old_size)} -> {list(new_size)}: groups differ for some sizes")
        groups.append((old_group, new_group))
    return groups


def _reshape_index_map(old_size, new_size, hint=int):
    """Map a reshape's output index to its input index group by group: dimensions that merge
    or split stay local (``[2, 16, 32] -> [32, 32]`` touches only the first two), so index
    expressions stay simple enough to compare and to print::

        [2, 16, 32] -> [32, 32]:  (i, j) -> (i // 16, i % 16, j)
    """
    groups = _reshape_groups(old_size, new_size, hint)

    def index_map(index):
        out = [sympy.Integer(0)] * len(old_size)
        for old_group, new_group in groups:
            flat = strided_index([index[d] for d in new_group], contiguous_strides([new_size[d] for d in new_group]))
            for d, i in zip(old_group, split_flat(flat, [old_size[d] for d in old_group])):
                out[d] = i
        return out
    return index_map


@register(aten.permute.default)
def permute(ctx: LoweringContext, x: Value, dims: Sequence[int]) -> Value:
    dims = [normalize_dim(d, len(x.size)) for d in dims]
    if isinstance(x, StorageView):
        return StorageView(x.buffer, [x.size[d] for d in dims], [x.stride[d] for d in dims], x.offset)
    inverse = [dims.index(d) for d in range(len(dims))]
    return remap(x, [x.size[d] for d in dims], lambda index: [index[inverse[d]] for d in range(len(dims))],
                 lambda base: permute(ctx, base, dims))


@register(aten.transpose.int)
def transpose(ctx: LoweringContext, x: Value, a: int, b: int) -> Value:
    dims = list(range(len(x.size)))
    a, b = normalize_dim(a, len(dims)), normalize_dim(b, len(dims))
    dims[a], dims[b] = dims[b], dims[a]
    return permute(ctx, x, dims)


@register(aten.t.default)
def t(ctx: LoweringContext, x: Value) -> Value:
    return permute(ctx, x, list(reversed(range(len(x.size)))))


@register(aten.expand.default)
def expand(ctx: LoweringContext, x: Value, size: Sequence[Any], *, implicit: bool = False) -> Value:
    size = size_exprs(size)
    skip = len(size) - len(x.size)
    new_size = [x.size[d - skip] if s == -1 else s for d, s in enumerate(size)]
    if isinstance(x, StorageView):
        stride = [sympy.Integer(0)] * skip + [
            x.stride[d] if same_size(x.size[d], new_size[skip + d]) else sympy.Integer(0) for d in range(len(x.size))]
        return StorageView(x.buffer, new_size, stride, x.offset)
    own = x.size
    return remap(x, new_size, lambda index: [sympy.Integer(0) if own[d] == 1 else index[skip + d]
                                             for d in range(len(own))], lambda base: expand(ctx, base, size))


@register(aten.unsqueeze.default)
def unsqueeze(ctx: LoweringContext, x: Value, dim: int) -> Value:
    dim = normalize_dim(dim, len(x.size) + 1)
    if isinstance(x, StorageView):
        return StorageView(x.buffer, x.size[:dim] + [sympy.Integer(1)] + x.size[dim:],
                           x.stride[:dim] + [sympy.Integer(1)] + x.stride[dim:], x.offset)
    return remap(x, x.size[:dim] + [sympy.Integer(1)] + x.size[dim:], lambda index: index[:dim] + index[dim + 1:],
                 lambda base: unsqueeze(ctx, base, dim))


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(ctx: LoweringContext, x: Value, dims: Any = None) -> Value:
    rank = len(x.size)
    if dims is None:
        dims = list(range(rank))
    elif isinstance(dims, int):
        dims = [dims]
    dims = {normalize_dim(d, rank) for d in dims} if rank else set()
    keep = [d for d in range(rank) if not (d in dims and x.size[d] == 1)]
    if isinstance(x, StorageView):
        return StorageView(x.buffer, [x.size[d] for d in keep], [x.stride[d] for d in keep], x.offset)

    def index_map(index):
        full = [sympy.Integer(0)] * rank
        for position, d in enumerate(keep):
            full[d] = index[position]
        return full
    return remap(x, [x.size[d] for d in keep], index_map, lambda base: squeeze(ctx, base, sorted(dims)))


@register(aten.slice.Tensor)
def slice_(ctx: LoweringContext, x: Value, dim: int = 0, start: Any = None, end: Any = None, step: int = 1,
           count: Any = None) -> Value:
    """``count`` (the result's length along ``dim``) is taken from the node's fake value when
    any size involved is symbolic: clamping a symbolic range needs min/max, which eager has
    already decided for the example and Dynamo guarded."""
    dim = normalize_dim(dim, len(x.size))
    step = static(step)
    length = static_int(x.size[dim])
    bounds = [b for b in (start, end) if b is not None]
    if length is not None and all(static_int(b) is not None for b in bounds):
        start, end = 0 if start is None else int(start), length if end is None else int(end)
        start = max(0, start + length if start < 0 else start)
        end = min(length, max(0, end + length if end < 0 else end))
        count = sympy.Integer(max(0, (end - start + step - 1) // step))
    else:
        if count is None:
            if not isinstance(ctx.value, torch.Tensor):
                raise NotLowerable("a symbolic slice whose length is unknown")
            count = sympify_size(ctx.value.shape)[dim]
        start = sympy.Integer(0) if start is None else sympy.sympify(start)
        if start.is_negative:  # from the end (``x[-n:]``); sympy knows sizes are positive
            start = sympy.expand(start + x.size[dim])
        if not start.is_nonnegative:
            raise NotLowerable(f"a slice start {start} whose sign depends on the sizes")
    start = static_int(start) if static_int(start) is not None else start
    size = list(x.size)
    size[dim] = count
    if isinstance(x, StorageView):
        stride = list(x.stride)
        stride[dim] = x.stride[dim] * step
        return StorageView(x.buffer, size, stride, x.offset + start * x.stride[dim])
    return remap(x, size, lambda index: index[:dim] + [index[dim] * step + start] + index[dim + 1:])


@register(aten.select.int)
def select(ctx: LoweringContext, x: Value, dim: int, position: int) -> Value:
    dim = normalize_dim(dim, len(x.size))
    position = static(position)
    if position < 0:
        position = x.size[dim] + position
    if isinstance(x, StorageView):
        return StorageView(x.buffer, x.size[:dim] + x.size[dim + 1:], x.stride[:dim] + x.stride[dim + 1:],
                           x.offset + position * x.stride[dim])
    return remap(x, x.size[:dim] + x.size[dim + 1:], lambda index: index[:dim] + [sympy.Integer(position)] + index[dim:])


@register(aten.split.Tensor)
def split(ctx: LoweringContext, x: Value, split_size: int, dim: int = 0) -> tuple:
    length = static(x.size[normalize_dim(dim, len(x.size))])
    sizes = [min(split_size, length - start) for start in range(0, length, split_size)] or [0]
    return split_with_sizes(ctx, x, sizes, dim)


@register(aten.split_with_sizes.default)
def split_with_sizes(ctx: LoweringContext, x: Value, sizes: Sequence[int], dim: int = 0) -> tuple:
    out, start = [], sympy.Integer(0)
    for size in size_exprs(sizes):
        out.append(slice_(ctx, x, dim, start, start + size, count=size))
        start = start + size
    return tuple(out)


@register(aten.unbind.int)
def unbind(ctx: LoweringContext, x: Value, dim: int = 0) -> tuple:
    return tuple(select(ctx, x, dim, i) for i in range(static(x.size[normalize_dim(dim, len(x.size))])))


@register(aten.as_strided.default)
def as_strided(ctx: LoweringContext, x: Value, size: Sequence[int], stride: Sequence[int], storage_offset: Any = None) -> Value:
    """Only on a buffer we own, whose storage starts at its data pointer. The strides index
    ``x``'s storage as eager lays it out, so ``x`` is read from a buffer in its eager strides:
    stored so if not stored yet, or copied so if stored otherwise (a lazy clone is its source
    until stored: a channels-last clone of a pad, a ``permute().contiguous()`` stored as the
    permuted base, had the taps read the wrong elements)."""
    source = ctx.node.args[0] if ctx.node.args else None
    source_val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    eager_stride = sympify_size(source_val.stride()) if isinstance(source_val, torch.Tensor) else None
    x = ctx.realize(x, eager_stride)
    if eager_stride is not None and not all(
            n == 1 or same_size(s, e) for n, s, e in zip(x.size, x.stride, eager_stride)):
        x = ctx.realize(Pointwise(x.size, x.dtype, x.device, x.make_loader()), eager_stride)
    base_offset = getattr(x.buffer, "storage_offset", 0)
    offset = sympy.sympify((storage_offset if storage_offset is not None else base_offset) - base_offset)
    if static_int(offset) is None or static_int(offset) < 0:
        raise NotLowerable("as_strided before the buffer's start, or at a symbolic offset")
    return StorageView(x.buffer, size_exprs(size), size_exprs(stride), offset)


@register(aten.diagonal.default)
def diagonal(ctx: LoweringContext, x: Value, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Value:
    rank = len(x.size)
    dim1, dim2 = normalize_dim(dim1, rank), normalize_dim(dim2, rank)
    length = max(0, min(static(x.size[dim1]) - max(-offset, 0), static(x.size[dim2]) - max(offset, 0)))
    rest = [d for d in range(rank) if d not in (dim1, dim2)]

    def index_map(index):
        full = [sympy.Integer(0)] * rank
        for position, d in enumerate(rest):
            full[d] = index[position]
        full[dim1] = index[-1] + max(-offset, 0)
        full[dim2] = index[-1] + max(offset, 0)
        return full
    return remap(x, [x.size[d] for d in rest] + [sympy.Integer(length)], index_map)



def _register_copy_variants() -> None:
    """``permute_copy`` etc. (what functionalization emits) lower like their views: in a
    functional graph a view and a copy of it are indistinguishable."""
    for base in ["view", "permute", "expand", "slice", "select", "squeeze", "unsqueeze", "transpose", "t",
                 "alias", "as_strided", "diagonal", "split", "split_with_sizes", "unbind", "_unsafe_view"]:
        copy_packet = getattr(aten, f"{base}_copy", None)
        base_packet = getattr(aten, base, None)
        if copy_packet is None or base_packet is None:
            continue
        for overload in copy_packet.overloads():
            source = getattr(base_packet, overload, None) if overload in base_packet.overloads() else None
            if source is not None and source in LOWERINGS:
                LOWERINGS[getattr(copy_packet, overload)] = LOWERINGS[source]


_register_copy_variants()


@register(aten.repeat.default)
def repeat(ctx: LoweringContext, x: Value, repeats: Sequence[int]) -> Value:
    """Tiling is an index map: element i of a repeated dim reads element i mod size."""
    repeats = static_ints(repeats)
    skip = len(repeats) - len(x.size)
    own = x.size
    size = [sympy.Integer(r) for r in repeats[:skip]] + [n * r for n, r in zip(own, repeats[skip:])]
    return remap(x, size, lambda index: [ModularIndexing(index[skip + d], 1, own[d]) if repeats[skip + d] != 1
                                         else index[skip + d] for d in range(len(own))])


@register(aten.flip.default)
def flip(ctx: LoweringContext, x: Value, dims: Sequence[int]) -> Value:
    dims = {normalize_dim(d, len(x.size)) for d in dims}
    size = x.size
    return remap(x, size, lambda index: [size[d] - 1 - index[d] if d in dims else index[d] for d in range(len(size))])
