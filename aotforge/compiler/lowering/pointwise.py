"""Lowerings of elementwise ATen ops: one table row per op."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..dtypes import compute_dtype
from ..ir import Pointwise, StorageView, Value, same_size, sympify_size
from ..ops import ops
from .registry import LoweringContext, NotLowerable, broadcast_loader, broadcast_shapes, promoted_dtype, register

aten = torch.ops.aten
prims = torch.ops.prims


def make_pointwise(op_name: str, kind: str = "DEFAULT", *, float_only: bool = False) -> Callable:
    """A lowering that applies ``ops.<op_name>`` elementwise with torch's broadcasting and
    type promotion. ``kind`` names the ELEMENTWISE_TYPE_PROMOTION_KIND."""

    def lower(ctx: LoweringContext, *args: Any) -> Value:
        tensors = [a for a in args if isinstance(a, Value)]
        if not tensors:
            raise NotLowerable("a pointwise op needs a tensor operand")
        compute, result = promoted_dtype(*args, kind=kind)
        result = ctx.result_dtype(result)
        compute = compute_dtype(compute)
        if float_only and not compute.is_floating_point:
            raise NotLowerable(f"{op_name} of {compute}")
        size = broadcast_shapes(*[a.size for a in tensors])
        loaders = [broadcast_loader(a, size, compute) for a in args]

        def fn(index):
            value = getattr(ops, op_name)(*[load(index) for load in loaders])
            out_dtype = torch.bool if kind == "ALWAYS_BOOL" else compute
            return ops.to_dtype(value, result, out_dtype) if out_dtype != result else value
        return Pointwise(size, result, ctx.device(*args), fn)
    return lower


# ATen op -> (ops name, promotion kind)
POINTWISE_TABLE: dict[Any, tuple[str, str]] = {
    aten.add.Tensor: ("add", "DEFAULT"), aten.add.Scalar: ("add", "DEFAULT"),
    aten.sub.Tensor: ("sub", "DEFAULT"), aten.sub.Scalar: ("sub", "DEFAULT"),
    aten.rsub.Scalar: ("rsub", "DEFAULT"), aten.rsub.Tensor: ("rsub", "DEFAULT"),
    aten.mul.Tensor: ("mul", "DEFAULT"), aten.mul.Scalar: ("mul", "DEFAULT"),
    aten.div.Tensor: ("truediv", "INT_TO_FLOAT"), aten.div.Scalar: ("truediv", "INT_TO_FLOAT"),
    aten.neg.default: ("neg", "DEFAULT"), aten.abs.default: ("abs", "DEFAULT"),
    aten.maximum.default: ("maximum", "DEFAULT"), aten.minimum.default: ("minimum", "DEFAULT"),
    aten.atan2.default: ("atan2", "INT_TO_FLOAT"),
    aten.copysign.Tensor: ("copysign", "INT_TO_FLOAT"), aten.copysign.Scalar: ("copysign", "INT_TO_FLOAT"),
    aten.hypot.default: ("hypot", "DEFAULT"),
    aten.fmax.default: ("fmax", "DEFAULT"), aten.fmin.default: ("fmin", "DEFAULT"),
    aten.pow.Tensor_Tensor: ("pow", "BOOL_TO_LONG"), aten.pow.Scalar: ("pow", "BOOL_TO_LONG"),
    aten.sign.default: ("sign", "DEFAULT"), aten.sgn.default: ("sign", "DEFAULT"),
    aten.floor.default: ("floor", "DEFAULT"), aten.ceil.default: ("ceil", "DEFAULT"),
    aten.trunc.default: ("trunc", "DEFAULT"), aten.round.default: ("round", "DEFAULT"),
    aten.reciprocal.default: ("reciprocal", "INT_TO_FLOAT"),
    aten.relu.default: ("relu", "DEFAULT"),
    aten.bitwise_not.default: ("bitwise_not", "DEFAULT"),
    aten.bitwise_and.Tensor: ("bitwise_and", "DEFAULT"), aten.bitwise_and.Scalar: ("bitwise_and", "DEFAULT"),
    aten.bitwise_or.Tensor: ("bitwise_or", "DEFAULT"), aten.bitwise_or.Scalar: ("bitwise_or", "DEFAULT"),
    aten.bitwise_xor.Tensor: ("bitwise_xor", "DEFAULT"), aten.bitwise_xor.Scalar: ("bitwise_xor", "DEFAULT"),
    aten.eq.Tensor: ("eq", "ALWAYS_BOOL"), aten.eq.Scalar: ("eq", "ALWAYS_BOOL"),
    aten.ne.Tensor: ("ne", "ALWAYS_BOOL"), aten.ne.Scalar: ("ne", "ALWAYS_BOOL"),
    aten.lt.Tensor: ("lt", "ALWAYS_BOOL"), aten.lt.Scalar: ("lt", "ALWAYS_BOOL"),
    aten.le.Tensor: ("le", "ALWAYS_BOOL"), aten.le.Scalar: ("le", "ALWAYS_BOOL"),
    aten.gt.Tensor: ("gt", "ALWAYS_BOOL"), aten.gt.Scalar: ("gt", "ALWAYS_BOOL"),
    aten.ge.Tensor: ("ge", "ALWAYS_BOOL"), aten.ge.Scalar: ("ge", "ALWAYS_BOOL"),
    aten.logical_and.default: ("logical_and", "ALWAYS_BOOL"), aten.logical_or.default: ("logical_or", "ALWAYS_BOOL"),
    aten.logical_xor.default: ("logical_xor", "ALWAYS_BOOL"), aten.logical_not.default: ("logical_not", "ALWAYS_BOOL"),
    aten.isnan.default: ("isnan", "ALWAYS_BOOL"), aten.isinf.default: ("isinf", "ALWAYS_BOOL"),
    aten.signbit.default: ("signbit", "ALWAYS_BOOL"),
}

# float functions (integer inputs are promoted to the default float dtype)
UNARY_FLOAT_FUNCTIONS = [
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv",
    "sigmoid", "lgamma",
]
for _name in UNARY_FLOAT_FUNCTIONS:
    POINTWISE_TABLE[getattr(aten, _name).default] = (_name, "INT_TO_FLOAT")

for _op, (_name, _kind) in POINTWISE_TABLE.items():
    register(_op)(make_pointwise(_name, _kind))


@register(aten.add.Tensor, aten.add.Scalar, name="add")
@register(aten.sub.Tensor, aten.sub.Scalar, name="sub")
def add_or_sub(ctx: LoweringContext, a: Any, b: Any, alpha: Any = 1, *, name: str) -> Value:
    """``a + alpha * b``: alpha folds into the second operand."""
    if alpha != 1:
        b = make_pointwise("mul")(ctx, b, alpha)
    return make_pointwise(name)(ctx, a, b)


@register(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(ctx: LoweringContext, base: Value, exponent: Any) -> Value:
    """Small integer powers become multiplications (exact, and faster than pow)."""
    if isinstance(exponent, (int, float)) and float(exponent).is_integer() and 0 <= exponent <= 4:
        result = ctx.result_dtype(base.dtype)
        compute = compute_dtype(result)
        load = broadcast_loader(base, base.size, compute)

        def fn(index):
            x = load(index)
            value = ops.constant(1, compute) if exponent == 0 else x
            for _ in range(int(exponent) - 1):
                value = ops.mul(value, x)
            return ops.to_dtype(value, result, compute) if compute != result else value
        return Pointwise(base.size, result, base.device, fn)
    if isinstance(exponent, (int, float)) and float(exponent) == 0.5:
        return make_pointwise("sqrt", "INT_TO_FLOAT")(ctx, base)
    return make_pointwise("pow", "BOOL_TO_LONG")(ctx, base, exponent)


def integer_division(op_name: str) -> Callable:
    """``//``, ``%`` and ``fmod``: integer division by zero raises in eager (ZeroDivisionError
    on the CPU), which a kernel cannot do. So integer division is lowered only by a non-zero
    constant divisor (``i // 4``, ``i % 3``: index arithmetic, kept fused); by a tensor it
    runs as the ATen call, which raises exactly as eager does."""
    pointwise = make_pointwise(op_name)

    def lower(ctx: LoweringContext, a: Any, b: Any) -> Value:
        compute, _ = promoted_dtype(a, b)
        if not compute.is_floating_point and (isinstance(b, Value) or b == 0):
            raise NotLowerable(f"integer {op_name} by a divisor that may be zero")
        return pointwise(ctx, a, b)
    return lower


for _op, _name in [(aten.remainder.Tensor, "remainder"), (aten.remainder.Scalar, "remainder"),
                   (aten.fmod.Tensor, "fmod"), (aten.fmod.Scalar, "fmod"),
                   (aten.floor_divide.default, "floordiv"), (aten.floor_divide.Scalar, "floordiv")]:
    register(_op)(integer_division(_name))


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(ctx: LoweringContext, a: Any, b: Any, *, rounding_mode: Any = None) -> Value:
    if rounding_mode is None:
        return make_pointwise("truediv", "INT_TO_FLOAT")(ctx, a, b)
    if rounding_mode == "floor":
        return integer_division("floordiv")(ctx, a, b)
    if rounding_mode == "trunc":
        return integer_division("truncdiv")(ctx, a, b)
    raise NotLowerable(f"rounding_mode={rounding_mode!r}")


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(ctx: LoweringContext, condition: Any, a: Any, b: Any) -> Value:
    compute, result = promoted_dtype(a, b)
    result = ctx.result_dtype(result)
    tensors = [v for v in (condition, a, b) if isinstance(v, Value)]
    size = broadcast_shapes(*[t.size for t in tensors])
    load_condition = broadcast_loader(condition, size, torch.bool)
    load_a, load_b = broadcast_loader(a, size, result), broadcast_loader(b, size, result)
    return Pointwise(size, result, ctx.device(condition, a, b),
                     lambda index: ops.where(load_condition(index), load_a(index), load_b(index)))


@register(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(ctx: LoweringContext, x: Value, high: Any) -> Value:
    return clamp(ctx, x, None, high)


@register(aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp(ctx: LoweringContext, x: Value, low: Any = None, high: Any = None) -> Value:
    result = ctx.result_dtype(x.dtype)
    if isinstance(low, Value) or isinstance(high, Value):
        out = x
        if low is not None:
            out = make_pointwise("maximum")(ctx, out, low)
        if high is not None:
            out = make_pointwise("minimum")(ctx, out, high)
        return out
    compute = compute_dtype(result)
    load = broadcast_loader(x, x.size, compute)

    def fn(index):
        value = load(index)
        if low is not None:
            value = ops.maximum(value, ops.constant(low, compute))
        if high is not None:
            value = ops.minimum(value, ops.constant(high, compute))
        return ops.to_dtype(value, result, compute) if compute != result else value
    return Pointwise(x.size, result, x.device, fn)


def _cast(x: Value, dtype: torch.dtype) -> Value:
    load, source = x.make_loader(), x.dtype
    if dtype == source:
        return Pointwise(x.size, dtype, x.device, load)
    return Pointwise(x.size, dtype, x.device, lambda index: ops.to_dtype(load(index), dtype, source))


@register(prims.convert_element_type.default)
def convert_element_type(ctx: LoweringContext, x: Value, dtype: torch.dtype) -> Value:
    return _cast(x, dtype)


@register(aten._to_copy.default)
def to_copy(ctx: LoweringContext, x: Value, *, dtype: Any = None, layout: Any = None, device: Any = None,
            pin_memory: Any = None, non_blocking: bool = False, memory_format: Any = None) -> Value:
    if device is not None and torch.device(device) != x.device:
        raise NotLowerable("device copies run as ATen calls")
    return _cast(x, dtype or x.dtype)


@register(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default)
def clone(ctx: LoweringContext, x: Value, *, memory_format: Any = None) -> Value:
    """A functional graph never observes the difference between a value and its copy, so a
    clone costs nothing until something realizes it. Its layout is observable, though: a
    clone of a view with other strides (``x.unsqueeze(2).expand(...).clone()``, stride 0)
    becomes a lazy copy, which a graph output realizes with eager's strides."""
    val = ctx.value
    if isinstance(x, StorageView) and isinstance(val, torch.Tensor) and len(val.shape) == len(x.size):
        expected = sympify_size(val.stride())  # expressions: comparing them adds no guard
        if not all(n == 1 or same_size(s, e) for n, s, e in zip(x.size, x.stride, expected)):
            return Pointwise(x.size, x.dtype, x.device, x.make_loader())
    return x


@register(aten.copy.default)
def copy(ctx: LoweringContext, destination: Value, source: Value, non_blocking: bool = False) -> Value:
    return _cast(Pointwise(destination.size, source.dtype, destination.device,
                           broadcast_loader(source, destination.size, source.dtype)), destination.dtype)


@register(aten.addcmul.default)
def addcmul(ctx: LoweringContext, x: Value, tensor1: Value, tensor2: Value, *, value: Any = 1) -> Value:
    """Eager's rounding, bit for bit: ATen's kernels compute ``x + value * t1 * t2``, which their
    compilers contract to fma(value * t1, t2, x) (measured on the CPU: every element). AdamW's
    second moment is an addcmul (issue 37)."""
    scaled = make_pointwise("mul")(ctx, value, tensor1)
    if not promoted_dtype(x, tensor1, tensor2, kind="DEFAULT")[0].is_floating_point:
        return make_pointwise("add")(ctx, x, make_pointwise("mul")(ctx, scaled, tensor2))  # (exact)
    return make_pointwise("fma")(ctx, scaled, tensor2, x)


@register(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(ctx: LoweringContext, start: Value, end: Value, weight: Any) -> Value:
    """Eager's formula (ATen's lerp_vec, CPU; Lerp.h contracted on CUDA), bit for bit: from the
    nearer end, fma(weight, end - start, start) for |weight| < 0.5, else fma(weight - 1,
    end - start, end). AdamW's moving average is a lerp: a * b + c rounded twice drifted a
    compiled training loop off eager's bits (issue 37)."""
    difference = make_pointwise("sub")(ctx, end, start)
    if not isinstance(weight, Value):
        # (the weight as eager holds it: in the tensors' dtype, then weight - 1 in their math's)
        held = torch.tensor(weight, dtype=start.dtype).to(compute_dtype(start.dtype))
        small = bool(held.abs() < 0.5)
        coefficient = (held if small else held - 1).item()
        return make_pointwise("fma")(ctx, coefficient, difference, start if small else end)
    small = make_pointwise("lt", "ALWAYS_BOOL")(ctx, make_pointwise("abs")(ctx, weight), 0.5)
    coefficient = where(ctx, small, weight, make_pointwise("sub")(ctx, weight, 1))
    return make_pointwise("fma")(ctx, coefficient, difference, where(ctx, small, start, end))


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(ctx: LoweringContext, x: Value, mask: Value, value: Any) -> Value:
    if isinstance(value, Value):
        value = _cast(value, x.dtype)
    return where(ctx, mask, value, x)
