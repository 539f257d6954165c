"""What the partitioner knows about each ATen op: may it be recomputed, and what does it cost.

Every op falls in one *kind*, looked up in ``aotforge.op_table`` by its overload packet
(``aten.gelu``, not ``aten.gelu.default``). Ops missing from the table fall back on the tags
PyTorch puts on them (``nondeterministic_seeded`` -> random, ``pointwise`` -> pointwise), and
anything still unknown is treated as not recomputable: recomputing an op we know nothing
about could be slow or have effects, saving it is always correct.

    kind          recomputed in the backward?
    ----          ---------------------------
    view          yes, for free (an alias of its input)
    pointwise     yes (memory-bound, fuses into its users)
    reduction     yes (one pass over the input: sums, norms, softmax)
    cast          yes (dtype conversions, clones)
    creation      yes (zeros, arange, ...: needs no input at all)
    indexing      yes (gather, cat, pad, scatter: memory-bound)
    symbolic      yes (SymInt arithmetic; decided by the value's type, not the op)
    compute       only under an activation memory budget < 1 (matmul, conv, attention)
    random        never: a second draw would give a different mask (unless the graph uses
                  functionalized RNG, whose philox ops are plain functions of seed and offset)
    collective    never (functional collectives and their waits: saved, so every rank
                  issues exactly the collectives of its graph, in its order)
    unknown       never

``estimate_flops`` gives the runtime estimate the memory-budget knapsack trades against bytes;
it is a table of FLOP formulas keyed by packet, with "one op per output element" for the rest.
"""
from __future__ import annotations

import math
import operator
from typing import Callable, Iterable

import torch
import torch.fx as fx

from .. import op_table
from ..torch_versions import optimization_size_hint
from .. import eager_rounding
from ..op_table import (CAST, COLLECTIVE, COMPUTE, CREATION, GETITEM, INDEXING, POINTWISE, RANDOM,  # noqa: F401
                        REDUCTION, UNKNOWN, VIEW, packet_of)

aten = torch.ops.aten

SYMBOLIC = "symbolic"

# Kinds the min-cut may always move into the backward.
RECOMPUTABLE_KINDS = frozenset(
    {VIEW, POINTWISE, REDUCTION, CAST, CREATION, INDEXING, SYMBOLIC, GETITEM}
)


def op_kind(node: fx.Node) -> str:
    """The recomputation kind of ``node`` (see the module docstring)."""
    if node.op == "placeholder":
        return UNKNOWN  # an input is never recomputed: there is nothing to compute it from
    if node.op == "get_attr":
        return CREATION  # a constant attribute is available to both graphs
    if node.op != "call_function":
        return UNKNOWN
    if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return SYMBOLIC
    if _eager_kernel_call(node):
        return COMPUTE
    return op_table.kind(node.target)


def _eager_kernel_call(node: fx.Node) -> bool:
    """Whether ``node`` stays a call of eager's CPU kernel on the C++ path (its rounding is
    the library's: aotforge/eager_rounding.py). A backward that recomputed it would pay a
    whole pass of that kernel again, unfused (GELU and LayerNorm: about a quarter of an MLP
    step), so the partitioner saves its output like the other library calls'."""
    return (eager_rounding.eager_rounding(node.target, node) is not None and eager_rounding.chosen_by_config()
            and eager_rounding.on_cpu(node.meta.get("val")))


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and op_table.is_view(node.target)


def view_base(node: fx.Node) -> fx.Node:
    """Follow a chain of views back to the tensor that owns the memory."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


# --- sizes ------------------------------------------------------------------------------

# Used for a symbolic size with no hint (unbacked); only ranks choices, never correctness.
SIZE_FALLBACK = 4096


def hint(value) -> int:
    """A concrete int for a possibly symbolic size, without adding guards."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        node = value.node
        concrete = getattr(node, "hint", None)
        if concrete is None and getattr(node, "shape_env", None) is not None:
            try:
                concrete = optimization_size_hint(node.shape_env, node.expr, SIZE_FALLBACK)
            except Exception:  # a shape env without hints for this expression
                concrete = None
        return int(concrete) if concrete is not None else SIZE_FALLBACK
    return int(value)


def tensor_bytes(value) -> int:
    """Bytes of a tensor value (numel x itemsize); lists and tuples add up their tensors."""
    if isinstance(value, torch.Tensor):
        return math.prod(hint(s) for s in value.shape) * value.dtype.itemsize
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def node_bytes(node: fx.Node) -> int:
    return tensor_bytes(node.meta.get("val"))


# --- runtime estimates ------------------------------------------------------------------


def _shape(arg) -> list[int]:
    value = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
    return [hint(s) for s in value.shape]


def _mm_flops(node: fx.Node) -> int:
    (m, k), (_, n) = _shape(node.args[0]), _shape(node.args[1])
    return 2 * m * n * k


def _addmm_flops(node: fx.Node) -> int:
    (m, k), (_, n) = _shape(node.args[1]), _shape(node.args[2])
    return 2 * m * n * k


def _bmm_flops(node: fx.Node, first: int = 0) -> int:
    (b, m, k), (_, _, n) = _shape(node.args[first]), _shape(node.args[first + 1])
    return 2 * b * m * n * k


def _conv_flops(node: fx.Node) -> int:
    # every output element is a dot product over (input channels / groups) x kernel
    weight = _shape(node.args[1])
    return 2 * _output_numel(node) * math.prod(weight[1:])


def _conv_backward_flops(node: fx.Node) -> int:
    # grad input and grad weight each cost about one forward convolution
    weight = _shape(node.args[2])
    return 4 * math.prod(_shape(node.args[0])) * math.prod(weight[1:])


def _attention_flops(node: fx.Node) -> int:
    # q @ k^T and p @ v: 2 matmuls of B*H*L*S*E multiply-adds
    *batch, length, embed = _shape(node.args[0])
    source = _shape(node.args[1])[-2]
    return 4 * math.prod(batch) * length * source * embed


def _output_numel(node: fx.Node) -> int:
    value = node.meta.get("val")
    if isinstance(value, (list, tuple)):
        value = next((v for v in value if isinstance(v, torch.Tensor)), None)
    if not isinstance(value, torch.Tensor):
        return 1
    return math.prod(hint(s) for s in value.shape)


FLOP_ESTIMATES: dict[object, Callable[[fx.Node], int]] = {
    aten.mm: _mm_flops,
    aten.addmm: _addmm_flops,
    aten.bmm: _bmm_flops,
    aten.baddbmm: lambda node: _bmm_flops(node, first=1),
    aten.convolution: _conv_flops,
    aten.convolution_backward: _conv_backward_flops,
    **{
        packet: _attention_flops
        for packet in op_table.packets(
            aten,
            """_scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention
            _scaled_dot_product_cudnn_attention _scaled_dot_product_flash_attention_for_cpu
            _scaled_dot_product_fused_attention_overrideable _flash_attention_forward
            _efficient_attention_forward""".split(),
        )
    },
}


def estimate_flops(node: fx.Node) -> int:
    """Rough floating-point operations of one node; memory-bound ops count one per element."""
    estimate = FLOP_ESTIMATES.get(packet_of(node.target))
    if estimate is not None:
        try:
            return max(int(estimate(node)), 1)
        except (TypeError, ValueError, IndexError, AttributeError):
            pass  # unusual arguments (e.g. batched mm inputs): fall back on the output size
    return max(_output_numel(node), 1)
