"""Small edits every pass module makes: a new node with its fake value, a node's value, and a
list of passes run with one ``recompile`` at the end."""
from __future__ import annotations

from typing import Any, Optional

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
