"""The decomposition table the compiler traces with: core ATen plus the composite ops the
loop IR fuses best when they are spelled out (softmax, norms, activations and their
backwards). Matmul, convolution and attention stay whole: they run as ATen externs."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

from .. import op_table
from .. import eager_rounding

aten = torch.ops.aten

# decomposed on top of core ATen, so the scheduler sees their reductions and pointwise math
EXTRA_DECOMPOSITIONS = [
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward",
    "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "native_batch_norm_backward",
    "native_group_norm", "native_group_norm_backward",
    "gelu", "gelu_backward", "silu", "silu_backward", "sigmoid_backward",
    "tanh_backward", "threshold_backward", "hardtanh", "hardtanh_backward",
    "leaky_relu", "leaky_relu_backward", "elu", "elu_backward", "mish",
    "hardsigmoid", "hardswish", "softplus", "softplus_backward", "log_sigmoid_forward",
    "mse_loss", "mse_loss_backward", "nll_loss_forward", "nll_loss_backward",
    "std", "std_mean", "addcmul", "addcdiv", "rms_norm", "_fused_rms_norm",
    "embedding_dense_backward", "linalg_vector_norm", "native_dropout_backward",
]  # by name: not every op exists in every supported torch version



@functools.lru_cache(None)
def _table() -> dict:
    table = dict(core_aten_decompositions())
    extras = [getattr(aten, name) for name in EXTRA_DECOMPOSITIONS if hasattr(aten, name)]
    table.update(get_decompositions(extras))
    for packet in op_table.kept_whole():  # cuBLAS, cuDNN, attention: run as externs
        for overload in packet.overloads():
            table.pop(getattr(packet, overload), None)
    # Batch norm's training forward stays whole: traced through its decomposition, a float32
    # conv net's gradients came out 1e-3 to 2e-2 off float64 (eager: 1e-5), measured on the
    # CPU benchmark's conv net with the ATen ops themselves (no generated code)
    for overload in aten._native_batch_norm_legit_functional.overloads():
        table.pop(getattr(aten._native_batch_norm_legit_functional, overload), None)
    # Batch norm's backward on the CPU stays whole too (ATen's kernel, eager's): decomposed, the
    # conv net's three took 20 ms of C++ sums and pointwise kernels a training step (one thread,
    # with the x - mean the forward then saves for them) against 5.5 ms for ATen's vectorized
    # kernel plus 3 ms of ReLU backward; on a GPU the decomposition fuses into Triton kernels
    for overload in aten.native_batch_norm_backward.overloads():
        op = getattr(aten.native_batch_norm_backward, overload)
        if op in table:
            table[op] = _declined_when(_on_cpu, table[op])
    # softmax of integers or bools: eager raises for a non-empty tensor and returns an empty one
    # otherwise, where torch's decomposition builds an invalid graph (an integer -inf, a bool
    # subtraction); the op stays whole (an ATen call), which does as eager does
    for op in (aten._softmax.default, aten._log_softmax.default):
        if op in table:
            table[op] = _declined_when(_not_floating, table[op])
    # the optimizers' pointwise steps rounded as eager's kernels round them (issue 37): lerp and
    # addcmul stay whole for their lowerings (eager's fma), addcdiv on the CPU multiplies by
    # ``value`` first, as ATen's CPU kernel does
    for overload in aten.lerp.overloads():
        table.pop(getattr(aten.lerp, overload), None)
    table.pop(aten.addcmul.default, None)
    table[aten.addcdiv.default] = functools.partial(_addcdiv, table.get(aten.addcdiv.default))
    # ops whose eager CPU kernel rounds its own way (MKL, Sleef, Welford: eager_rounding.py) are
    # traced whole for CPU tensors when the C++ path keeps eager's bits (config.cpu_eager_bits)
    for op, decomposition in list(table.items()):
        if eager_rounding.eager_rounding(op) is not None:
            table[op] = _declined_when(_keeps_eager_rounding, decomposition)
    return table


def eager_rounding_active() -> bool:
    """Whether graphs traced now for CPU tensors keep eager's rounding: the configuration asks
    for it (eager_rounding.chosen_by_config) and the C++ path is taken (a working compiler)."""
    if not eager_rounding.chosen_by_config():
        return False
    from .runtime import cpp_build  # (probes the compiler once per process)

    return cpp_build.compiler_problem() is None


def _keeps_eager_rounding(*args, **kwargs) -> bool:
    """An op of eager_rounding's table on CPU tensors while ``eager_rounding_active()``: the
    C++ path then runs eager's kernel."""
    return eager_rounding_active() and eager_rounding.on_cpu((args, kwargs))


def _addcdiv(decomposition, self, tensor1, tensor2, *, value=1):
    """addcdiv as eager's kernel on the tensors' device rounds it: ATen's CPU
    kernel computes ``self + value * t1 / t2`` in that order, torch's decomposition (eager's
    CUDA kernel) divides first. AdamW's step is an addcdiv: the other order drifted a compiled
    training loop off eager's bits on the CPU (issue 37)."""
    if self.device.type != "cpu" and decomposition is not None:
        return decomposition(self, tensor1, tensor2, value=value)
    return self + (value * tensor1) / tensor2


def _on_cpu(x, *args, **kwargs) -> bool:
    return x.device.type == "cpu"


def _not_floating(x, *args, **kwargs) -> bool:
    return not x.dtype.is_floating_point


def _declined_when(declines: Callable[..., bool], decomposition: Callable) -> Callable:
    """``decomposition``, declined for the arguments ``declines`` picks: the tracer then
    records the op itself (it runs as an ATen call)."""
    @functools.wraps(decomposition)
    def decompose(*args, **kwargs):
        if declines(*args, **kwargs):
            return NotImplemented
        return decomposition(*args, **kwargs)
    return decompose


def select_decomposition_table(extra: dict[Any, Callable] | None = None) -> dict[Any, Callable]:
    """The compiler's table; ``extra`` (a caller's decompositions) takes precedence."""
    table = dict(_table())
    if extra:
        table.update(extra)
    return table
