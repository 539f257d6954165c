"""A CPU 1x1 convolution over an NHWC input as one matrix multiply (inference graphs, after the
channels-last pass).

A 1x1 convolution with stride 1 and no padding multiplies each pixel's channel vector by the
weight: over an NHWC buffer that is ``[N*H*W, C] @ [C, Cout]`` on the same memory, the output
NHWC as well. ATen does not call one matrix multiply for it: on one thread and fewer than 16
images its convolution goes to the slow path, a matrix multiply per image of H*W columns (a
few columns each in MobileNetV3's later blocks), or else to oneDNN, whose call costs about
0.25 ms whatever the size. Measured per call on one EPYC thread (MobileNetV3-small's 1x1
convolutions, 8 images of 64x64): 4.54 ms for the 22 of them as NHWC ATen convolutions, 3.03 ms
as ``addmm`` (7.36 ms NCHW; oneDNN called directly 7.79 ms). 576 -> 96 channels over 2x2:
0.245 ms against 0.133 ms.

Same sums over the channels in another order: the values match eager up to rounding, as a
change of convolution layout does.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .fx_edits import emit_node, is_channels_last, node_value

aten = torch.ops.aten

# The dtypes whose 1x1 convolutions become matrix multiplies (MKL's sgemm); tests add float64.
DTYPES: tuple[torch.dtype, ...] = (torch.float32,)


def convolutions_as_matmuls(gm: fx.GraphModule) -> fx.GraphModule:
    """Each CPU 1x1 convolution (stride 1, no padding, one group) over an NHWC input becomes
    ``addmm``/``mm`` over the NHWC buffer viewed as rows of channels (see the module's
    docstring); its output keeps the convolution's NHWC strides."""
    for node in list(gm.graph.nodes):
        if not _pointwise_convolution(node):
            continue
        x, weight, bias = node.args[:3]
        n, c, h, w = node_value(x).shape
        out_channels = node_value(weight).shape[0]

        def emit(target, *args):
            return emit_node(gm.graph, node, target, args)

        rows = emit(aten.reshape.default, emit(aten.permute.default, x, [0, 2, 3, 1]), [n * h * w, c])
        matrix = emit(aten.permute.default, emit(aten.reshape.default, weight, [out_channels, c]), [1, 0])
        product = emit(aten.mm.default, rows, matrix) if bias is None else emit(aten.addmm.default, bias, rows, matrix)
        out = emit(aten.permute.default, emit(aten.reshape.default, product, [n, h, w, out_channels]), [0, 3, 1, 2])
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    return gm


def _pointwise_convolution(node: fx.Node) -> bool:
    """A CPU 2-d convolution with a 1x1 kernel, stride 1, no padding, one group, over an NHWC
    input of static sizes."""
    if node.op != "call_function" or node.target is not aten.convolution.default or len(node.args) != 9:
        return False
    x, weight = node_value(node.args[0]), node_value(node.args[1])
    stride, padding, dilation, transposed, output_padding, groups = node.args[3:]
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.device.type != "cpu" or x.dtype not in DTYPES:
        return False
    if not all(type(v) is int for v in (*x.shape, *weight.shape)):
        return False
    return (tuple(weight.shape[2:]) == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0]
            and list(dilation) == [1, 1] and not transposed and groups == 1 and is_channels_last(x))
