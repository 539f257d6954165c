"""ATen ops whose eager CPU kernel rounds in a library-specific way: on the C++ path they stay
ATen calls, so that a compiled graph gives eager's bits (issue 37, ``config.cpu_eager_bits``).

Eager's CPU kernels do not compute these functions with the C library's correctly or nearly
correctly rounded routines our C++ kernels call: ``exp``, ``log``, ``sqrt``, ``tanh``, ``erf``
... go through MKL's vector math library (``at::vml``: torch/include/ATen/cpu/vml.h), whose
results differ from glibc's in 5-60% of float32 values (sqrt: 14-17% one ulp off correct
rounding on this AMD CPU); others through Sleef's vectorized routines; GELU through ATen's own
erf polynomial; softmax through a fast ``exp``; LayerNorm, var and group norm through Welford
moments. Each difference is an ulp, but a training loop amplifies it (AdamW turns a gradient
that is zero up to rounding into a full step), so a compiled step drifted off eager's from
step 0. With ``config.cpu_eager_bits`` (the default) the C++ path keeps these ops whole: the
decomposition table leaves the composite ones undecomposed while tracing CPU tensors, and the
lowering runs every op here as an ATen call; everything around them still fuses into C++.

Used by the decomposition table and the lowering (compiler/) and by the partitioner, which
saves these ops' outputs rather than recompute them (partition/op_costs.py). Grounded by
tests/compiler/test_eager_rounding.py: every elementwise and reduction
instruction the C++ printer spells is compared with eager bit for bit on 10^5 float32 and
float64 values; those that differ are here, those that do not are absent.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

aten = torch.ops.aten

MKL = "MKL's vector math library (at::vml), not glibc's routine"
SLEEF = "Sleef's vectorized routine in ATen's kernel, not glibc's"

# ATen op (packet: every overload) -> why eager's CPU kernel rounds its own way
EAGER_ROUNDING: dict[Any, str] = {
    **{getattr(aten, name): MKL for name in (
        "exp", "log", "log2", "log10", "sqrt", "sin", "cos", "tan", "asin", "acos", "atan", "tanh",
        "erf", "erfc", "erfinv")},
    **{getattr(aten, name): SLEEF for name in (
        "exp2", "expm1", "log1p", "sinh", "cosh", "atanh", "atan2", "hypot", "pow")},
    aten.sigmoid: "1 / (1 + exp(-x)) with Sleef's vectorized exp",
    aten.lgamma: "ATen's own lgamma loop",
    aten.prod: "a product in vector lanes, combined at the end",
    aten.gelu: "ATen's vectorized erf (an Abramowitz-Stegun polynomial with Sleef's exp) or tanh",
    aten.gelu_backward: "ATen's vectorized erf/exp or tanh",
    aten.silu: "Sleef's vectorized exp", aten.silu_backward: "Sleef's vectorized exp",
    aten.mish: "Sleef's vectorized tanh, log1p and exp", aten.mish_backward: "Sleef's vectorized tanh and exp",
    aten.elu: "Sleef's vectorized expm1", aten.elu_backward: "Sleef's vectorized exp",
    aten.softplus: "Sleef's vectorized log1p and exp", aten.softplus_backward: "Sleef's vectorized exp",
    aten.log_sigmoid_forward: "Sleef's vectorized log1p and exp",
    aten.log_sigmoid_backward: "Sleef's vectorized exp",
    aten.logit: "MKL's log",
    aten._softmax: "a fast vectorized exp (exp_u20) and ATen's own sums",
    aten._log_softmax: "Sleef's exp and log, ATen's own sums",
    aten._softmax_backward_data: "ATen's vectorized row sums",
    aten._log_softmax_backward_data: "Sleef's exp, ATen's vectorized row sums",
    aten.logsumexp: "Sleef's exp and log, ATen's own sums",
    aten.native_layer_norm: "Welford moments (RowwiseMoments)",
    aten.native_layer_norm_backward: "ATen's vectorized row sums",
    aten.rms_norm: "ATen's own sum of squares and rsqrt",
    aten._fused_rms_norm: "ATen's own sum of squares and rsqrt",
    aten.native_group_norm: "Welford moments (RowwiseMoments)",
    aten.native_group_norm_backward: "ATen's vectorized sums",
    aten.var: "Welford moments", aten.var_mean: "Welford moments",
    aten.std: "Welford moments and MKL's sqrt", aten.std_mean: "Welford moments and MKL's sqrt",
    aten.nll_loss_forward: "ATen's own cascade sum of the losses (eight levels)",
    aten.nll_loss2d_forward: "ATen's own cascade sum of the losses (eight levels)",
    aten.linalg_vector_norm: "ATen's norm kernel (its own sums, MKL's sqrt)",
    aten.norm: "ATen's norm kernel (its own sums, MKL's sqrt)",
}


def _pow_exponent_is_exact(node: Any) -> bool:
    """x ** 0, 1, 2 and 3 are eager's bits (ATen's pow kernel multiplies for 2 and 3, as our
    lowering does); any other exponent is std::pow, sqrt, rsqrt or Sleef's pow in eager."""
    if node is None or getattr(node, "target", None) is not aten.pow.Tensor_Scalar:
        return False
    exponent = node.args[1] if len(node.args) > 1 else node.kwargs.get("exponent")
    return isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent in (0, 1, 2, 3)


# ATen op -> when a node of it computes eager's bits after all (the op is fused then)
_EXCEPT: dict[Any, Callable[[Any], bool]] = {aten.pow: _pow_exponent_is_exact}


def _packet(op: Any) -> Any:
    return getattr(op, "overloadpacket", op)


def eager_rounding(op: Any, node: Optional[Any] = None) -> Optional[str]:
    """Why ``op`` (an overload or packet; ``node`` its FX node, if any) stays an ATen call on the
    C++ path, or None when our kernels compute eager's bits."""
    packet = _packet(op)
    reason = EAGER_ROUNDING.get(packet)
    if reason is None or _EXCEPT.get(packet, lambda _: False)(node):
        return None
    return reason


def chosen_by_config() -> bool:
    """Whether the configuration asks CPU graphs for eager's rounding: C++ code generation on,
    ``cpu_eager_bits`` on, not Triton's interpreter (the compiler also needs a working C++
    compiler: compiler/decompositions.py's ``eager_rounding_active``)."""
    from .config import config

    return config.cpu_eager_bits and config.cpu_codegen and not config.triton_on_cpu


def on_cpu(values: Any) -> bool:
    """Whether the tensors among ``values`` (nested) all live on the CPU, and there is one."""
    tensors = [a for a in torch.utils._pytree.tree_leaves(values) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)
