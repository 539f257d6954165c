"""What aotforge knows about each ATen op, in one table keyed by the op's overload packet
(``aten.gelu``, not ``aten.gelu.default``), read by the partitioner, the graph passes and the
compiler alike.

Each op has a *kind* and two flags::

    kind        view, pointwise, reduction, cast, creation, indexing, compute, random,
                collective
    kept_whole  never decomposed: its ATen kernel (cuBLAS, cuDNN, attention) beats
                anything generated, so the compiler calls it as an extern
    distinct    two calls with the same arguments give different results (random draws,
                uninitialized memory): never merged by CSE

Ops missing from the table fall back on PyTorch's tags (``nondeterministic_seeded`` ->
random, ``pointwise`` -> pointwise) and are otherwise unknown.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Iterable

import torch

aten = torch.ops.aten

VIEW = "view"
POINTWISE = "pointwise"
REDUCTION = "reduction"
CAST = "cast"
CREATION = "creation"
INDEXING = "indexing"
COMPUTE = "compute"
RANDOM = "random"
# functional collectives (``_c10d_functional``) and their waits: every rank must issue the
# same collectives in the same order, so they are never merged, folded or recomputed
COLLECTIVE = "collective"
GETITEM = "getitem"
UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class OpInfo:
    kind: str
    kept_whole: bool = False
    distinct: bool = False


def packets(namespace: Any, names: Iterable[str]) -> list:
    """The packets among ``names`` that this torch version has (2.11 to 2.13 differ a bit)."""
    return [getattr(namespace, name) for name in names if hasattr(namespace, name)]


def _table() -> dict:
    table: dict = {}

    def add(namespace: Any, names: str, kind: str, **flags: bool) -> None:
        for packet in packets(namespace, names.split()):
            table[packet] = OpInfo(kind, **flags)

    add(aten, """view _unsafe_view reshape t transpose permute expand slice select squeeze
        unsqueeze alias as_strided split split_with_sizes unbind chunk narrow diagonal unfold
        view_as_real view_as_complex detach numpy_T""", VIEW)
    add(aten, """sum mean amax amin max min var std std_mean prod logsumexp
        _softmax _log_softmax native_layer_norm native_group_norm
        _native_batch_norm_legit_no_training argmax argmin any all norm linalg_vector_norm
        cumsum avg_pool2d adaptive_avg_pool2d _adaptive_avg_pool2d
        _grad_sum_to_size sum_to_size""", REDUCTION)
    # Library calls the compiler keeps (batch norm's training forward, max pooling): a
    # backward that recomputed them would pay a whole pass of eager's kernel again (a CPU
    # conv net recomputed both: 11 ms of a 63 ms step). The partitioner saves their outputs.
    add(aten, """native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional
        max_pool2d_with_indices""", COMPUTE)
    add(aten, "var_mean", REDUCTION, kept_whole=True)
    add(aten, "_to_copy to type_as clone lift_fresh_copy contiguous", CAST)
    add(aten, """full zeros ones zeros_like ones_like full_like new_zeros new_ones new_full
        arange scalar_tensor eye linspace""", CREATION)
    add(aten, "empty empty_like empty_strided new_empty new_empty_strided", CREATION, distinct=True)
    add(aten, """index gather index_select embedding cat stack constant_pad_nd
        scatter scatter_add index_put slice_scatter select_scatter as_strided_scatter
        diagonal_scatter triu tril flip roll repeat masked_fill where""", INDEXING)
    add(aten, """mm addmm bmm convolution convolution_backward
        _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention""", COMPUTE, kept_whole=True)
    # Core ATen decomposes the CPU flash-attention forward into math whose saved logsumexp the
    # fused backward kernel does not accept (wrong input gradients): attention stays whole.
    add(aten, """scaled_dot_product_attention _scaled_dot_product_attention_math
        _scaled_dot_product_flash_attention_for_cpu""", COMPUTE, kept_whole=True)
    add(aten, """baddbmm _convolution _scaled_dot_product_cudnn_attention
        _scaled_dot_product_fused_attention_overrideable
        _flash_attention_forward _efficient_attention_forward _scaled_mm upsample_bilinear2d""", COMPUTE)
    add(aten, """native_dropout bernoulli rand rand_like randn randn_like randint randint_like
        randperm normal normal_functional uniform exponential geometric log_normal cauchy random
        multinomial poisson rrelu_with_noise rrelu_with_noise_functional _fused_dropout
        _standard_gamma _sample_dirichlet binomial seed""", RANDOM, distinct=True)
    if hasattr(torch.ops, "prims"):
        add(torch.ops.prims, "broadcast_in_dim view_of collapse_view split_dim squeeze", VIEW)
        add(torch.ops.prims, "convert_element_type", CAST)
        add(torch.ops.prims, "sum var amax amin prod", REDUCTION)
        add(torch.ops.prims, "iota full full_like", CREATION)
    # Functionalized RNG: philox ops are deterministic given (seed, offset), so they are pure
    # functions the backward may replay; CSE still leaves each draw alone.
    if hasattr(torch.ops, "rngprims"):
        add(torch.ops.rngprims, "philox_rand", POINTWISE, distinct=True)
    # A redraw at a saved generator state (aot/rng.py, eager scheme) is as pure as philox.
    add(torch.ops.higher_order, "run_with_rng_state", POINTWISE, distinct=True)
    add(torch.ops.higher_order, "run_and_save_rng_state", RANDOM, distinct=True)
    table[operator.getitem] = OpInfo(GETITEM)
    return table


OPS: dict = _table()

# Ops that other libraries register only when they are imported (so no packet exists when
# this module loads), keyed by qualified name. Inductor's decompositions emit these two.
LATE_OPS: dict[str, OpInfo] = {
    "prims::_low_memory_max_pool_with_offsets": OpInfo(REDUCTION),
    "prims::_low_memory_max_pool_offsets_to_indices": OpInfo(INDEXING),
    # aotforge/philox.py: functionalized RNG's draws, pure functions of their seed. Counted
    # as compute for the partitioner: a redraw costs ten philox rounds per element, so the
    # backward reads the forward's (1-byte) mask instead. Measured on an H100, HF BERT
    # training redrew each attention dropout mask twice in the backward: 4.4 ms of 52 per step.
    "aotforge::philox_rand": OpInfo(COMPUTE, distinct=True),
    # aot/rng.py's eager scheme for dropout: a draw that saves its state, and a redraw at it
    "aotforge::dropout_saving_state": OpInfo(RANDOM, distinct=True),
    "aotforge::dropout_at_state": OpInfo(POINTWISE, distinct=True),
    # effect tokens (aot/effects.py): a token is free to make wherever it is needed
    "prims::_make_token": OpInfo(CREATION, distinct=True),
}
LATE_OPS.update({f"_c10d_functional::{name}": OpInfo(COLLECTIVE, distinct=True) for name in (
    "all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
    "all_gather_into_tensor_out", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
    "all_to_all_single", "broadcast", "wait_tensor")})

_UNKNOWN = OpInfo(UNKNOWN)


def packet_of(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def info(target: Any) -> OpInfo:
    """What the table knows of an op (an overload, a packet or ``operator.getitem``)."""
    packet = packet_of(target)
    found = OPS.get(packet) or LATE_OPS.get(getattr(packet, "_qualified_op_name", ""))
    if found is not None:
        return found
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return OpInfo(RANDOM, distinct=True)
    if torch.Tag.pointwise in tags:
        return OpInfo(POINTWISE)
    return _UNKNOWN


def kind(target: Any) -> str:
    return info(target).kind


def is_view(target: Any) -> bool:
    """Whether the op's result is a view of its first argument: the table's views, and any op
    whose schema says its result aliases an argument it does not write."""
    if kind(target) == VIEW:
        return True
    schema = getattr(target, "_schema", None)
    alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
    return alias is not None and not alias.is_write


def packets_of_kind(wanted: str) -> list:
    """The packets the table gives ``wanted`` (``RANDOM``: every random draw aotforge knows)."""
    return [packet for packet, entry in OPS.items()
            if entry.kind == wanted and isinstance(packet, torch._ops.OpOverloadPacket)]


def kept_whole() -> list:
    """The packets the compiler never decomposes."""
    return [packet for packet, entry in OPS.items() if entry.kept_whole]
