"""How each ``ops`` instruction is spelled in Triton, keyed by instruction name.

A row is a format string over the operands (``{0}``, ``{1}``), or a function of the operand
strings and the operands' dtype for instructions whose spelling depends on it."""
from __future__ import annotations

from typing import Callable, Union

import torch

TRITON_DTYPE = {
    torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
    torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}


def _float_or_int(float_form: str, int_form: str) -> Callable[[list[str], torch.dtype], str]:
    return lambda args, dtype: (float_form if dtype.is_floating_point else int_form).format(*args)


Spelling = Union[str, Callable[[list[str], torch.dtype], str]]

# instructions whose result has the operands' dtype
ARITHMETIC: dict[str, Spelling] = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "rsub": "{1} - {0}", "mul": "{0} * {1}", "truediv": "{0} / {1}",
    "neg": "-{0}",
    "abs": _float_or_int("tl.abs({0})", "tl.where({0} < 0, -{0}, {0})"),
    "maximum": _float_or_int("tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", "tl.maximum({0}, {1})"),
    "minimum": _float_or_int("tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", "tl.minimum({0}, {1})"),
    "relu": "tl.where({0} < 0, 0, {0})",
    "reciprocal": "1 / {0}",
    "floordiv": _float_or_int("libdevice.floor({0} / {1})", "_floordiv_int({0}, {1})"),
    "truncdiv": _float_or_int("libdevice.trunc({0} / {1})", "_truncdiv_int({0}, {1})"),
    "remainder": _float_or_int("_remainder_float({0}, {1})", "_remainder_int({0}, {1})"),
    "fmod": _float_or_int("libdevice.fmod({0}, {1})", "_fmod_int({0}, {1})"),
    "pow": "libdevice.pow({0}, {1})", "atan2": "libdevice.atan2({0}, {1})",
    "fma": "tl.fma({0}, {1}, {2})",
    "copysign": "libdevice.copysign({0}, {1})", "hypot": "libdevice.hypot({0}, {1})",
    # fmax/fmin ignore a NaN operand (maximum/minimum propagate it)
    "fmax": "tl.where({0} != {0}, {1}, tl.where({1} != {1}, {0}, tl.maximum({0}, {1})))",
    "fmin": "tl.where({0} != {0}, {1}, tl.where({1} != {1}, {0}, tl.minimum({0}, {1})))",
    "sign": "({0} > 0).to({dtype}) - ({0} < 0).to({dtype})",
    "floor": _float_or_int("libdevice.floor({0})", "{0}"), "ceil": _float_or_int("libdevice.ceil({0})", "{0}"),
    "trunc": _float_or_int("libdevice.trunc({0})", "{0}"), "round": _float_or_int("libdevice.nearbyint({0})", "{0}"),
    "bitwise_and": "{0} & {1}", "bitwise_or": "{0} | {1}", "bitwise_xor": "{0} ^ {1}",
    "bitwise_not": lambda args, dtype: f"({args[0]} == 0)" if dtype == torch.bool else f"~{args[0]}",
    "exp": "tl.exp({0})", "exp2": "tl.exp2({0})", "log": "tl.log({0})", "log2": "tl.log2({0})",
    "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})",
    "erf": "tl.erf({0})", "sigmoid": "1 / (1 + tl.exp(-{0}))",
}
for _name in ["expm1", "log10", "log1p", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh",
              "acosh", "atanh", "erfc", "erfinv", "lgamma"]:
    ARITHMETIC[_name] = f"libdevice.{_name}({{0}})"

# instructions whose result is boolean
PREDICATES: dict[str, Spelling] = {
    "eq": "{0} == {1}", "ne": "{0} != {1}", "lt": "{0} < {1}", "le": "{0} <= {1}", "gt": "{0} > {1}",
    "ge": "{0} >= {1}",
    "logical_and": "({0} != 0) & ({1} != 0)", "logical_or": "({0} != 0) | ({1} != 0)",
    "logical_xor": "({0} != 0) ^ ({1} != 0)", "logical_not": "{0} == 0",
    "isnan": _float_or_int("{0} != {0}", "{0} != {0}"),
    "isinf": _float_or_int("tl.abs({0}) == float('inf')", "{0} != {0}"),
    "signbit": _float_or_int("libdevice.signbit({0}) != 0", "{0} < 0"),
}

# reductions (reduction_kinds.py), by their combine instruction: the helper that folds a
# row (``tl.reduce``), one step of a looped accumulator, and argmax/argmin's "replaces the best"
COMBINE_FUNCTION = {"add": "_sum_combine", "mul": "_product", "maximum": "_max_combine", "minimum": "_min_combine"}
ACCUMULATE = {"add": "{a} + {v}", "mul": "{a} * {v}", "maximum": "_max_combine({a}, {v})",
              "minimum": "_min_combine({a}, {v})"}
BEATS = {"maximum": "_beats_for_max", "minimum": "_beats_for_min"}

# helpers every kernel module defines: Python's floor semantics for integer // and %, and the
# reductions' combine functions (tl.sum & co. are @jit functions of triton.language, which the
# interpreter cannot call if triton.language was imported before TRITON_INTERPRET was set)
HELPERS = '''
@triton.jit
def _floordiv_int(a, b):
    quotient = a // b
    return quotient - (((a % b) != 0) & ((a < 0) != (b < 0))).to(quotient.dtype)


@triton.jit
def _truncdiv_int(a, b):
    return a // b


@triton.jit
def _remainder_int(a, b):
    rest = a % b
    return tl.where((rest != 0) & ((rest < 0) != (b < 0)), rest + b, rest)


@triton.jit
def _fmod_int(a, b):
    return a % b


@triton.jit
def _remainder_float(a, b):
    rest = libdevice.fmod(a, b)
    return tl.where((rest != 0) & ((rest < 0) != (b < 0)), rest + b, rest)


@triton.jit
def _product(a, b):
    return a * b


@triton.jit
def _sum_combine(a, b):
    return a + b


# max and min propagate NaN as eager does (a NaN anywhere in a row makes the row's max NaN);
# tl.maximum alone follows the hardware's fmax, which drops it. ``a != a`` is false for integers.
@triton.jit
def _max_combine(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _min_combine(a, b):
    return tl.where((a < b) | (a != a), a, b)


# For argmax/argmin: does ``value`` replace the best so far? Only a strictly better value or
# the first NaN does, so that ties and later NaNs keep the first index (eager's answer).
@triton.jit
def _beats_for_max(value, best):
    return (value > best) | ((value != value) & (best == best))


@triton.jit
def _beats_for_min(value, best):
    return (value < best) | ((value != value) & (best == best))


# the best value found by a max/min reduction: NaN equals NaN here
@triton.jit
def _same_value(a, b):
    return (a == b) | ((a != a) & (b != b))
'''


def spell(table_entry: Spelling, args: list[str], dtype: torch.dtype) -> str:
    if callable(table_entry):
        return table_entry(args, dtype)
    return table_entry.format(*args, dtype=TRITON_DTYPE.get(dtype, "tl.float32"))
