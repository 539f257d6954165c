"""Runtime checks that keep an exported graph from computing a wrong answer silently.

An exported graph is traced once, for example inputs. Whatever the trace assumed about its
inputs becomes ``torch._assert`` nodes at the top of the graph, so that a call outside those
assumptions fails with a message instead of broadcasting or reshaping into a wrong result:

* non-tensor inputs (ints, floats, strings) were specialized to their values::

      eq = primals_3 == 2
      _assert = torch._assert(eq, "this graph was exported with user input args[1] == 2; ...")

* with dynamic shapes, the sizes the trace had to fix or relate (a feature size a weight
  fixes to 16, two batch sizes that must be equal, a size that must exceed 1), and what
  the forward checked about values it read with ``.item()`` to use as sizes::

      sym_size_int = torch.ops.aten.sym_size.int(primals_10, 1)
      eq_1 = sym_size_int == 16
      _assert_1 = torch._assert(eq_1, "user input args[0]: size 1 must be 16 ...")

The checks are plain FX nodes (operator comparisons, ``aten.sym_size``, ``torch._assert``),
so they print as Python, survive saving and reloading, and run wherever the graph runs.
"""
from __future__ import annotations

import operator
from typing import Callable, Sequence

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

from .export_errors import ExportError

# How each sympy node of a shape guard is computed in Python, keyed by its sympy class.
# Sums and products are folded pairwise.
SYMPY_OPERATORS: dict[type, Callable] = {
    sympy.Add: operator.add,
    sympy.Mul: operator.mul,
    sympy.Eq: operator.eq,
    sympy.Ne: operator.ne,
    sympy.StrictLessThan: operator.lt,
    sympy.LessThan: operator.le,
    sympy.StrictGreaterThan: operator.gt,
    sympy.GreaterThan: operator.ge,
    sympy.And: operator.and_,
    sympy.Or: operator.or_,
    sympy.Not: operator.not_,
    FloorDiv: operator.floordiv,
    Mod: operator.mod,
    PythonMod: operator.mod,
}


class _Emitter:
    """Appends nodes one after another right after the graph's placeholders."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        placeholders = graph.find_nodes(op="placeholder")
        # A graph without inputs (a module called with no arguments) starts at its top.
        self.cursor = placeholders[-1] if placeholders else None

    def call(self, target, args: tuple) -> fx.Node:
        where = self.graph.inserting_after(self.cursor) if self.cursor is not None else self.graph.inserting_before(None)
        with where:
            self.cursor = self.graph.call_function(target, args)
        return self.cursor

    def check(self, condition, message: str) -> None:
        self.call(torch._assert, (condition, message))


def guard_constant_inputs(
    gm: fx.GraphModule, example_args: Sequence, descriptions: Sequence[str]
) -> fx.GraphModule:
    """Assert each non-tensor input's export-time value."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    emit = _Emitter(gm.graph)
    for node, value, description in zip(placeholders, example_args, descriptions):
        if isinstance(value, (bool, int, float, str)):
            emit.check(
                emit.call(operator.eq, (node, value)),
                f"this graph was exported with {description} == {value!r}; non-tensor inputs "
                "are specialized at export time. Export again for another value.",
            )
    gm.recompile()
    return gm


def guard_dynamic_shapes(
    gm: fx.GraphModule, fake_args: Sequence, descriptions: Sequence[str], shape_env
) -> fx.GraphModule:
    """Assert every size relation the trace relied on: each input size against what the
    shape environment resolved it to (a constant, or a size of an earlier input), then the
    remaining guards (inequalities)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    emit = _Emitter(gm.graph)
    symbols: dict[sympy.Symbol, fx.Node] = {}
    legend: dict[sympy.Symbol, str] = {}  # s21 -> "user input args[0] size 0"
    pending: list[tuple[fx.Node, sympy.Expr, str]] = []
    for node, value, description in zip(placeholders, fake_args, descriptions):
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt):
                continue  # static: the graph's ops check it where it matters
            expr = shape_env.replace(size.node.expr)
            size_node = emit.call(torch.ops.aten.sym_size.int, (node, dim))
            where = f"{description} size {dim}"
            if isinstance(expr, sympy.Symbol) and expr not in symbols:
                symbols[expr] = size_node
                legend[expr] = where
            else:
                pending.append((size_node, expr, where))
    for size_node, expr, where in pending:
        expected = _compute(expr, symbols, emit)
        emit.check(
            emit.call(operator.eq, (size_node, expected)),
            f"{where} must be {_describe(expr, legend)} (the exported graph relies on it); "
            "export again for inputs of this shape.",
        )
    for guard in shape_env.guards:
        expr = shape_env.replace(guard.expr)
        if expr == sympy.true:
            continue  # an equality already resolved into the sizes checked above
        if not expr.free_symbols <= symbols.keys():
            continue  # about sizes that are not inputs' (they follow from the inputs')
        emit.check(
            _compute(expr, symbols, emit),
            f"the exported graph assumes {expr} about its input sizes "
            f"({_symbol_legend(expr, legend)}); export again for inputs of this shape.",
        )
    _guard_values_read_from_tensors(gm, shape_env, symbols, legend)
    gm.recompile()
    return gm


def _guard_values_read_from_tensors(
    gm: fx.GraphModule, shape_env, symbols: dict, legend: dict
) -> None:
    """Assert what the forward checked about values it read from tensors (``.item()`` used as
    a size: ``torch._check(n <= x.shape[0])``, ``n >= 0``), right after the value is read.

    Such a value is an unbacked symbol (``u0``): the trace knows nothing of it but what
    ``torch._check`` told it, so eager's checks must stay in the graph::

        _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(arg2_1)
        le = _local_scalar_dense <= sym_size_int
        _assert_2 = torch._assert(le, "the forward checks u0 <= s0 ...")
    """
    defined_by: dict[sympy.Symbol, fx.Node] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            symbol = value.node.expr
            if symbol not in symbols and symbol not in defined_by:
                defined_by[symbol] = node
                legend[symbol] = f"the value read from a tensor at node {node.name}"
    if not defined_by:
        return
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    known = {**symbols, **defined_by}
    emitters: dict[fx.Node, _Emitter] = {}  # one per reading node: checks stay in order
    for runtime_asserts in shape_env.deferred_runtime_asserts.values():
        for runtime_assert in runtime_asserts:
            expr = shape_env.replace(runtime_assert.expr)
            if expr == sympy.true or not expr.free_symbols <= known.keys():
                continue  # about values of another run (metadata collection), not this graph's
            unbacked = [defined_by[s] for s in expr.free_symbols if s in defined_by]
            if not unbacked:
                continue
            reader = max(unbacked, key=order.__getitem__)
            if reader not in emitters:
                emitters[reader] = _Emitter(gm.graph)
                emitters[reader].cursor = reader
            emit = emitters[reader]
            emit.check(
                _compute(expr, known, emit),
                f"the forward checks {expr} ({_symbol_legend(expr, legend)}), as eager's "
                "torch._check or a size's own check would.",
            )


def _compute(expr: sympy.Basic, symbols: dict, emit: _Emitter):
    """FX nodes computing ``expr`` from the input sizes bound in ``symbols``."""
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return symbols[expr]
    target = SYMPY_OPERATORS.get(type(expr))
    if target is None and isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
        return emit.call(operator.pow, (_compute(expr.base, symbols, emit), int(expr.exp)))
    if target is None:
        raise ExportError(
            f"export with dynamic shapes: cannot express the size condition {expr} as a runtime "
            "check; export with static shapes (dynamic_shapes=False) instead."
        )
    args = [_compute(arg, symbols, emit) for arg in expr.args]
    if target is operator.not_:
        return emit.call(target, (args[0],))
    result = args[0]
    for arg in args[1:]:
        result = emit.call(target, (result, arg))
    return result


def _describe(expr, legend: dict) -> str:
    if expr.is_Integer:
        return str(int(expr))
    if isinstance(expr, sympy.Symbol) and expr in legend:
        return f"equal to {legend[expr]}"
    return f"{expr} ({_symbol_legend(expr, legend)})"


def _symbol_legend(expr, legend: dict) -> str:
    """``s21 = user input args[0] size 0``: which input size each symbol stands for."""
    symbols = sorted((s for s in expr.free_symbols if s in legend), key=str)
    return ", ".join(f"{symbol} = {legend[symbol]}" for symbol in symbols)
