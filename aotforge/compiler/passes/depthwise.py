"""The weight gradient of a CPU depthwise convolution, as a grouped convolution of the input
with the output's gradient (a joint-graph pass, before partitioning).

oneDNN's weight gradient of a depthwise convolution is its slowest convolution kernel on the
CPU at the sizes of small images: MobileNetV3-small's 5x5 depthwise convolutions (8 images of
64x64, one thread of an EPYC) took 1.3-4.5 ms each there, 22 ms of an 85 ms training step,
against 0.15-0.5 ms for the same convolution's forward or input gradient. The same sum is a
forward depthwise convolution, which oneDNN runs fast:

    gw[c, kh, kw] = sum over n, i, j of  g[n, c, i, j] * x[n, c, i*s + kh*d - p, j*s + kw*d - p]

is, for each image n and channel c, the correlation of x[n, c] (padded by p) with g[n, c] as
the kernel, dilated by the stride s and strided by the dilation d: one convolution over the
N*C planes as groups, its first KH x KW outputs kept, summed over the images. Measured per
call (same EPYC thread): 0.28-0.52 ms for those convolutions, except where the padding is as
large as the gradient (576 channels over 2x2, padding 2: 3.0 ms, oneDNN's slow path for such
a kernel); padded first and convolved without padding, that one takes 0.97 ms. The grouped
form lost for 3x3 kernels over larger images (0.30-0.40 ms against ATen's 0.24-0.28 ms).

Which form runs is timed at compile time when ``config.cpu_convolution_timing`` is on (the
CPU decides; ``convolution_timing.fastest``), else it is the rule (``_rule``). Every form
computes the same sums in another order: values match eager up to rounding, as a change of
convolution layout does.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ... import config, debug
from . import convolution_timing
from .fx_edits import emit_node, node_value

aten = torch.ops.aten

# The dtypes whose depthwise weight gradients take this path (oneDNN's). Tests add float64.
DTYPES: tuple[torch.dtype, ...] = (torch.float32,)
ATEN, GROUPED, PADDED = "aten", "grouped", "padded"
# (sizes, dtype, parameters, threads) -> the form timed fastest, for this process
_timed: dict[tuple, str] = {}


def depthwise_weight_gradients(gm: fx.GraphModule) -> fx.GraphModule:
    """Each CPU depthwise ``convolution_backward`` whose weight gradient is used gets it from a
    grouped convolution (see the module's docstring), where that form is the faster one; the
    input and bias gradients stay with ATen's call."""
    budget = convolution_timing.Budget()
    for node in list(gm.graph.nodes):
        users = _weight_gradient_users(node)
        if users is None:
            continue
        form = _choose(node, budget)
        debug.note("compile", f"{node.name}: depthwise weight gradient: {form}")
        if form == ATEN:
            continue
        grad, x, weight = node.args[:3]

        def emit(target: Any, *args: Any) -> fx.Node:
            return emit_node(gm.graph, node, target, args)

        gradient = weight_gradient(emit, grad, x, node_value(weight).shape, *node.args[4:7], padded=form == PADDED)
        users[1].replace_all_uses_with(gradient)
        gm.graph.erase_node(users[1])
        mask = [node.args[10][0], False, node.args[10][2]]
        if any(mask) or node.users:  # (a traced graph may read the None outputs)
            rest = emit_node(gm.graph, node, aten.convolution_backward.default, (*node.args[:10], mask))
            node.replace_all_uses_with(rest)
        gm.graph.erase_node(node)
    return gm


def weight_gradient(call: Callable[..., Any], grad: Any, x: Any, weight_shape: Any, stride: Any, padding: Any,
                    dilation: Any, padded: bool) -> Any:
    """The depthwise weight gradient as a grouped convolution; ``call(op, *args)`` runs each ATen
    op (on tensors, to time it) or emits it (into a graph). ``padded``: pad the input first and
    convolve without padding (oneDNN is slow where the padding is as large as the kernel)."""
    n, c, h, w = node_value(x).shape
    ho, wo = node_value(grad).shape[2:]
    kh, kw = weight_shape[2:]
    if padded:
        x = call(aten.constant_pad_nd.default, x, [padding[1], padding[1], padding[0], padding[0]], 0.0)
        h, w, padding = h + 2 * padding[0], w + 2 * padding[1], [0, 0]
    planes = call(aten.reshape.default, x, [1, n * c, h, w])
    kernels = call(aten.reshape.default, grad, [n * c, 1, ho, wo])
    # the stride of the forward dilates the kernel (the gradient); its dilation strides the output
    out = call(aten.convolution.default, planes, kernels, None, list(dilation), list(padding), list(stride),
               False, [0, 0], n * c)
    out = call(aten.slice.Tensor, call(aten.slice.Tensor, out, 2, 0, kh), 3, 0, kw)
    per_image = call(aten.reshape.default, out, [n, c, kh, kw])
    return call(aten.reshape.default, call(aten.sum.dim_IntList, per_image, [0]), [c, 1, kh, kw])


def _weight_gradient_users(node: fx.Node) -> Optional[dict[int, fx.Node]]:
    """A CPU depthwise ``convolution_backward`` (2-d, one filter per channel, static sizes and
    parameters) whose weight gradient is used: its ``getitem`` users by index; else None."""
    if node.op != "call_function" or node.target is not aten.convolution_backward.default or len(node.args) != 11:
        return None
    grad, x, weight = (node_value(a) for a in node.args[:3])
    stride, padding, dilation, transposed, _, groups, mask = node.args[4:]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in (grad, x, weight)):
        return None
    sizes = (*grad.shape, *x.shape, *weight.shape, *stride, *padding, *dilation, groups)
    if not all(type(v) is int for v in sizes) or transposed or not mask[1]:
        return None
    if x.device.type != "cpu" or x.dtype not in DTYPES or groups < 2:
        return None
    if weight.shape[0] != groups or weight.shape[1] != 1 or x.shape[1] != groups:
        return None
    users = {u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}
    return users if 1 in users and len(users) == len(node.users) else None


def _rule(node: fx.Node) -> str:
    """The form without timing (measured on an EPYC, see the module's docstring): ATen's for
    kernels under 5x5, the grouped convolution from 5x5, padded first where the padding is as
    large as the gradient's image."""
    grad, weight = node_value(node.args[0]), node_value(node.args[2])
    if weight.shape[2] * weight.shape[3] < 25:
        return ATEN
    padding = node.args[5]
    return PADDED if padding[0] >= grad.shape[2] or padding[1] >= grad.shape[3] else GROUPED


def _choose(node: fx.Node, budget: convolution_timing.Budget) -> str:
    rule = _rule(node)
    if not config.cpu_convolution_timing:
        return rule
    grad, x, weight = (node_value(a) for a in node.args[:3])
    key = (tuple(grad.shape), tuple(x.shape), tuple(weight.shape), x.dtype,
           tuple(tuple(a) for a in node.args[4:7]), torch.get_num_threads())
    if key in _timed:
        return _timed[key]
    if budget.spent():
        return rule
    try:
        with unset_fake_temporarily(), torch.no_grad():
            seconds = _measure(key, budget)
    except Exception as error:  # noqa: BLE001  (out of memory, a shape oneDNN refuses: the rule)
        debug.note("compile", f"{node.name}: timing the depthwise weight gradient failed ({error}): {rule}")
        return rule
    fastest = min(seconds, key=seconds.get)
    # the rule's form stays unless another is clearly faster
    chosen = fastest if seconds[fastest] < seconds[rule] * (1 - convolution_timing.MARGIN) else rule
    _timed[key] = chosen
    return chosen


def _measure(key: tuple, budget: convolution_timing.Budget) -> dict[str, float]:
    grad_sizes, x_sizes, weight_sizes, dtype, (stride, padding, dilation), _ = key
    grad, x, weight = convolution_timing.random_operands(dtype, grad_sizes, x_sizes, weight_sizes)
    parameters = (list(stride), list(padding), list(dilation), False, [0, 0], weight_sizes[0])

    def run(target: Any, *args: Any) -> Any:
        return target(*args)

    variants = {
        ATEN: lambda: aten.convolution_backward.default(grad, x, weight, None, *parameters, [False, True, False]),
        GROUPED: lambda: weight_gradient(run, grad, x, weight_sizes, stride, padding, dilation, padded=False),
        PADDED: lambda: weight_gradient(run, grad, x, weight_sizes, stride, padding, dilation, padded=True),
    }
    return dict(zip(variants, convolution_timing.fastest(tuple(variants.values()), budget)))
