"""Integer index arithmetic: two sympy functions that keep integer division readable and
comparable in index expressions, ``FloorDiv(a, b)`` and ``ModularIndexing(a, d, m)``
(``(a // d) % m``). They simplify as they are built: ``FloorDiv(8*i + r, 8)`` is
``i + FloorDiv(r, 8)``; ``ModularIndexing(i + 64*j, 1, 64)`` is ``ModularIndexing(i, 1, 64)``.
"""
from __future__ import annotations

import sympy

Expr = sympy.Expr


class FloorDiv(sympy.Function):
    """``a // b`` for non-negative integer index expressions."""

    is_integer = True
    nargs = (2,)

    @classmethod
    def eval(cls, base, divisor):
        if divisor == 1:
            return base
        if base == 0:
            return sympy.Integer(0)
        if base.is_Integer and divisor.is_Integer:
            return sympy.Integer(int(base) // int(divisor))
        if isinstance(base, FloorDiv):  # (a // b) // c == a // (b*c)
            return FloorDiv(base.args[0], base.args[1] * divisor)
        # (c*k + r) // k == c + r // k when k divides c (k may be symbolic: s0*32)
        if base.is_Add:
            whole = [t for t in base.args if _divides(divisor, t)]
            if whole:
                rest = [t for t in base.args if not _divides(divisor, t)]
                return sympy.Add(*[t / divisor for t in whole]) + FloorDiv(sympy.Add(*rest), divisor)
        if base.is_Mul and _divides(divisor, base):
            return base / divisor
        # ((a // d) % m) // k == (a // (d*k)) % (m // k) when k divides m
        if isinstance(base, ModularIndexing) and divisor.is_Integer and base.args[2].is_Integer \
                and int(base.args[2]) % int(divisor) == 0:
            a, d, m = base.args
            return ModularIndexing(a, d * divisor, m / divisor)
        return None


def _divides(divisor: Expr, term: Expr) -> bool:
    """Whether ``term / divisor`` is a product with integer coefficient (no division left)."""
    if divisor.is_Integer:
        coefficient = term.as_coeff_Mul()[0]
        return coefficient.is_Integer and int(coefficient) % int(divisor) == 0
    quotient = term / divisor
    numerator, denominator = sympy.fraction(quotient)
    return denominator == 1 and quotient.as_coeff_Mul()[0].is_Integer


class ModularIndexing(sympy.Function):
    """``(a // d) % m`` for non-negative integer index expressions."""

    is_integer = True
    nargs = (3,)

    @classmethod
    def eval(cls, base, divisor, modulus):
        if modulus == 1 or base == 0:
            return sympy.Integer(0)
        if base.is_Integer and divisor.is_Integer and modulus.is_Integer:
            return sympy.Integer((int(base) // int(divisor)) % int(modulus))
        # ((a // b) // d) % m == (a // (b*d)) % m: one form, so that simplify_index can merge
        # the pieces of a view's index back together (BERT's softmax backward read its row sums
        # through 6144*FloorDiv(i, 12) + 512*ModularIndexing(i, 1, 12) with i = xindex // 512,
        # which is 512*i: unmerged, the fusion pass took it for another element)
        if isinstance(base, FloorDiv):
            return ModularIndexing(base.args[0], base.args[1] * divisor, modulus)
        # whole multiples of divisor*modulus never change the result
        if base.is_Add:
            period = divisor * modulus
            kept = [t for t in base.args if not _divides(period, t)]
            if len(kept) < len(base.args):
                return ModularIndexing(sympy.Add(*kept), divisor, modulus)
        return None
