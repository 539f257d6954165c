"""A table of local rewrites: ATen op -> function(node) returning what replaces it, or None.

    reciprocal(sqrt(x)) -> rsqrt(x)        neg(neg(x)) -> x
    permute(permute(x, p), q) -> permute(x, p∘q)   (or x when the composition is the identity)
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx

aten = torch.ops.aten


def _input(node: fx.Node, target: Any) -> Optional[fx.Node]:
    source = node.args[0] if node.args else None
    if isinstance(source, fx.Node) and source.op == "call_function" and source.target is target:
        return source
    return None


def _rsqrt(node: fx.Node) -> Optional[fx.Node]:
    source = _input(node, aten.sqrt.default)
    if source is None:
        return None
    with node.graph.inserting_before(node):
        new = node.graph.call_function(aten.rsqrt.default, (source.args[0],))
    new.meta.update(node.meta)
    return new


def _double_negation(node: fx.Node) -> Optional[fx.Node]:
    source = _input(node, aten.neg.default)
    return source.args[0] if source is not None else None


def _permute_permute(node: fx.Node) -> Optional[fx.Node]:
    source = _input(node, aten.permute.default)
    if source is None:
        return None
    inner, outer = list(source.args[1]), list(node.args[1])
    rank = len(inner)
    composed = [inner[d % rank] for d in outer]
    if composed == list(range(rank)):
        return source.args[0]
    with node.graph.inserting_before(node):
        new = node.graph.call_function(aten.permute.default, (source.args[0], composed))
    new.meta.update(node.meta)
    return new


PATTERNS: dict[Any, Callable[[fx.Node], Optional[fx.Node]]] = {
    aten.reciprocal.default: _rsqrt,
    aten.neg.default: _double_negation,
    aten.permute.default: _permute_permute,
}


def apply_pattern_rewrites(gm: fx.GraphModule) -> fx.GraphModule:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = set(output.all_input_nodes)
    for node in list(gm.graph.nodes):
        rewrite = PATTERNS.get(node.target) if node.op == "call_function" else None
        if rewrite is None:
            continue
        replacement = rewrite(node)
        if replacement is None:
            continue
        if node in returned and isinstance(replacement, fx.Node) and replacement.op == "placeholder":
            continue  # an output must not become an input
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    return gm
