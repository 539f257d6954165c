"""Comparisons of sizes, strides and scalars that never add a guard.

With dynamic shapes a FakeTensor's sizes and strides are ``torch.SymInt``. Turning a
comparison of them into a Python bool (``if a == b``, ``tuple != tuple``, ``x.numel() > n``)
asks the ShapeEnv, which answers from the example sizes and records a guard (or replaces a
symbol by a constant): Dynamo then recompiles whenever an input breaks the guard, and a graph
compiled for "s0 != 32" is not the graph for every s0. A pass must only rewrite what is true
for every value of the symbols, so these helpers answer True only when that is statically
known and False ("not known") otherwise; callers treat False as "keep the node"::

    statically_equal(s0, s0)            -> True       (same expression)
    statically_equal(s0 * 32, 32 * s0)  -> True
    statically_equal(s0, 32)            -> False      (true for one s0 only: not known)
    known_true(s0 >= 1)                 -> True       (the ShapeEnv's range for s0 is [2, oo])
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_NUMBER = (int, float, bool) + _SYMBOLIC


def is_symbolic(value: Any) -> bool:
    return isinstance(value, _SYMBOLIC)


def known_true(condition: Any) -> bool:
    """``condition`` (a bool or a SymBool built from SymInts, e.g. ``n <= 4096``) when it holds
    for every value of its symbols; False when that is not known. Records no guard."""
    if isinstance(condition, torch.SymBool):
        return statically_known_true(condition)  # simplifies with the ShapeEnv's ranges only
    return bool(condition)


def sym_expr(value: Any) -> Any:
    """The sympy expression of a SymInt/SymFloat/SymBool, or None (nested ints have none)."""
    return getattr(getattr(value, "node", None), "expr", None) if is_symbolic(value) else None


def statically_equal(a: Any, b: Any) -> bool:
    """``a == b`` for numbers, SymInts and sequences of them (``torch.Size``, strides), True only
    when it holds for every value of the symbols. Records no guard."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(statically_equal(x, y) for x, y in zip(a, b)))
    if not (is_symbolic(a) or is_symbolic(b)):
        return bool(a == b)
    expr_a, expr_b = sym_expr(a), sym_expr(b)
    if expr_a is not None and expr_a == expr_b:
        return True  # sympy's == is structural: the same expression, whatever the sizes
    if not (isinstance(a, _NUMBER) and isinstance(b, _NUMBER)):
        return False
    return known_true(a == b)  # a SymBool; building it asks nothing of the ShapeEnv
