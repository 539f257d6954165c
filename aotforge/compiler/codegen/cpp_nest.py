"""A pointwise C++ kernel over symbolic sizes as a nest of loops, one per dimension its indices
split ``xindex`` into, so that no element divides by a size.

A kernel compiled for symbolic sizes addresses a channels-last image walked in NCHW order as
``ptr0[32*(xindex % (s*s)) + 32*s*s*(xindex / (32*s*s)) + ((xindex / (s*s)) % 32)]``: three
64-bit divisions by sizes GCC does not know, per element, and no vectorization. With constant
sizes GCC turns such divisions into multiplications and ``_rows_of`` (cpp.py) into loops; with
symbolic ones they stay. Here the divisors and moduli of ``xindex`` (``s*s`` and ``32*s*s``)
are the bounds of the dimensions of a mixed-radix number, ``xindex = x0 + s*s*x1 + 32*s*s*x2``
(x0 < s*s, x1 < 32), and each division of ``xindex`` is a sum of those counters
(``xindex / (s*s) % 32`` is ``x1``). The loops nest outermost first, except that the counter
most indices step by one (the stores' first) runs innermost, so that its loop is contiguous and
vectorizes: the conv net's in-place ReLU over 1M channels-last floats becomes a loop over
channels. The conv net's inference step under symbolic sizes went 57 -> 28 ms (static sizes:
20 ms; with cpp_nest and indexing.py's folding of symbolic strides, one thread, one process).

Only where every division of the kernel's indices is of ``xindex`` itself and the bounds
divide one another (a chain, as ``split_flat`` makes them); else the kernel keeps its one loop.
Reordering the elements is as safe as the kernel's ``parallel for``: each element is
independent (a read of a buffer the kernel writes is of the element the same iteration writes).
"""
from __future__ import annotations

from typing import Any, Optional

import sympy

from ..expr import FloorDiv, ModularIndexing
from ..indexing import XINDEX
from ..sizes import is_size_symbol
from .kernel import print_index


def _divides(small: sympy.Expr, large: sympy.Expr) -> bool:
    """Whether ``large / small`` is a whole number for every value of the sizes: a product of
    sizes and a positive integer (``32*s*s / (s*s)``)."""
    ratio = sympy.cancel(large / small)
    numerator, denominator = sympy.fraction(ratio)
    if denominator != 1:
        return False
    coefficient, rest = numerator.as_coeff_Mul()
    return coefficient.is_Integer and coefficient > 0 and all(
        _is_size(f.base if f.is_Pow and f.exp.is_Integer and f.exp > 0 else f) for f in sympy.Mul.make_args(rest) if f != 1)


def _is_size(factor: sympy.Expr) -> bool:
    """A size symbol, or a size divided by a constant (a pooled side ``s // 2``)."""
    if isinstance(factor, FloorDiv):
        return factor.args[1].is_Integer and _is_size(factor.args[0])
    return factor.is_Symbol and is_size_symbol(factor)


def _bounds(indices: list[sympy.Expr], numel: sympy.Expr) -> Optional[list[sympy.Expr]]:
    """The chain ``1 | b1 | b2 | ... | numel`` of the points where the kernel's indices split
    ``xindex``, or None when they do not form one (or use ``xindex`` otherwise)."""
    points: set = set()
    for index in indices:
        for atom in index.atoms(FloorDiv, ModularIndexing):
            if XINDEX not in atom.free_symbols:
                continue
            if atom.args[0] != XINDEX:
                return None  # (``(xindex + 1) / 2``: a pooling's window)
            if isinstance(atom, FloorDiv):
                points.add(atom.args[1])
            else:
                points.update((atom.args[1], atom.args[1] * atom.args[2]))
    # (a division by the whole size is 0, a remainder by it the index: no dimension of their own)
    points = {sympy.expand(p) for p in points} - {sympy.Integer(1), sympy.expand(numel)}
    if not any(p.free_symbols for p in points):
        return None  # constant divisors: _rows_of's rows (cpp.py) and GCC's own division by constants
    chain = [sympy.Integer(1)]
    while points:
        smallest = [p for p in points if all(_divides(p, q) for q in points)]
        if not smallest or not _divides(chain[-1], smallest[0]):
            return None
        chain.append(smallest[0])
        points.discard(smallest[0])
    return chain if _divides(chain[-1], numel) else None


def _counters(index: sympy.Expr, chain: list, counters: list) -> sympy.Expr:
    """``index`` with each division of ``xindex`` written as a sum of the nest's counters (a
    bound not in the chain is the kernel's size: past the last counter)."""
    position = {bound: level for level, bound in enumerate(chain)}

    def span(low: int, high: Optional[int]) -> sympy.Expr:  # xindex's digits low..high, as a number
        top = len(counters) if high is None else high
        return sympy.Add(*[counters[level] * sympy.cancel(chain[level] / chain[low]) for level in range(low, top)])

    replacements = {}
    for atom in index.atoms(FloorDiv, ModularIndexing):
        if atom.args[0] != XINDEX:
            continue
        low = position.get(sympy.expand(atom.args[1]), len(chain))
        if isinstance(atom, FloorDiv):
            replacements[atom] = span(low, None)
        else:
            high = sympy.expand(atom.args[1] * atom.args[2])
            replacements[atom] = span(low, position.get(high, len(chain)))
    return sympy.expand(index.xreplace(replacements))


def loop_nest(lines: list[str], printed: dict[str, sympy.Expr], numel: Any, prologue: list[str],
              epilogue: list[str], parallel: str) -> Optional[list[str]]:
    """The pointwise kernel's ``lines`` as a loop nest (see the module's docstring), or None.
    ``printed`` maps each index text the printer wrote to its expression."""
    numel = sympy.sympify(numel)
    if numel.is_Integer:
        return None  # (static kernels keep their own forms)
    text = "\n".join(lines)
    uses = {t: e for t, e in printed.items() if XINDEX in e.free_symbols and e.atoms(FloorDiv, ModularIndexing) and t in text}
    chain = _bounds(list(uses.values()), numel) if uses else None
    if chain is None:
        return None
    extents = [sympy.cancel(chain[level + 1] / chain[level]) for level in range(len(chain) - 1)]
    extents.append(sympy.cancel(numel / chain[-1]))
    counters = [sympy.Symbol(f"x{level}", integer=True, nonnegative=True) for level in range(len(chain))]
    flat = sympy.expand(sum(c * b for c, b in zip(counters, chain)))
    rewritten = {t: _counters(e, chain, counters) for t, e in uses.items()}
    # innermost: the counter most indices of whole tensors step by one (stores count twice:
    # GCC vectorizes a strided load as a gather, never a strided store); ``ptr[xindex]`` steps
    # by one in x0. A broadcast operand's index (``w[x1]``, a channel's) is not counted: its
    # loads are loop-invariant when its counter is outer.
    score = [0] * len(counters)
    for t, e in printed.items():
        if XINDEX not in e.free_symbols or t not in text:
            continue
        e = sympy.expand(_counters(e, chain, counters).xreplace({XINDEX: flat}))
        if not e.free_symbols >= set(counters):
            continue
        weight = 2 if any(f"[{t}] =" in line for line in lines) else 1
        for level, counter in enumerate(counters):
            if e.coeff(counter) == 1:
                score[level] += weight
    inner = max(range(len(counters)), key=lambda level: (score[level], -level))
    order = [level for level in reversed(range(len(counters))) if level != inner] + [inner]
    for t in sorted(rewritten, key=len, reverse=True):  # (longest first: one text may hold another)
        text = text.replace(t, print_index(rewritten[t], "/"))
    if "xindex /" in text or "xindex %" in text:
        return None
    # the loops around the innermost share the threads (collapsed: a batch of 1 still has work
    # for each); GCC steps collapsed counters by carries, dividing only at each thread's start
    collapse = f" collapse({len(order) - 1})" if len(order) > 2 else ""
    out = list(prologue) + ["    " + parallel.replace("parallel for", "parallel for" + collapse, 1)]
    indent = "    "
    for level in order:
        out.append(f"{indent}for (int64_t x{level} = 0; x{level} < {print_index(extents[level], '/')}; ++x{level}) {{")
        indent += "    "
    out += [f"{indent}const int64_t xindex = {print_index(flat, '/')};", f"{indent}constexpr bool xmask = true;"]
    out += [indent + line for line in text.split("\n")]
    for level in range(len(order)):
        indent = indent[:-4]
        out.append(f"{indent}}}")
    return out + list(epilogue)
