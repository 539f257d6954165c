"""Max pooling whose indices nobody reads becomes the maximum of strided slices: pointwise in
the loop IR, so it fuses with its producer (an inference graph's BatchNorm and ReLU) and its
consumer, reads its input once and writes no int64 indices.

ATen's ``max_pool2d_with_indices`` on the CPU is slow over NCHW input (one plane at a time,
with an index per output): 14 ms for 32 x 32 x 32 x 32 float32 on one EPYC thread against
1.0 ms over NHWC, and the BatchNorm + ReLU kernel before it writes the whole input once more.

Before (inference; a training forward saves the indices for the backward and is left alone)::

    pool = max_pool2d_with_indices(relu, [2, 2], [2, 2])
    out = getitem(pool, 0)

After::

    best = relu[:, :, 0::2, 0::2]
    for tap in (relu[:, :, 0::2, 1::2], relu[:, :, 1::2, 0::2], relu[:, :, 1::2, 1::2]):
        best = where(isnan(tap), tap, where(tap > best, tap, best))
    out = best

Padding (and ``ceil_mode``'s partial windows) read ``-inf`` from a ``constant_pad_nd``, stored
in the input's layout before the taps read it (``_taps``). A tap replaces the best when greater
or NaN, as in ATen's kernel: NaN propagates and a tie keeps the earlier tap (+0.0 before -0.0).

A training forward graph saves the indices for ``max_pool2d_with_indices_backward`` (an ATen
call, fast in either layout). ``pointwise_max_pooling_with_indices`` computes both outputs in
one generated kernel, tap by tap as ATen's CPU kernel does (MaxPoolKernel.cpp)::

    best, idx = tap_0, where(tap_0 != -inf, i_0, first_valid)
    take = (tap_t > best) | isnan(tap_t)       # the last NaN wins; a tie keeps the first
    best, idx = where(take, tap_t, best), where(take, i_t, idx)

where ``i_t`` is the tap's flat offset in the (H, W) plane, an int64 ``arange`` expression over
(OH, OW) broadcast across N and C. A padding tap reads ``-inf``, which is never taken, so the
index starts at the window's first tap inside the input, as ATen's does. Only over a
contiguous input: the taps read it from its stored buffer (``as_strided``), and ATen's NHWC
kernel is fast.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .fx_edits import emit_node, is_channels_last, node_value

aten = torch.ops.aten

# Devices whose max pooling (indices unread) is rewritten. On the CPU the taps' kernel fuses
# with the ReLU (or BatchNorm + ReLU, or residual add) before it and runs vectorized since the
# C++ kernels walk channels as rows (codegen/cpp.py) and each tap is two selects (see
# ``_later_tap_wins``: as ``maximum``, GCC 12 left the loop scalar). ReLU + 2 x 2 pooling of
# 32 x 32 x 32 x 32 float32, inference, one thread: NHWC 0.96 ms against eager's 4.2 (ATen's
# ReLU, then its NHWC pooling), NCHW 0.84 ms against 12.0; the conv net's inference step
# 1.85x -> 2.04x eager (A/B in one process).
POINTWISE_POOL_DEVICES: tuple[str, ...] = ("cpu",)
# Devices whose max pooling with read indices (a training forward graph) over a contiguous
# (NCHW) input is computed by a generated kernel. On the CPU ATen's NCHW kernel walks one plane
# at a time: 7.1 ms a call for the conv net's first pooling (32 x 32 x 32 x 32 float32, one
# thread), 0.6 ms generated; the whole training step 97.2 -> 84.3 ms (eager 98.6 ms).
POOL_INDICES_DEVICES: tuple[str, ...] = ("cpu",)
# ... in these dtypes: 16-bit inputs are compared in float32 by ATen's kernel, not tested here.
POOL_INDICES_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
# Larger windows stay ATen calls: each tap is one more load per output.
MAX_WINDOW = 25


def _pair(value: Any, default: Optional[list] = None) -> list[int]:
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return list(default) if default is not None else []
    if isinstance(value, int):
        return [value, value]
    return [value[0], value[0]] if len(value) == 1 else [value[0], value[1]]


def _pool_arguments(node: fx.Node) -> Optional[tuple[list[int], list[int], list[int], list[int], bool]]:
    """(kernel, stride, padding, dilation, ceil_mode) of a 2-d max pooling this pass rewrites."""
    args = list(node.args) + [None] * (6 - len(node.args))
    names = ("self", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
    values = {name: node.kwargs.get(name, arg) for name, arg in zip(names, args)}
    kernel = _pair(values["kernel_size"])
    stride = _pair(values["stride"], kernel)
    padding = _pair(values["padding"], [0, 0])
    dilation = _pair(values["dilation"], [1, 1])
    ceil_mode = bool(values["ceil_mode"])
    sizes = (*kernel, *stride, *padding, *dilation)
    if len(kernel) != 2 or not all(isinstance(s, int) for s in sizes) or math.prod(kernel) > MAX_WINDOW:
        return None
    return kernel, stride, padding, dilation, ceil_mode


def _indices_unread(node: fx.Node) -> Optional[fx.Node]:
    """The ``getitem(node, 0)`` of a pooling whose only users read its values; else None."""
    values = None
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] != 0:
            return None
        values = user
    return values


def _poolable(node: fx.Node, out: Any, devices: tuple[str, ...]) -> Optional[tuple]:
    """(source, its value, the pooling's arguments) of a static 2-d float pooling on one of
    ``devices``; None when it stays an ATen call."""
    arguments = _pool_arguments(node)
    source = node.args[0]
    source_val = node_value(source)
    if arguments is None or not isinstance(source, fx.Node) or not isinstance(source_val, torch.Tensor):
        return None
    if (source_val.dim() not in (3, 4) or not source_val.is_floating_point()
            or source_val.device.type not in devices
            or not all(isinstance(s, int) for s in (*source_val.shape, *out.shape))):
        return None
    return source, source_val, arguments


def _taps(graph: fx.Graph, node: fx.Node, source: fx.Node, out: Any, arguments: tuple,
          stored: bool = False) -> list[fx.Node]:
    """The window's taps in ATen's order (rows, then columns): strided slices of the input,
    padded with -inf, each shaped like the pooling's output. ``stored``: the taps read the
    (contiguous) input from a buffer, see ``_stored_taps``."""
    kernel, stride, padding, dilation, _ = arguments
    source_val = node_value(source)
    height, width = source_val.shape[-2:]
    out_height, out_width = out.shape[-2:]
    # Taps read up to (out - 1) * stride + (kernel - 1) * dilation in padded coordinates; a
    # ceil_mode window that runs past the input reads -inf there.
    reach = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip((out_height, out_width), stride, kernel, dilation)]
    after = [max(0, r - p - size) for r, p, size in zip(reach, padding, (height, width))]
    padded = source
    if any(padding) or any(after):
        # A padded input is stored (padding and all) before the taps read it: read through the
        # pad, each tap is a load under a mask (its row and column inside the input), which GCC
        # 12 leaves scalar and branchy, and the producer (BatchNorm, ReLU) is recomputed in each
        # tap. ResNet's 3 x 3 / 2 pooling (padding 1) over 8 x 64 x 32 x 32 NHWC after BatchNorm
        # + ReLU, one thread of a busy EPYC: 30.8 ms a call as masked taps, 1.1 ms stored (ATen's:
        # 7.4 ms on a Xeon); ResNet-18's inference step on the Xeon 0.92x -> 1.05x eager.
        padded = emit_node(graph, node, aten.constant_pad_nd.default,
                           (source, [padding[1], after[1], padding[0], after[0]], -math.inf))
        if is_channels_last(source_val):  # (a pad's value is NCHW: stored so, it would transpose)
            padded = emit_node(graph, node, aten.clone.default, (padded,), {"memory_format": torch.channels_last})
        stored = True
    if stored:
        return _stored_taps(graph, node, padded, out, arguments)
    dims = (source_val.dim() - 2, source_val.dim() - 1)
    taps = []
    for tap_h in range(kernel[0]):
        for tap_w in range(kernel[1]):
            tap = padded
            for dim, tap_index, o, s, d in ((dims[0], tap_h, out_height, stride[0], dilation[0]),
                                            (dims[1], tap_w, out_width, stride[1], dilation[1])):
                start = tap_index * d
                tap = emit_node(graph, node, aten.slice.Tensor, (tap, dim, start, start + (o - 1) * s + 1, s))
            taps.append(tap)
    return taps


def _stored_taps(graph: fx.Graph, node: fx.Node, padded: fx.Node, out: Any, arguments: tuple) -> list[fx.Node]:
    """The taps as ``as_strided`` views of ``padded``, which the lowering computes into a buffer
    of its own in ``padded``'s strides (lowering/views.py) before the pooling reads it.

    A training forward stores the pooling's input anyway (the backward reads it), and reading
    that buffer is what makes the kernel fast: with the producer's ReLU recomputed in each tap,
    GCC 12 under -fno-trapping-math (codegen/cpp.py) leaves the loop scalar and branchy, ReLU's
    select and the NaN test of each tap mispredicting on random data (conv net's first pooling,
    32 x 32 x 16 x 16 outputs, one thread: 10 ms, against 0.6 ms reading the stored input and
    7.1 ms for ATen's NCHW kernel)."""
    kernel, stride, _, dilation, _ = arguments
    value = node_value(padded)
    *outer, row, column = value.stride()
    strides = [*outer, stride[0] * row, stride[1] * column]
    taps = []
    for tap_h in range(kernel[0]):
        for tap_w in range(kernel[1]):
            offset = value.storage_offset() + tap_h * dilation[0] * row + tap_w * dilation[1] * column
            taps.append(emit_node(graph, node, aten.as_strided.default, (padded, list(out.shape), strides, offset)))
    return taps


def _later_tap_wins(graph: fx.Graph, node: fx.Node, tap: fx.Node, best: fx.Node) -> fx.Node:
    """ATen's rule for a window's next tap: it replaces the best when greater or NaN, so a tie
    keeps the earlier tap (``maximum`` would take -0.0 over an earlier +0.0)."""
    # (two selects: as one select of ``greater | isnan``, or as ``maximum``'s ``a > b || a != a``,
    # GCC 12 leaves the loop scalar: ReLU + 2 x 2 pooling over NHWC 8.7 ms, against 0.7 ms so)
    greater = emit_node(graph, node, aten.where.self, (emit_node(graph, node, aten.gt.Tensor, (tap, best)), tap, best))
    return emit_node(graph, node, aten.where.self, (emit_node(graph, node, aten.isnan.default, (tap,)), tap, greater))


def _rewrite(graph: fx.Graph, node: fx.Node, values: fx.Node) -> bool:
    out = node_value(values)
    poolable = _poolable(node, out, POINTWISE_POOL_DEVICES)
    if poolable is None:
        return False
    source, _, arguments = poolable
    taps = _taps(graph, node, source, out, arguments)
    result = taps[0]
    for tap in taps[1:]:
        result = _later_tap_wins(graph, node, tap, result)
    if len(taps) == 1:  # a lone tap is a view; the pooling's output is a tensor of its own
        result = emit_node(graph, node, aten.clone.default, (result,))
    values.replace_all_uses_with(result)
    graph.erase_node(values)
    graph.erase_node(node)
    return True


def pointwise_max_pooling(gm: fx.GraphModule) -> fx.GraphModule:
    """``max_pool2d_with_indices`` whose indices are unread -> maximum of strided slices (see
    the module's docstring)."""
    for node in _poolings(gm.graph):
        values = _indices_unread(node)
        if values is not None:
            _rewrite(gm.graph, node, values)
    return gm


def _poolings(graph: fx.Graph) -> list[fx.Node]:
    """The graph's 2-d max poolings (a list: the passes replace them as they go)."""
    return [node for node in graph.nodes
            if node.op == "call_function" and node.target is aten.max_pool2d_with_indices.default]


def _outputs_read(node: fx.Node) -> Optional[dict[int, list[fx.Node]]]:
    """The ``getitem`` users of a pooling by output (0: values, 1: indices), when the indices
    are read (else ``pointwise_max_pooling``'s case); None when something else reads it."""
    users: dict[int, list[fx.Node]] = {0: [], 1: []}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] not in (0, 1):
            return None
        users[user.args[1]].append(user)
    return users if users[1] else None


def _arange(graph: fx.Graph, before: fx.Node, start: int, step: int, length: int, like: torch.Tensor) -> fx.Node:
    """An int64 ``start + step * i`` for i < length on ``like``'s device (``emit_node`` finds
    no fake mode without a tensor operand: it comes from ``like``)."""
    args, kwargs = (start, start + step * length, step), {"dtype": torch.int64, "device": like.device}
    with graph.inserting_before(before):
        node = graph.call_function(aten.arange.start_step, args, kwargs)
    with detect_fake_mode([like]):
        node.meta["val"] = aten.arange.start_step(*args, **kwargs)
    node.meta["stack_trace"] = before.meta.get("stack_trace")
    return node


def _plane_offsets(graph: fx.Graph, node: fx.Node, rows: fx.Node, columns: fx.Node, width: int) -> fx.Node:
    """``rows[:, None] * width + columns``: flat offsets in the (H, W) plane over (OH, OW)."""
    rows = emit_node(graph, node, aten.unsqueeze.default, (rows, 1))
    rows = emit_node(graph, node, aten.mul.Tensor, (rows, width))
    return emit_node(graph, node, aten.add.Tensor, (rows, columns))


def _first_valid(graph: fx.Graph, node: fx.Node, starts: fx.Node, taps: int, dilation: int, padding: int) -> fx.Node:
    """Per window, its first tap at or after 0 (ATen moves a start in the padding up by the
    dilation until it is inside). PyTorch keeps the padding within half the window, so the
    window's last tap is always inside: a chain of ``where`` from the last tap back."""
    if padding == 0:
        return starts
    first = emit_node(graph, node, aten.add.Tensor, (starts, (taps - 1) * dilation))
    for tap in reversed(range(taps - 1)):
        candidate = emit_node(graph, node, aten.add.Tensor, (starts, tap * dilation)) if tap else starts
        inside = emit_node(graph, node, aten.ge.Scalar, (candidate, 0))
        first = emit_node(graph, node, aten.where.self, (inside, candidate, first))
    return first


def _rewrite_with_indices(graph: fx.Graph, node: fx.Node, users: dict[int, list[fx.Node]]) -> bool:
    values_val, indices_val = node.meta["val"]
    poolable = _poolable(node, values_val, POOL_INDICES_DEVICES)
    if poolable is None or values_val.dtype not in POOL_INDICES_DTYPES or math.prod(poolable[2][0]) == 1:
        return False  # (a 1 x 1 window copies its input: nothing to gain)
    source, source_val, arguments = poolable
    if not source_val.is_contiguous() or getattr(source.target, "is_view", False):
        # ATen's NHWC kernel is fast (1.9 ms for that pooling over channels-last; 11 ms as taps
        # of the ReLU before it, which the kernel recomputes: see ``_stored_taps``); and a view's
        # buffer may be laid out otherwise than its strides say, where ``as_strided`` reads
        return False
    kernel, stride, padding, dilation, _ = arguments
    width = source_val.shape[-1]
    out_height, out_width = values_val.shape[-2:]
    taps = _taps(graph, node, source, values_val, arguments, stored=True)
    # each window's origin in padded coordinates, less the padding: tap (h, w) is at
    # origin + (h * dilation - padding) * W + (w * dilation - padding)
    row_starts = _arange(graph, node, -padding[0], stride[0], out_height, source_val)
    column_starts = _arange(graph, node, -padding[1], stride[1], out_width, source_val)
    origins = _plane_offsets(graph, node, row_starts, column_starts, width)
    offsets = [h * dilation[0] * width + w * dilation[1] for h in range(kernel[0]) for w in range(kernel[1])]
    best = taps[0]
    index = origins if offsets[0] == 0 else emit_node(graph, node, aten.add.Tensor, (origins, offsets[0]))
    if any(padding):
        # a window's first tap may be padding (-inf, never taken): the index starts at its first
        # tap inside the input. (Without padding the first tap is inside: a ceil_mode window
        # starts inside the input, and only its last taps may run past it.)
        first_row = _first_valid(graph, node, row_starts, kernel[0], dilation[0], padding[0])
        first_column = _first_valid(graph, node, column_starts, kernel[1], dilation[1], padding[1])
        first = _plane_offsets(graph, node, first_row, first_column, width)
        inside = emit_node(graph, node, aten.ne.Scalar, (best, -math.inf))
        index = emit_node(graph, node, aten.where.self, (inside, index, first))
    for tap, offset in zip(taps[1:], offsets[1:]):
        greater = emit_node(graph, node, aten.gt.Tensor, (tap, best))
        take = emit_node(graph, node, aten.logical_or.default,
                         (greater, emit_node(graph, node, aten.isnan.default, (tap,))))
        best = emit_node(graph, node, aten.where.self, (take, tap, best))  # (_later_tap_wins, sharing take)
        tap_index = emit_node(graph, node, aten.add.Tensor, (origins, offset)) if offset else origins
        index = emit_node(graph, node, aten.where.self, (take, tap_index, index))
    # Read only by the graph's output, the indices would be computed at the graph's end, too far
    # from the values' kernel to join it (FUSION_WINDOW); and alone their loop stays scalar (GCC
    # 12 finds no vector type for the taps' stride-2 loads when no float is stored): 4.4 ms
    # against 0.6 ms for both outputs in one kernel (the conv net's first pooling, one thread).
    # An identity ``as_strided`` makes the lowering store a value where it stands, contiguous (a
    # buffer's default, and eager's strides for a contiguous input): the values first, then the
    # indices, which join their kernel. (In the other order the loop stays scalar too: GCC
    # vectorizes it only when the float store comes first.)
    for position, result, eager in ((0, best, values_val), (1, index, indices_val)):
        if not users[position]:
            continue
        if not node_value(result).is_contiguous():
            result = emit_node(graph, node, aten.clone.default, (result,), {"memory_format": torch.contiguous_format})
        stored = emit_node(graph, node, aten.as_strided.default, (result, list(eager.shape), list(eager.stride()), 0))
        for user in users[position]:
            user.replace_all_uses_with(stored)
            graph.erase_node(user)
    graph.erase_node(node)
    return True


def pointwise_max_pooling_with_indices(gm: fx.GraphModule) -> fx.GraphModule:
    """``max_pool2d_with_indices`` whose indices are read (a training forward graph saves them
    for the backward) -> a chain of ``where`` over its taps computing eager's values and int64
    indices (see the module's docstring)."""
    for node in _poolings(gm.graph):
        users = _outputs_read(node)
        if users is not None:
            _rewrite_with_indices(gm.graph, node, users)
    return gm
