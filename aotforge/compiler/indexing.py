"""Index arithmetic in kernel space: every buffer a kernel touches is addressed through the
kernel's two iteration variables, ``xindex`` (over the kernel's outputs) and ``rindex`` (over
the reduced elements of each output)::

    f32[N, D] contiguous in a reduction kernel over (x=N, r=D):  index = rindex + D*xindex
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import sympy

from .expr import FloorDiv, ModularIndexing
from .ir import ReductionBody, product, same_size, strided_index
from .sizes import size_symbols

XINDEX = sympy.Symbol("xindex", integer=True, nonnegative=True)
RINDEX = sympy.Symbol("rindex", integer=True, nonnegative=True)


def split_flat(flat: sympy.Expr, size: Sequence[sympy.Expr]) -> list[sympy.Expr]:
    """Per-dimension indices of ``flat`` in a contiguous tensor of ``size`` (``flat`` is known
    to be in range, so the outermost dimension needs no modulo)."""
    out: list[sympy.Expr] = []
    divisor = sympy.Integer(1)
    real = [d for d in range(len(size)) if size[d] != 1]
    for d in reversed(range(len(size))):
        if size[d] == 1:
            out.append(sympy.Integer(0))
            continue
        if d == real[0]:
            out.append(FloorDiv(flat, divisor))
        else:
            out.append(ModularIndexing(flat, divisor, size[d]))
        divisor = divisor * size[d]
    return list(reversed(out))


@functools.lru_cache(maxsize=65536)
def simplify_index(expr: sympy.Expr) -> sympy.Expr:
    """Fold the pieces that ``split_flat`` produced back together where a contiguous access
    recombines them: ``m*FloorDiv(a, d*m) + ModularIndexing(a, d, m) -> FloorDiv(a, d)`` and
    ``m*ModularIndexing(a, d*m, M) + ModularIndexing(a, d, m) -> ModularIndexing(a, d, m*M)``."""
    expr = sympy.expand(_divisors_are_positive(_simplify_arguments(expr)))
    changed = True
    while changed:
        changed = False
        terms = [_split_term(t) for t in sympy.Add.make_args(expr)]
        for i, (c_low, low) in enumerate(terms):
            if not isinstance(low, ModularIndexing):
                continue
            base, divisor, modulus = low.args
            for j, (c_high, high) in enumerate(terms):
                if j == i or not same_size(c_high, c_low * modulus):
                    continue
                if isinstance(high, FloorDiv) and high.args == (base, divisor * modulus):
                    merged = c_low * FloorDiv(base, divisor)
                elif isinstance(high, ModularIndexing) and high.args[:2] == (base, divisor * modulus):
                    merged = c_low * ModularIndexing(base, divisor, modulus * high.args[2])
                else:
                    continue
                rest = [c * t for k, (c, t) in enumerate(terms) if k not in (i, j)]
                expr = sympy.expand(sympy.Add(*rest) + merged)
                changed = True
                break
            if changed:
                break
    return expr


def _divisors_are_positive(expr: sympy.Expr) -> sympy.Expr:
    """``Max(1, m) -> m`` for each ``m`` the index divides by (a factor of a divisor or modulus):
    the index is only computed where that division is defined, so ``m >= 1`` there. A contiguous
    layout's strides over symbolic sizes are ``Max(1, size)`` (torch's), which kept
    ``(r / h)*Max(1, h) + r % h`` from folding into ``r`` (two divisions per element of the conv
    net's ReLU + mean under symbolic sizes)."""
    maxima = [m for m in expr.atoms(sympy.Max) if len(m.args) == 2 and sympy.Integer(1) in m.args]
    if not maxima:
        return expr
    divisors = set()
    for atom in expr.atoms(FloorDiv, ModularIndexing):
        for bound in atom.args[1:]:
            divisors.update(f.base if f.is_Pow else f for f in sympy.Mul.make_args(bound))
    replacements = {m: other for m in maxima for other in m.args if other != 1 and other in divisors}
    return expr.xreplace(replacements) if replacements else expr


def _split_term(term: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """(coefficient, factor) of a product, the factor being its one integer-division factor
    when it has one (``32*s0*FloorDiv(x, s0)`` -> ``(32*s0, FloorDiv(x, s0))``), so that
    symbolic coefficients match as numbers do. A size's own division (``FloorDiv(s0, 4)``, a
    pooled image's side) is part of the coefficient: counted as a second division factor, it
    left ``128*h*(rindex / h) + 128*(rindex % h)`` unmerged, two divisions per element of the
    conv net's global mean under symbolic sizes."""
    factors = sympy.Mul.make_args(term)
    divisions = [f for f in factors if isinstance(f, (FloorDiv, ModularIndexing)) and not size_symbols(f) >= f.free_symbols]
    if len(divisions) != 1:
        return term.as_coeff_Mul()
    return sympy.Mul(*[f for f in factors if f is not divisions[0]]), divisions[0]


def _simplify_arguments(expr: sympy.Expr) -> sympy.Expr:
    if isinstance(expr, (FloorDiv, ModularIndexing)):
        return expr.func(*[simplify_index(a) for a in expr.args])
    if expr.args and isinstance(expr, (sympy.Add, sympy.Mul)):
        return expr.func(*[_simplify_arguments(a) for a in expr.args])
    return expr


def node_indices(buffer, numel: Any, rnumel: Any) -> Optional[tuple[list, list]]:
    """(index, reduction index) of a computed buffer's body in a kernel over (numel, rnumel),
    or None when the buffer's iteration space does not fit the kernel's (sizes may be
    symbolic: they fit when equal for every value of the symbols)."""
    body = buffer.body
    if isinstance(body, ReductionBody):
        if not same_size(product(body.ranges), numel) or not same_size(product(body.reduction_ranges), rnumel):
            return None
        return split_flat(XINDEX, body.ranges), split_flat(RINDEX, body.reduction_ranges)
    ranges = body.ranges
    total = product(ranges)
    if rnumel == 1 or same_size(total, numel):
        return (split_flat(XINDEX, ranges), []) if same_size(total, numel) else None
    if not same_size(total, numel * rnumel):
        return None
    running = sympy.Integer(1)
    for split in range(len(ranges) + 1):
        if same_size(running, numel) and same_size(product(ranges[split:]), rnumel):
            return split_flat(XINDEX, ranges[:split]) + split_flat(RINDEX, ranges[split:]), []
        if split < len(ranges):
            running = running * ranges[split]
    return None


def store_index(buffer, index: Sequence[sympy.Expr]) -> sympy.Expr:
    layout = buffer.layout
    return simplify_index(strided_index(index, layout.stride, layout.offset))


def is_per_element(buffer) -> bool:
    """Pointwise buffers that vary along the reduction axis (vs. one value per output row)."""
    return not isinstance(buffer.body, ReductionBody)

