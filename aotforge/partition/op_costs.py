"""What the partitioner knows about each ATen op: may it be recomputed, and what does it cost.

Every op falls in one *kind*, looked up in ``OP_KINDS`` by its overload packet
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

aten = torch.ops.aten

VIEW = "view"
POINTWISE = "pointwise"
REDUCTION = "reduction"
CAST = "cast"
CREATION = "creation"
INDEXING = "indexing"
SYMBOLIC = "symbolic"
GETITEM = "getitem"
COMPUTE = "compute"
RANDOM = "random"
UNKNOWN = "unknown"

# Kinds the min-cut may always move into the backward.
RECOMPUTABLE_KINDS = frozenset(
    {VIEW, POINTWISE, REDUCTION, CAST, CREATION, INDEXING, SYMBOLIC, GETITEM}
)


def _packets(namespace, names: Iterable[str]) -> list:
    """The packets among ``names`` that this torch version has (2.11 to 2.13 differ a bit)."""
    return [getattr(namespace, name) for name in names if hasattr(namespace, name)]


def _table() -> dict:
    kinds: dict = {}

    def add(kind: str, namespace, names: str) -> None:
        for packet in _packets(namespace, names.split()):
            kinds[packet] = kind

    add(VIEW, aten, """view _unsafe_view reshape t transpose permute expand slice select squeeze
        unsqueeze alias as_strided split split_with_sizes unbind chunk narrow diagonal unfold
        view_as_real view_as_complex detach numpy_T""")
    add(REDUCTION, aten, """sum mean amax amin max min var var_mean std std_mean prod logsumexp
        _softmax _log_softmax native_layer_norm native_group_norm native_batch_norm
        _native_batch_norm_legit _native_batch_norm_legit_functional
        _native_batch_norm_legit_no_training argmax argmin any all norm linalg_vector_norm
        cumsum max_pool2d_with_indices avg_pool2d adaptive_avg_pool2d _adaptive_avg_pool2d
        _grad_sum_to_size sum_to_size""")
    add(CAST, aten, "_to_copy to type_as clone lift_fresh_copy contiguous")
    add(CREATION, aten, """full zeros ones empty empty_like empty_strided zeros_like ones_like
        full_like new_zeros new_ones new_full new_empty arange scalar_tensor eye linspace""")
    add(INDEXING, aten, """index gather index_select embedding cat stack constant_pad_nd
        scatter scatter_add index_put slice_scatter select_scatter as_strided_scatter
        diagonal_scatter triu tril flip roll repeat masked_fill where""")
    add(COMPUTE, aten, """mm addmm bmm baddbmm convolution convolution_backward _convolution
        _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention
        _scaled_dot_product_cudnn_attention _scaled_dot_product_flash_attention_for_cpu
        _scaled_dot_product_fused_attention_overrideable _flash_attention_forward
        _efficient_attention_forward _scaled_mm upsample_bilinear2d""")
    add(RANDOM, aten, """native_dropout bernoulli rand rand_like randn randn_like randint
        randint_like randperm normal uniform exponential multinomial poisson rrelu_with_noise
        _fused_dropout""")
    if hasattr(torch.ops, "prims"):
        add(VIEW, torch.ops.prims, "broadcast_in_dim view_of collapse_view split_dim squeeze")
        add(CAST, torch.ops.prims, "convert_element_type")
        add(REDUCTION, torch.ops.prims, "sum var amax amin prod")
        add(CREATION, torch.ops.prims, "iota full full_like")
    # Functionalized RNG: philox ops are deterministic given (seed, offset), so they are pure
    # functions the backward may replay.
    if hasattr(torch.ops, "rngprims"):
        add(POINTWISE, torch.ops.rngprims, "philox_rand")
    kinds[operator.getitem] = GETITEM
    return kinds


OP_KINDS: dict = _table()

# Ops that other libraries register only when they are imported (so no packet exists when
# this module loads), keyed by qualified name. Inductor's decompositions emit these two.
LATE_OP_KINDS: dict[str, str] = {
    "prims::_low_memory_max_pool_with_offsets": REDUCTION,
    "prims::_low_memory_max_pool_offsets_to_indices": INDEXING,
}


def _packet_of(target):
    return getattr(target, "overloadpacket", target)


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
    packet = _packet_of(node.target)
    kind = OP_KINDS.get(packet) or LATE_OP_KINDS.get(getattr(packet, "_qualified_op_name", ""))
    if kind is not None:
        return kind
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return RANDOM
    if torch.Tag.pointwise in tags:
        return POINTWISE
    return UNKNOWN


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and OP_KINDS.get(_packet_of(node.target)) == VIEW


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
                concrete = node.shape_env.size_hint(node.expr, allow_none=True)
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
        for packet in _packets(
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
    estimate = FLOP_ESTIMATES.get(_packet_of(node.target))
    if estimate is not None:
        try:
            return max(int(estimate(node)), 1)
        except (TypeError, ValueError, IndexError, AttributeError):
            pass  # unusual arguments (e.g. batched mm inputs): fall back on the output size
    return max(_output_numel(node), 1)
