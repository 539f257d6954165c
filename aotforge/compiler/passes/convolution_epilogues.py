"""What follows a convolution in an inference graph, moved into the convolution's call.

``fold_channel_affine``: per-output-channel scales and shifts applied to a convolution's
result (an inference BatchNorm, as its decomposition spells it, or a bias added by hand) are
folded into the convolution's weight and bias. The scale and shift are computed per channel
(C values) and the weight multiplied by the scale on every call, from the graph's inputs as
they are then (nothing is frozen: a parameter changed between calls is read again), so the
activation is read and written once less and its kernel does not recompute
``rsqrt(var + eps)`` per element::

    y = convolution(x, w, None, ...)
    z = (y - mean[:, None, None]) * rsqrt(var + eps)[:, None, None] * gamma[:, None, None] + beta[:, None, None]

becomes, with ``s = rsqrt(var + eps) * gamma`` and ``t = beta - mean * s`` (C values each)::

    z = convolution(x, w * s[:, None, None, None], t, ...)

Not done: ReLU inside oneDNN's call (``mkldnn._convolution_pointwise(..., "relu")``, what
inductor's CPU path emits). oneDNN's ReLU post-op writes 0 for NaN where eager's ReLU keeps
NaN, so a NaN in the input would come out as zeros: a silent wrong answer. The ReLU stays a
generated kernel over the convolution's NHWC output.

Only in inference graphs: a training graph's BatchNorm normalizes by batch statistics
(not per-channel constants), and its backward needs the convolution's own output.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from .fx_edits import emit_node, node_value, numel_hint, same_sizes

aten = torch.ops.aten

# Devices whose inference convolutions take their per-channel epilogue: the CPU, where the two
# small kernels per convolution that compute the folded weight and bias cost microseconds; on
# a GPU they would be two more launches per convolution, not measured yet.
FOLD_DEVICES: tuple[str, ...] = ("cpu",)
# A 16-bit weight times its scale would be rounded to 8 (bfloat16) or 11 bits once more, where
# eager normalizes the convolution's output in float32: only 32- and 64-bit graphs fold.
FOLD_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
# A fold multiplies the whole weight on every call (nothing is frozen), so it pays only where the
# weight is no larger than the activation it spares a pass over: ResNet-18's 512-channel weights
# (2.4M values against 16K outputs at 8 x 64x64) cost 10 ms a step to fold, reading and writing
# 88 MB, where BatchNorm over the outputs fuses into the ReLU's kernel for free.
FOLD_MAX_WEIGHT_PER_OUTPUT = 1.0
# The per-channel operations folded, and how each updates (scale, shift): y * s + t.
_AFFINE = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)


def _is_plain_convolution(node: fx.Node) -> bool:
    """A 2-d, non-transposed ``aten.convolution`` whose operands are tensors of one dtype."""
    if node.op != "call_function" or node.target is not aten.convolution.default:
        return False
    out = node_value(node)
    if (not isinstance(out, torch.Tensor) or out.dim() != 4 or not out.is_floating_point() or node.args[6]
            or out.device.type not in FOLD_DEVICES or out.dtype not in FOLD_DTYPES
            or not isinstance(out.shape[1], int) or numel_hint(out) is None):  # (symbolic channels: as traced)
        return False
    operands = [node_value(a) for a in node.args[:3] if a is not None]
    return all(isinstance(v, torch.Tensor) and v.dtype == out.dtype for v in operands)


def _channel_vector(node: fx.Node, operand: Any, out: torch.Tensor) -> Optional[fx.Node]:
    """``operand`` as a [C] node when it is a per-output-channel tensor ([C, 1, 1] or
    [1, C, 1, 1], C the convolution's output channels or 1) of the result's dtype; else None."""
    value = node_value(operand)
    if not isinstance(operand, fx.Node) or not isinstance(value, torch.Tensor) or value.dtype != out.dtype:
        return None
    if value.device != out.device or value.dim() > 4 or value.dim() < 3:
        return None
    shape = [1] * (4 - value.dim()) + list(value.shape)
    channels = out.shape[1]
    if not all(isinstance(size, int) for size in shape) or shape[0] != 1 or shape[2] != 1 or shape[3] != 1 or shape[1] not in (1, channels):
        return None
    flat = emit_node(node.graph, node, aten.reshape.default, (operand, [shape[1]]))
    if shape[1] == 1:
        flat = emit_node(node.graph, node, aten.expand.default, (flat, [channels]))
    return flat


def _affine_step(node: fx.Node, current: fx.Node) -> Optional[tuple[Any, fx.Node]]:
    """(op, [C] operand) when ``node`` applies a per-channel op to ``current`` in a form that
    folds: ``current op v`` for add/sub/mul/div, ``v op current`` for add and mul."""
    if node.op != "call_function" or node.target not in _AFFINE or node.kwargs.get("alpha", 1) != 1:
        return None
    if len(node.args) > 2 or len(node.args) < 2:
        return None
    left, right = node.args
    out = node_value(current)
    if node_value(node) is None or not same_sizes(node_value(node).shape, out.shape) or node_value(node).dtype != out.dtype:
        return None
    if left is current and right is not current:
        other = right
    elif right is current and left is not current and node.target in (aten.add.Tensor, aten.mul.Tensor):
        other = left
    else:
        return None
    vector = _channel_vector(node, other, out)
    return None if vector is None else (node.target, vector)


def _fold(convolution: fx.Node) -> bool:
    graph = convolution.graph
    out = node_value(convolution)
    if numel_hint(node_value(convolution.args[1])) > FOLD_MAX_WEIGHT_PER_OUTPUT * numel_hint(out):
        return False
    steps: list[tuple[Any, fx.Node]] = []
    last = convolution
    while len(last.users) == 1:
        user = next(iter(last.users))
        step = _affine_step(user, last)
        if step is None:
            break
        steps.append(step)
        last = user
    if not steps:
        return False
    scale: Optional[fx.Node] = None  # y * scale + shift, [C] each; None: 1 and 0
    shift: Optional[fx.Node] = None
    where = last
    for target, vector in steps:
        if target is aten.mul.Tensor:
            scale = vector if scale is None else emit_node(graph, where, aten.mul.Tensor, (scale, vector))
        elif target is aten.div.Tensor:
            scale = (emit_node(graph, where, aten.reciprocal.default, (vector,)) if scale is None
                     else emit_node(graph, where, aten.div.Tensor, (scale, vector)))
        if target in (aten.mul.Tensor, aten.div.Tensor):
            if shift is not None:
                shift = emit_node(graph, where, target, (shift, vector))
        elif shift is None:
            shift = vector if target is aten.add.Tensor else emit_node(graph, where, aten.neg.default, (vector,))
        else:
            shift = emit_node(graph, where, target, (shift, vector))
    x, weight, bias, *rest = convolution.args
    if scale is not None:
        column = emit_node(graph, where, aten.reshape.default, (scale, [out.shape[1], 1, 1, 1]))
        weight = emit_node(graph, where, aten.mul.Tensor, (weight, column))
        if bias is not None:
            bias = emit_node(graph, where, aten.mul.Tensor, (bias, scale))
    if shift is not None:
        bias = shift if bias is None else emit_node(graph, where, aten.add.Tensor, (bias, shift))
    folded = emit_node(graph, where, aten.convolution.default, (x, weight, bias, *rest))
    last.replace_all_uses_with(folded)
    for node in reversed([convolution] + _chain(convolution, last)):
        graph.erase_node(node)
    return True


def _chain(convolution: fx.Node, last: fx.Node) -> list[fx.Node]:
    """The nodes from the convolution's reader to ``last``, in order."""
    chain, node = [], convolution
    while node is not last:
        node = next(iter(node.users))
        chain.append(node)
    return chain


def fold_channel_affine(gm: fx.GraphModule) -> fx.GraphModule:
    """Per-channel scales and shifts after a convolution -> its weight and bias (see the
    module's docstring)."""
    for node in list(gm.graph.nodes):
        if _is_plain_convolution(node):
            _fold(node)
    gm.graph.eliminate_dead_code()
    return gm
