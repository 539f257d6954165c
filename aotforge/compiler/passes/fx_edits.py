"""Small edits every pass module makes: a new node with its fake value, a node's value, and a
list of passes run with one ``recompile`` at the end."""
from __future__ import annotations

from typing import Any, Optional

import sympy
import torch
import torch.fx as fx
from torch._guards import detect_fake_mode


def node_value(node: Any) -> Any:
    """The fake value of a node (``meta["val"]``); anything else is its own value."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def emit_node(graph: fx.Graph, before: fx.Node, target: Any, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    """A new node before ``before`` whose fake value is ``target`` run on its inputs' values."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs or {})
    values = tuple(node_value(a) if not isinstance(a, (list, tuple)) else type(a)(node_value(x) for x in a) for a in args)
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    with fake_mode:
        node.meta["val"] = target(*values, **(kwargs or {}))
    node.meta["stack_trace"] = before.meta.get("stack_trace")
    return node


def run_passes(gm: fx.GraphModule, graph_passes: tuple) -> fx.GraphModule:
    """Each pass in order, then one ``recompile``: passes edit ``gm.graph`` and leave its
    Python code stale, since regenerating it after every pass cost most of their time."""
    for graph_pass in graph_passes:
        gm = graph_pass(gm)
    gm.recompile()
    return gm


def size_key(size: Any) -> Any:
    """A size or stride as a value that compares without recording a guard: an int, or a
    SymInt's expression (comparing two SymInts with ``==`` would guard on their values)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def same_sizes(a: Any, b: Any) -> bool:
    """Whether two size (or stride) tuples are the same expressions, without guarding."""
    return len(a) == len(b) and all(size_key(x) == size_key(y) for x, y in zip(a, b))


def size_hint(size: Any) -> Optional[int]:
    """A size's value in the example inputs (a SymInt's hint), for choices that only change
    speed; never guards. None for a size without a hint (one that depends on data)."""
    if isinstance(size, torch.SymInt):
        hint = getattr(size.node, "hint", None)
        return int(hint) if hint is not None else None
    return size if isinstance(size, int) else None


def numel_hint(value: torch.Tensor) -> Optional[int]:
    """A tensor's element count in the example inputs (see ``size_hint``)."""
    total = 1
    for size in value.shape:
        hint = size_hint(size)
        if hint is None:
            return None
        total *= hint
    return total


def dense_in(value: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether ``value`` is dense with its dimensions laid out in ``order`` (innermost last),
    read from its sizes' and strides' expressions: no guard on symbolic sizes."""
    expected = 1
    for dim in reversed(order):
        size = size_key(value.shape[dim])
        if size != 1 and sympy.expand(sympy.sympify(size_key(value.stride()[dim])) - expected) != 0:
            return False
        expected = sympy.sympify(expected) * size
    return True


def is_channels_last(value: Any) -> bool:
    """A 4-d value dense in NHWC order (guard-free, as ``dense_in``)."""
    return value.dim() == 4 and dense_in(value, (0, 2, 3, 1))
