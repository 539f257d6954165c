"""Symbolic sizes: what the compiler knows about a graph's sizes that are not fixed numbers.

A graph traced with dynamic shapes (``torch.compile(..., dynamic=True)``, or Dynamo's
automatic dynamic shapes after a second size) carries sizes as ``torch.SymInt``s over
symbols such as ``s0``. The compiler keeps them as sympy expressions over the same symbols
all the way down: buffer layouts, kernel sizes, index expressions. Three things are needed
besides the expressions themselves, and ``SizeVars`` holds them:

* where each symbol's value comes from at run time (``sources``): an integer input, or a
  size, stride or storage offset of a tensor input; the wrapper reads them once per call::

      primals_4: f32[s0, 32]   ->   s0 = primals_4.size(0)

* a *hint* for each symbol (its value in the example inputs), for decisions that only affect
  speed (block sizes, whether a value is worth a buffer); never for what is computed;
* a check that every expression is one we can print (``+``, ``*``, integer powers, floor
  division, modulo, ``max`` and ``min``); a graph with anything else runs as ATen calls.

Reading a ``SymInt`` as ``int(...)``, comparing two with ``==`` or branching on one would
record a guard in Dynamo's ShapeEnv (and the graph would recompile for every new size), so
nothing here does: sizes are read through ``node.expr``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import sympy
import torch
import torch.fx as fx

from .expr import FloorDiv, ModularIndexing


class UnsupportedSize(Exception):
    """A symbolic size the compiler cannot express (the graph then runs as ATen calls)."""


# the names Dynamo gives size symbols (``s0``, ``s77``), as opposed to the compiler's own index
# variables (``i0``, ``xindex``, ``tmp3``)
SIZE_SYMBOL_NAME = re.compile(r"s\d+")


def is_size_symbol(symbol: sympy.Symbol) -> bool:
    return SIZE_SYMBOL_NAME.fullmatch(symbol.name) is not None


def size_symbols(expr: Any) -> set:
    return {s for s in getattr(expr, "free_symbols", ()) if is_size_symbol(s)}


def to_expr(value: Any) -> Any:
    """An int or SymInt as a sympy expression in the compiler's functions (anything else
    unchanged). Never guards: a SymInt is read through its expression, not its value."""
    if isinstance(value, torch.SymInt):
        return _convert(value.node.expr)
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return sympy.Integer(value)
    return value


def _convert(expr: sympy.Expr) -> sympy.Expr:
    if isinstance(expr, (sympy.Integer, sympy.Symbol)):
        if isinstance(expr, sympy.Symbol) and not is_size_symbol(expr):
            raise UnsupportedSize(f"the size {expr} depends on data (symbol {expr.name})")
        return expr
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        return expr.func(*[_convert(a) for a in expr.args])
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
        return _convert(expr.base) ** expr.exp
    name = type(expr).__name__
    if name in ("FloorDiv", "CleanDiv"):
        return FloorDiv(_convert(expr.args[0]), _convert(expr.args[1]))
    if name == "ModularIndexing":
        return ModularIndexing(*[_convert(a) for a in expr.args])
    if name in ("Max", "Min"):  # (a pooled size: max(1, s0 // 2))
        return (sympy.Max if name == "Max" else sympy.Min)(*[_convert(a) for a in expr.args])
    if name in ("Mod", "PythonMod") and len(expr.args) == 2:
        return ModularIndexing(_convert(expr.args[0]), sympy.Integer(1), _convert(expr.args[1]))
    raise UnsupportedSize(f"the size {expr} uses {name}, which the compiler cannot print")


@dataclasses.dataclass(frozen=True)
class SizeVars:
    """The symbols of one graph: where the wrapper reads each (``sources``: symbol ->
    ``("int", input)``, ``("size", input, dim)``, ``("stride", input, dim)`` or
    ``("offset", input)``) and each one's value in the example inputs (``hints``)."""

    sources: dict
    hints: dict  # symbol name -> example value (by name: a kernel's symbols are re-read from its text)

    @property
    def dynamic(self) -> bool:
        return bool(self.sources)

    def hint(self, expr: Any) -> int:
        """The value of ``expr`` for the example inputs (for heuristics only)."""
        if isinstance(expr, int):
            return expr
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            return int(expr)
        return int(expr.subs({symbol: self.hints[symbol.name] for symbol in expr.free_symbols}))

    def __str__(self) -> str:
        if not self.sources:
            return "static sizes\n"
        return "".join(f"{symbol} = {_describe_source(source)} (hint {self.hints[symbol.name]})\n"
                       for symbol, source in self.sources.items())


STATIC = SizeVars({}, {})


def _describe_source(source: tuple) -> str:
    kind, position = source[0], source[1]
    return {"int": f"input {position}", "size": f"input {position}.size({source[-1]})",
            "stride": f"input {position}.stride({source[-1]})", "offset": f"input {position}.storage_offset()"}[kind]


def size_vars(gm: fx.GraphModule) -> SizeVars:
    """The graph's symbols, where each is read and its hint; raises ``UnsupportedSize`` when a
    size cannot be expressed or a symbol cannot be read from the inputs."""
    sources: dict = {}
    hints: dict = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def offer(value: Any, source: tuple) -> None:
        if isinstance(value, torch.SymInt) and not _is_nested_int(value):
            expr = value.node.expr
            if isinstance(expr, sympy.Symbol) and is_size_symbol(expr) and expr not in sources:
                sources[expr] = source
                hints[expr.name] = _hint(value)

    for position, node in enumerate(placeholders):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                offer(size, ("size", position, dim))
        else:
            offer(val, ("int", position))
    for position, node in enumerate(placeholders):  # strides and offsets only where no size says it
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for dim, stride in enumerate(val.stride()):
                offer(stride, ("stride", position, dim))
            offer(val.storage_offset(), ("offset", position))

    needed: set = set()
    for node in gm.graph.nodes:
        for value in _symbolic_values(node.meta.get("val")):
            needed |= size_symbols(to_expr(value))  # to_expr raises for what cannot be printed
    unbound = needed - set(sources)
    if unbound:
        raise UnsupportedSize(f"the symbols {sorted(map(str, unbound))} cannot be read from the graph's inputs")
    return SizeVars(sources, hints) if sources else STATIC


def _is_nested_int(value: torch.SymInt) -> bool:
    """A jagged nested tensor's ragged size (``j1``), or a symbol standing for one: its value at
    run time is a nested int, not a number, so no kernel size can be read from it. (Dynamo
    passes it to graphs that rebuild nested tensors; the graph's own sizes never use it.)"""
    node = value.node
    return not hasattr(node, "expr") or isinstance(node.hint, torch.SymInt)


def _hint(value: torch.SymInt) -> int:
    hint = value.node.hint
    if hint is None:
        raise UnsupportedSize(f"the size {value.node.expr} has no example value")
    return int(hint)


def _symbolic_values(val: Any) -> list:
    out: list = []
    for leaf in (val if isinstance(val, (list, tuple)) else [val]):
        if isinstance(leaf, torch.SymInt):
            if not _is_nested_int(leaf):  # passed through for the runtime, never a kernel size
                out.append(leaf)
        elif isinstance(leaf, torch.Tensor):
            out += [v for v in (*leaf.shape, *leaf.stride(), leaf.storage_offset()) if isinstance(v, torch.SymInt)]
        elif isinstance(leaf, (torch.SymFloat, torch.SymBool)):
            raise UnsupportedSize(f"a symbolic {type(leaf).__name__} in the graph")
    return out
