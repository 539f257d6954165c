"""Passes that shape what the compiler hands to the libraries (cuBLAS, ATen's scatter kernels),
run on graphs that get generated kernels, after ``post_grad_passes``.

``pad_matmuls``: cuBLAS runs its fast kernels only when every matrix's leading dimension is a
multiple of 16 bytes. A vocabulary of 50257 makes the logits matmul, and both of its backward
matmuls, fall back to ``align1`` kernels (measured on an H200: 7.9 ms for GPT-2's three against
about 1.3 ms padded). So an unaligned M, K or N of a large 16-bit or float32 matmul is padded
with zeros (zeros in K add nothing to the products) and the result sliced back::

    mm(a[8192, 768], b[768, 50257])
      -> slice(mm(constant_pad_nd(a), constant_pad_nd(b, [0, 7])), 1, 0, 50257)

The pads are pointwise in the loop IR, so a pad of a computed operand fuses into its producer.

``scatter_accumulate``: ``index_put_(accumulate=True)`` (what embedding's backward decomposes
into) runs ATen's sort-based kernel on CUDA (5.4 ms per BERT step); ``scatter_add`` over the
same rows accumulates with atomic adds. Under ``torch.use_deterministic_algorithms(True)`` the
deterministic sort-based call is kept (Dynamo guards on that setting, so a change recompiles).

Before::

    index_put(zeros[V, D], [idx[B, T]], grad[B, T, D], True)

After::

    scatter_add(zeros, 0, expand(reshape(idx, [B*T, 1]), [B*T, D]), reshape(grad, [B*T, D]))
"""
from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ...config import config
from . import convolution_timing
from .convolution_epilogues import fold_channel_affine
from .fx_edits import dense_in, emit_node, is_channels_last, node_value, numel_hint, run_passes, same_sizes
from .matmul_convolutions import convolutions_as_matmuls
from .pooling import pointwise_max_pooling, pointwise_max_pooling_with_indices

log = logging.getLogger("aotforge")

aten = torch.ops.aten

# Devices whose matmuls are padded: cuBLAS's alignment rule. Tests add "cpu" to see the rewrite
# through the Triton interpreter.
PAD_DEVICES: tuple[str, ...] = ("cuda",)
# Devices whose inference graphs run convolutions in channels-last (cuDNN, oneDNN).
# Needs kernels that walk channels-last buffers in memory order (lowering's permuted
# realization): without it, measured on an H100 (timm ResNet-50 inference, bf16), generated
# kernels went from about 3 ms to 30.7 ms per step.
CHANNELS_LAST_DEVICES: tuple[str, ...] = ("cuda", "cpu")
# Devices whose training graphs always run convolutions in channels-last (the joint graph's
# pass); tests add "cpu". Otherwise a CPU training graph goes NHWC where its convolutions timed
# faster so (``channels_last_joint``). Measured on the conv net's training step (one thread of
# the EPYC, A/B in one process): NHWC ran 1.04x NCHW, MobileNetV3-small 1.20x, ResNet-18 0.97x,
# once its BatchNorm operands were written in the graph's layout (lowering/graph.py
# KEEPS_EAGER_LAYOUT: before, the gradients were written NCHW by transposing kernels, 16 ms of
# C++ kernels a conv net step against 2.5 ms).
CHANNELS_LAST_TRAINING_DEVICES: tuple[str, ...] = ()
# On the CPU only the dtypes oneDNN convolves: a float64 convolution runs ATen's own loops,
# whose NHWC form is no faster. Tests add float64.
CPU_CHANNELS_LAST_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
# A convolution over fewer input channels keeps its input's layout: converting a 3-channel
# image to NHWC cost 0.8 ms of ResNet-50's 8 ms inference step (H100), cuDNN's own less.
# On the CPU its weight alone is converted: oneDNN then runs the convolution in NHWC (an
# NHWC weight picks that path) and converts the small image itself, 3.2x faster than NCHW
# (3 -> 32 channels, 32 images of 32x32, one thread of an EPYC: 7.3 ms against 2.3 ms).
MIN_CHANNELS_LAST_CHANNELS = 8
# A CPU convolution whose weight outweighs its input this many times over runs NCHW (the rule;
# with config.cpu_convolution_timing, the choice of convolutions too small or too many to time,
# see passes/convolution_timing.py; on a Xeon NCHW wins from about 2x): its cost is
# oneDNN's reorder of the weight (on every call, from either layout) and the arithmetic, and
# oneDNN's NHWC kernels lose at such shapes. Measured per call on one EPYC thread, 8 images:
# 512 -> 512 channels 3x3 over 2x2 (weight 144x the input): 7.7 ms NCHW, 10.9 ms NHWC (13.9 ms
# with the NCHW weight converted by ATen on each call); 256 -> 256 over 4x4 (18x): NHWC wins,
# 3.8 against 5.3 ms; MobileNetV3's 1x1 and depthwise convolutions over 2x2 (at most 18x): NHWC
# wins 2-3x. Its input is converted back to NCHW (small: the input is the small operand).
MAX_CHANNELS_LAST_WEIGHT_PER_INPUT = 32
# Elements per 16 bytes, the alignment cuBLAS's fast kernels need, by dtype.
ALIGNMENT = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}
# Smaller matmuls are left alone: the pad's copy would cost more than the aligned kernel saves.
MIN_PADDED_WORK = 2 ** 27  # M * N * K


def _padding(size: Any, alignment: int) -> int:
    return 0 if not isinstance(size, int) else -size % alignment


def _pad(graph: fx.Graph, before: fx.Node, tensor: fx.Node, amounts: Sequence[int], made: dict) -> fx.Node:
    """``tensor`` with ``amounts[d]`` zeros appended along dimension d. A permuted operand
    (``x.t()``, as the backward's matmuls take their inputs) is padded before its permute, so
    that the pad writes in ``x``'s order and reads it coalesced, and the two matmuls that read
    ``x`` and ``x.t()`` share one padded copy (``made``: pads by source and amounts)."""
    if not any(amounts):
        return tensor
    if isinstance(tensor, fx.Node) and tensor.target is aten.permute.default and isinstance(tensor.args[0], fx.Node):
        source, dims = tensor.args[0], [d % len(amounts) for d in tensor.args[1]]
        source_amounts = [0] * len(amounts)
        for position, dim in enumerate(dims):
            source_amounts[dim] = amounts[position]
        padded = _pad(graph, before, source, source_amounts, made)
        return emit_node(graph, before, aten.permute.default, (padded, list(tensor.args[1])))
    key = (tensor, tuple(amounts))
    if key not in made:
        pad_arg: list[int] = []
        for amount in reversed(amounts):  # constant_pad_nd lists the last dimension first
            pad_arg += [0, amount]
        made[key] = emit_node(graph, before, aten.constant_pad_nd.default, (tensor, pad_arg, 0.0))
    return made[key]


def _matmul_padding(node: fx.Node) -> Optional[tuple[int, int, int]]:
    """Zeros to add to (M, K, N) of an mm/bmm/addmm node, or None when it stays as it is."""
    a, b = (node.args[1], node.args[2]) if node.target is aten.addmm.default else node.args[:2]
    a_val, b_val, out = node_value(a), node_value(b), node.meta.get("val")
    if not all(isinstance(v, torch.Tensor) for v in (a_val, b_val, out)):
        return None
    if out.device.type not in PAD_DEVICES or out.dtype not in ALIGNMENT or a_val.dtype != b_val.dtype:
        return None
    m, k, n = a_val.shape[-2], a_val.shape[-1], b_val.shape[-1]
    if not all(isinstance(size, int) for size in (m, k, n)) or m * n * k < MIN_PADDED_WORK:
        return None
    alignment = ALIGNMENT[out.dtype]
    amounts = (_padding(m, alignment), _padding(k, alignment), _padding(n, alignment))
    return amounts if any(amounts) else None


def _pad_matmul(graph: fx.Graph, node: fx.Node, returned: set, made: dict) -> None:
    padding = _matmul_padding(node)
    if padding is None:
        return
    pad_m, pad_k, pad_n = padding
    is_addmm = node.target is aten.addmm.default
    a, b = (node.args[1], node.args[2]) if is_addmm else node.args[:2]
    batch = [0] * (node_value(a).dim() - 2)
    a = _pad(graph, node, a, batch + [pad_m, pad_k], made)
    b = _pad(graph, node, b, batch + [pad_k, pad_n], made)
    if is_addmm:
        bias = node.args[0]
        bias_shape = list(node_value(bias).shape)
        # a broadcast dimension (size 1, or missing) of the bias needs no padding
        wanted = [pad_m, pad_n][2 - len(bias_shape):]
        bias = _pad(graph, node, bias, [p if size != 1 else 0 for p, size in zip(wanted, bias_shape)], made)
        padded = emit_node(graph, node, aten.addmm.default, (bias, a, b, *node.args[3:]), dict(node.kwargs))
    else:
        padded = emit_node(graph, node, node.target, (a, b))
    result = padded
    out = node.meta["val"]
    for dim, amount in ((out.dim() - 2, pad_m), (out.dim() - 1, pad_n)):
        if amount:
            result = emit_node(graph, node, aten.slice.Tensor, (result, dim, 0, out.shape[dim]))
    if result is not padded and node in returned:
        # the caller sees eager's contiguous strides, not a view of the padded buffer
        result = emit_node(graph, node, aten.clone.default, (result,))
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def pad_matmuls(gm: fx.GraphModule) -> fx.GraphModule:
    """Pad unaligned matmul dimensions (see the module's docstring)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = set(output.all_input_nodes)
    made: dict = {}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (aten.mm.default, aten.bmm.default, aten.addmm.default):
            _pad_matmul(gm.graph, node, returned, made)
    return gm


def _scatter_operands(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node, fx.Node]]:
    """(self, index, values) of an accumulating ``index_put`` on dimension 0 by one int64 index
    tensor, the form a scatter-add can take; None otherwise."""
    if node.target is not aten.index_put.default or len(node.args) < 4 or node.args[3] is not True:
        return None
    target, indices, values = node.args[:3]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    self_val, index_val, values_val = node_value(target), node_value(indices[0]), node_value(values)
    if not all(isinstance(v, torch.Tensor) for v in (self_val, index_val, values_val)):
        return None
    if index_val.dtype != torch.int64 or self_val.dim() == 0 or index_val.dim() == 0:
        return None
    if self_val.is_complex() or self_val.dtype == torch.bool:
        return None
    shapes = (self_val.shape, index_val.shape, values_val.shape)
    if not all(isinstance(size, int) for shape in shapes for size in shape):
        return None
    return target, indices[0], values


def scatter_accumulate(gm: fx.GraphModule) -> fx.GraphModule:
    """Accumulating ``index_put`` on rows -> ``scatter_add`` (see the module's docstring)."""
    if torch.are_deterministic_algorithms_enabled():
        return gm
    graph = gm.graph
    for node in list(graph.nodes):
        operands = _scatter_operands(node) if node.op == "call_function" else None
        if operands is None:
            continue
        target, index, values = operands
        row_shape = list(node_value(target).shape[1:])
        rows = math.prod(node_value(index).shape)
        full_shape = list(node_value(index).shape) + row_shape
        if list(node_value(values).shape) != full_shape:  # index_put broadcasts its values
            values = emit_node(graph, node, aten.expand.default, (values, full_shape))
        values = emit_node(graph, node, aten.reshape.default, (values, [rows] + row_shape))
        # index_put counts negative indices from the end; scatter_add does not
        negative = emit_node(graph, node, aten.lt.Scalar, (index, 0))
        wrapped = emit_node(graph, node, aten.add.Tensor, (index, node_value(target).shape[0]))
        index = emit_node(graph, node, aten.where.self, (negative, wrapped, index))
        index = emit_node(graph, node, aten.reshape.default, (index, [rows] + [1] * len(row_shape)))
        index = emit_node(graph, node, aten.expand.default, (index, [rows] + row_shape))
        scattered = emit_node(graph, node, aten.scatter_add.default, (target, 0, index, values))
        node.replace_all_uses_with(scattered)
        graph.erase_node(node)
    return gm


def _memory_format(value: torch.Tensor) -> Optional[torch.memory_format]:
    """The memory format a graph output is dense in (what a clone restores), or None."""
    if dense_in(value, tuple(range(value.dim()))):
        return torch.contiguous_format
    return torch.channels_last if is_channels_last(value) else None


def _convolutions(gm: fx.GraphModule, devices: tuple[str, ...]) -> list[fx.Node]:
    """The 2-d convolutions of a graph on a device whose convolutions prefer NHWC. Sizes other
    than the channels may be symbolic (a dynamic batch or image size); the layout choices read
    their example values (``numel_hint``), which changes speed, never values."""
    convolutions = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.convolution.default:
            out = node.meta.get("val")
            if (not isinstance(out, torch.Tensor) or out.dim() != 4 or out.device.type not in devices
                    or not isinstance(out.shape[1], int) or numel_hint(out) is None
                    or (out.device.type == "cpu" and out.dtype not in CPU_CHANNELS_LAST_DTYPES)):
                return []
            convolutions.append(node)
    return convolutions


def _weight_dominated(convolution: fx.Node, budget: convolution_timing.Budget) -> bool:
    """A CPU convolution that runs NCHW in an NHWC graph: the faster layout when both are timed
    (``config.cpu_convolution_timing``), else the rule (``MAX_CHANNELS_LAST_WEIGHT_PER_INPUT``)."""
    if convolution.meta["val"].device.type != "cpu":
        return False
    x, weight = node_value(convolution.args[0]), node_value(convolution.args[1])
    rule = numel_hint(weight) > MAX_CHANNELS_LAST_WEIGHT_PER_INPUT * numel_hint(x)
    if not config.cpu_convolution_timing:
        return rule
    return convolution_timing.choose(convolution, _nhwc_operands(convolution), rule, budget).nchw


def _converted_operands(convolution: fx.Node, nchw: bool) -> tuple[int, ...]:
    """Which operands of a convolution (0: input, 1: weight) are converted to NHWC; none for
    one that runs NCHW (``_weight_dominated``)."""
    return () if nchw else _nhwc_operands(convolution)


def _nhwc_operands(convolution: fx.Node) -> tuple[int, ...]:
    """The operands converted to NHWC for a convolution that runs NHWC."""
    if node_value(convolution.args[0]).shape[1] >= MIN_CHANNELS_LAST_CHANNELS:
        # On the CPU an NHWC input alone makes oneDNN run NHWC, and it reorders the weight into
        # its own blocked layout on each call from either layout; an NHWC weight was a strided
        # copy, fused with BatchNorm's fold into a transposing kernel (ResNet-18 inference: 52 ms
        # of C++ kernels a step under load, 33 ms of it the 512-channel weights' transposes)
        return (0,) if convolution.meta["val"].device.type == "cpu" else (0, 1)
    # an image's 3 channels: converting it reads with a stride of H*W (see the constant)
    return (1,) if convolution.meta["val"].device.type == "cpu" else ()


def channels_last_convolutions(gm: fx.GraphModule) -> fx.GraphModule:
    """An inference graph with 2-d convolutions runs them in channels-last: cuDNN's kernels
    are NHWC, so NCHW operands are transposed in and out around every call (2.0 ms of a
    ResNet-50 inference step on an H200). The graph's input and weights are converted once
    where a convolution reads them; every later value keeps the layout of what it was computed
    from (as eager's kernels do), and the graph's outputs are returned in their eager strides.

    Not for a training forward graph: its saved tensors would reach the backward, which was
    traced for eager's strides, in another layout (and be copied back). Training graphs get
    the same rewrite on the joint graph instead (``channels_last_joint``), on the CPU."""
    return _channels_last(gm, CHANNELS_LAST_DEVICES)


def channels_last_joint(gm: fx.GraphModule) -> fx.GraphModule:
    """The joint forward + backward graph of a training step runs its convolutions (and what
    follows them: BatchNorm, pooling, their backwards, ``convolution_backward``) in
    channels-last, before it is partitioned: the forward saves NHWC tensors and the backward is
    typed for them, so nothing is copied between the two. The gradients and forward outputs
    leave in eager's strides. CPU only: oneDNN's NHWC convolutions and ATen's NHWC pooling and
    BatchNorm kernels; not measured on a GPU. A CPU graph goes NHWC where its convolutions,
    forward and backward, timed faster so (``config.cpu_convolution_timing``,
    ``convolution_timing.training_prefers_nhwc``); ``CHANNELS_LAST_TRAINING_DEVICES`` forces it."""
    devices = CHANNELS_LAST_TRAINING_DEVICES
    if "cpu" not in devices and config.cpu_convolution_timing:
        convolutions = _convolutions(gm, ("cpu",))
        if convolutions and convolution_timing.training_prefers_nhwc(convolutions, _nhwc_operands):
            devices = (*devices, "cpu")
    return _channels_last(gm, devices)


def _channels_last(gm: fx.GraphModule, devices: tuple[str, ...]) -> fx.GraphModule:
    convolutions = _convolutions(gm, devices)
    outputs = [a for a in next(n for n in gm.graph.nodes if n.op == "output").args[0]] if convolutions else []
    eager_strides = {node: node.meta["val"].stride() for node in outputs
                     if isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)}
    if not convolutions or not all(_memory_format(node.meta["val"]) is not None for node in eager_strides):
        return gm
    eager_formats = {node: _memory_format(node.meta["val"]) for node in eager_strides}
    converted: dict[fx.Node, fx.Node] = {}
    to_nchw: list[fx.Node] = []
    original_args = {convolution: convolution.args for convolution in convolutions}
    budget = convolution_timing.Budget()  # the timing one graph may spend
    nchw = {convolution: _weight_dominated(convolution, budget) for convolution in convolutions}
    for convolution in convolutions:
        for index in _converted_operands(convolution, nchw[convolution]):
            operand = convolution.args[index]
            if isinstance(operand, fx.Node) and not is_channels_last(operand.meta["val"]) and operand not in converted:
                converted[operand] = emit_node(gm.graph, convolution, aten.clone.default, (operand,),
                                           {"memory_format": torch.channels_last})
        convolution.args = tuple(converted.get(a, a) if i < 2 else a for i, a in enumerate(convolution.args))
        if nchw[convolution] and isinstance(convolution.args[0], fx.Node):
            # NCHW in an NHWC graph: its input comes back to NCHW (a no-op clone is dropped below)
            back = emit_node(gm.graph, convolution, aten.clone.default, (convolution.args[0],),
                             {"memory_format": torch.contiguous_format})
            convolution.args = (back, *convolution.args[1:])
            to_nchw.append(back)
    for node in gm.graph.nodes:  # a joint graph's backward convolutions read the same NHWC copies
        if node.op == "call_function" and node.target is aten.convolution_backward.default and converted:
            original_args[node] = node.args
            node.args = tuple(converted.get(a, a) if i in (1, 2) else a for i, a in enumerate(node.args))
    if not converted:
        # only a patch embedding's 3-channel convolution (ViT, Swin), or convolutions that stay
        # NCHW: nothing changed
        for convolution, args in original_args.items():
            convolution.args = args
        for clone in to_nchw:
            gm.graph.erase_node(clone)
        return gm
    saved = {node: node.meta.get("val") for node in gm.graph.nodes if node not in converted.values()}
    try:
        _propagate_fake_values(gm)
    except Exception as error:  # noqa: BLE001  (a graph the new layouts do not fit keeps eager's)
        # A view traced for eager's contiguous strides (a patch embedding's flatten) may not be
        # expressible over the channels-last result: the graph keeps eager's layouts.
        for convolution, args in original_args.items():
            convolution.args = args
        for clone in (*converted.values(), *to_nchw):
            gm.graph.erase_node(clone)
        for node, value in saved.items():
            node.meta["val"] = value
        log.info("aotforge: convolutions keep eager's layout: channels-last does not fit this graph (%s: %s)",
                 type(error).__name__, error)
        return gm
    for clone in to_nchw:
        if same_sizes(clone.meta["val"].stride(), node_value(clone.args[0]).stride()):
            clone.replace_all_uses_with(clone.args[0])
            gm.graph.erase_node(clone)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node, stride in eager_strides.items():
        if not same_sizes(node.meta["val"].stride(), stride):
            restored = emit_node(gm.graph, output, aten.clone.default, (node,), {"memory_format": eager_formats[node]})
            output.replace_input_with(node, restored)
    return gm


def _propagate_fake_values(gm: fx.GraphModule) -> None:
    """Recompute every node's fake value from the placeholders' (layouts changed upstream)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in placeholders if isinstance(v, torch.Tensor)])
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*placeholders)


def library_call_passes(gm: fx.GraphModule, kind: str) -> fx.GraphModule:
    """Passes on a graph about to get generated kernels, in order (after ``post_grad_passes``)."""
    # (these modules build on this one's helpers)

    # inference: BatchNorm folded into the convolution, then NHWC (1x1 convolutions then run as
    # matrix multiplies), then max pooling's taps (a padded input is stored in the layout its
    # producer has by then)
    # training forward: its max pooling saves the indices for the backward, computed in a kernel
    layout_passes = ((fold_channel_affine, channels_last_convolutions, convolutions_as_matmuls, pointwise_max_pooling)
                     if kind == "inference" else (pointwise_max_pooling, pointwise_max_pooling_with_indices)
                     if kind == "forward" else (pointwise_max_pooling,))
    return run_passes(gm, (*layout_passes, pad_matmuls, scatter_accumulate))
