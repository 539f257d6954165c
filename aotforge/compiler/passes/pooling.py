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

    out = maximum(maximum(maximum(relu[:, :, 0::2, 0::2], relu[:, :, 0::2, 1::2]),
                          relu[:, :, 1::2, 0::2]), relu[:, :, 1::2, 1::2])

Padding (and ``ceil_mode``'s partial windows) read ``-inf`` from a ``constant_pad_nd``, which
is pointwise too. ``maximum`` propagates NaN as the ATen kernel does.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from .fx_edits import emit_node, node_value

aten = torch.ops.aten

# Devices whose max pooling is rewritten: none yet (tests add "cpu"). Over NHWC the fused kernel
# indexes its taps by ``xindex / (W_out * C)`` inside the channel loop, which GCC does not
# vectorize: 23.4 ms for the conv net's first BatchNorm + ReLU + pooling (32 x 32 x 16 x 16
# outputs, one thread), 1.18 ms with that index written ``x0 / W_out`` by hand, against 1.6 ms
# for ATen's NHWC pooling. With BatchNorm folded and ReLU inside oneDNN's convolution there is
# nothing left for the pooling to fuse with in that net; it pays where a pointwise producer
# stays (a residual add), once the C++ code generator splits such indices.
POINTWISE_POOL_DEVICES: tuple[str, ...] = ()
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


def _rewrite(graph: fx.Graph, node: fx.Node, values: fx.Node) -> bool:
    arguments = _pool_arguments(node)
    source, out = node.args[0], node_value(values)
    source_val = node_value(source)
    if arguments is None or not isinstance(source, fx.Node) or not isinstance(source_val, torch.Tensor):
        return False
    if (source_val.dim() not in (3, 4) or not source_val.is_floating_point()
            or source_val.device.type not in POINTWISE_POOL_DEVICES
            or not all(isinstance(s, int) for s in (*source_val.shape, *out.shape))):
        return False
    kernel, stride, padding, dilation, _ = arguments
    height, width = source_val.shape[-2:]
    out_height, out_width = out.shape[-2:]
    # Taps read up to (out - 1) * stride + (kernel - 1) * dilation in padded coordinates; a
    # ceil_mode window that runs past the input reads -inf there.
    reach = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip((out_height, out_width), stride, kernel, dilation)]
    after = [max(0, r - p - size) for r, p, size in zip(reach, padding, (height, width))]
    padded = source
    if any(padding) or any(after):
        padded = emit_node(graph, node, aten.constant_pad_nd.default,
                       (source, [padding[1], after[1], padding[0], after[0]], -math.inf))
    dims = (source_val.dim() - 2, source_val.dim() - 1)
    result = None
    for tap_h in range(kernel[0]):
        for tap_w in range(kernel[1]):
            tap = padded
            for dim, tap_index, o, s, d in ((dims[0], tap_h, out_height, stride[0], dilation[0]),
                                            (dims[1], tap_w, out_width, stride[1], dilation[1])):
                start = tap_index * d
                tap = emit_node(graph, node, aten.slice.Tensor, (tap, dim, start, start + (o - 1) * s + 1, s))
            result = tap if result is None else emit_node(graph, node, aten.maximum.default, (result, tap))
    if kernel == [1, 1]:  # a lone tap is a view; the pooling's output is a tensor of its own
        result = emit_node(graph, node, aten.clone.default, (result,))
    values.replace_all_uses_with(result)
    graph.erase_node(values)
    graph.erase_node(node)
    return True


def pointwise_max_pooling(gm: fx.GraphModule) -> fx.GraphModule:
    """``max_pool2d_with_indices`` whose indices are unread -> maximum of strided slices (see
    the module's docstring)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.max_pool2d_with_indices.default:
            continue
        values = _indices_unread(node)
        if values is not None:
            _rewrite(graph, node, values)
    return gm
