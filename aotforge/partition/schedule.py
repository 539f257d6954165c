"""Node order in the backward graph, and the peak memory an order implies.

Partitioning copies the joint graph's nodes in their joint order, so every value the backward
recomputes comes first, ahead of all the gradient computation, and stays alive until its use
far below. ``reorder_backward_for_memory`` moves each recomputation down to just before its
first use, the way the autograd engine would interleave them.

Before::                                  After::

    def backward(add, add_1, tangents_1):     def backward(add, add_1, tangents_1):
        gelu = aten.gelu(add)                     gelu_1 = aten.gelu(add_1)
        gelu_1 = aten.gelu(add_1)                 mul = aten.mul(tangents_1, gelu_1)
        mul = aten.mul(tangents_1, gelu_1)        gelu = aten.gelu(add)
        mul_1 = aten.mul(mul, gelu)               mul_1 = aten.mul(mul, gelu)
        return (mul_1,)                           return (mul_1,)

``estimate_peak_memory`` walks an order and frees each value right after its last use (a
view keeps its base alive), which is what the compiled backward does with saved values.
"""
from __future__ import annotations

import torch.fx as fx

from . import op_costs
from .default import is_tangent


def reorder_backward_for_memory(bw_module: fx.GraphModule) -> fx.GraphModule:
    """Emit the tangent-dependent nodes in their order, each preceded by just the
    recomputations it needs that have not run yet."""
    graph = bw_module.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    depends_on_tangent: set[fx.Node] = set()
    for node in graph.nodes:
        if is_tangent(node) or any(a in depends_on_tangent for a in node.all_input_nodes):
            depends_on_tangent.add(node)
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def emit(target: fx.Node) -> None:
        # everything ``target`` needs that was not emitted yet, in the original order
        pending, work = set(), [target]
        while work:
            node = work.pop()
            if node in env or node in pending:
                continue
            pending.add(node)
            work.extend(node.all_input_nodes)
        for node in sorted(pending, key=order.__getitem__):
            env[node] = new_graph.node_copy(node, lambda n: env[n])

    for node in graph.find_nodes(op="placeholder"):
        env[node] = new_graph.node_copy(node, lambda n: env[n])
    for node in graph.nodes:
        if node in depends_on_tangent or node.op == "output":
            emit(node)
    new_graph.lint()
    reordered = fx.GraphModule(bw_module, new_graph)
    reordered.meta.update(getattr(bw_module, "meta", {}))
    return reordered


def estimate_peak_memory(gm: fx.GraphModule, inputs_freeable: bool = True) -> int:
    """Peak bytes alive while running ``gm`` in its node order.

    Every value is freed right after its last use; a view frees nothing and keeps its base
    alive until the view's last use. With ``inputs_freeable`` the inputs are freed after
    their last use too (the boxed calling convention lets the backward drop saved values);
    otherwise they count for the whole run.
    """
    nodes = list(gm.graph.nodes)
    owner: dict[fx.Node, fx.Node] = {}  # node -> the node whose memory it lives in
    for node in nodes:
        base = node
        if op_costs.is_view(node) and node.args and isinstance(node.args[0], fx.Node):
            base = owner[node.args[0]]
        owner[node] = base
    last_use: dict[fx.Node, int] = {}
    for index, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[owner[arg]] = index
    live = 0
    peak = 0
    for index, node in enumerate(nodes):
        if owner[node] is node and node.op != "output":
            live += op_costs.node_bytes(node)
        peak = max(peak, live)
        for arg in {owner[a] for a in node.all_input_nodes}:
            if last_use[arg] == index and (inputs_freeable or arg.op != "placeholder"):
                live -= op_costs.node_bytes(arg)
        if owner[node] is node and node not in last_use and node.op != "output":
            live -= op_costs.node_bytes(node)  # never used: dropped at once
    return peak
