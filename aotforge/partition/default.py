"""The default partition: the forward saves every forward value the backward reads.

A joint graph takes ``(primals_1.., tangents_1..)`` and returns
``(*forward_outputs, *gradients)``; the first ``num_fwd_outputs`` outputs are the forward's.
Partitioning turns it into two graphs with the calling convention the runtime expects::

    forward(primals...)                       -> (*forward_outputs, *saved_tensors, *saved_symints)
    backward(*saved_symints, *saved_tensors, *tangents) -> (*gradients)

Before (joint)::

    def joint(primals_1, tangents_1):
        sin = aten.sin(primals_1);  cos = aten.cos(primals_1)
        mul = aten.mul(tangents_1, cos)
        return (sin, mul)

After::

    def forward(primals_1):            def backward(primals_1, tangents_1):
        sin = aten.sin(primals_1)          cos = aten.cos(primals_1)
        return (sin, primals_1)            mul = aten.mul(tangents_1, cos)
                                           return (mul,)
"""
from __future__ import annotations

import operator
from typing import Iterable, Sequence

import torch
import torch.fx as fx


def is_primal(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.target.startswith("primals")


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.target.startswith("tangents")


def is_symbolic(node: fx.Node) -> bool:
    """True for nodes whose value is a SymInt/SymFloat/SymBool (saved apart from tensors)."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def joint_outputs(joint: fx.GraphModule, num_fwd_outputs: int) -> tuple[list, list]:
    """Split the joint graph's flat outputs into (forward outputs, backward outputs)."""
    (outputs,) = joint.graph.find_nodes(op="output")
    flat = list(outputs.args[0])
    return flat[:num_fwd_outputs], flat[num_fwd_outputs:]


def ancestors(outputs: Iterable, stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Every node that ``outputs`` depend on, not looking past the nodes in ``stop``."""
    seen: set[fx.Node] = set()
    work = [n for n in outputs if isinstance(n, fx.Node)]
    while work:
        node = work.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in stop:
            continue
        work.extend(node.all_input_nodes)
    return seen


def tuple_elements(nodes: set[fx.Node]) -> set[fx.Node]:
    """The getitem nodes that unpack multi-output nodes in ``nodes``: a tuple is never saved,
    its elements are."""
    return {
        user
        for node in nodes
        if isinstance(node.meta.get("val"), (tuple, list))
        for user in node.users
        if user.target is operator.getitem
    }


def extract_graph(
    source: fx.Graph, inputs: Sequence[fx.Node], outputs: Sequence, name: str
) -> fx.Graph:
    """Copy the part of ``source`` that computes ``outputs`` from ``inputs`` into a new graph.

    ``inputs`` become placeholders (keeping their names and metadata). Nodes are copied in the
    source's order, so the result is topologically sorted; unused nodes are dropped.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        new = graph.placeholder(node.name)
        new.meta = dict(node.meta)
        env[node] = new
    needed = ancestors(outputs, stop=set(inputs))
    for node in source.nodes:
        if node in env or node not in needed or node.op == "output":
            continue
        if node.op == "placeholder":
            raise RuntimeError(
                f"aotforge partition bug: the {name} graph needs input {node.name!r}, "
                "which was not passed to it"
            )
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    graph.eliminate_dead_code()
    graph.lint()
    return graph


def split_with_saved_values(
    joint: fx.GraphModule,
    saved_values: Sequence[fx.Node],
    saved_symints: Sequence[fx.Node],
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Build the forward and backward graphs once a partitioner chose what to save."""
    placeholders = joint.graph.find_nodes(op="placeholder")
    primals = [n for n in placeholders if is_primal(n)]
    tangents = [n for n in placeholders if is_tangent(n)]
    fwd_outputs, bwd_outputs = joint_outputs(joint, num_fwd_outputs)
    forward = extract_graph(
        joint.graph, primals, [*fwd_outputs, *saved_values, *saved_symints], "forward"
    )
    backward = extract_graph(
        joint.graph, [*saved_symints, *saved_values, *tangents], bwd_outputs, "backward"
    )
    return fx.GraphModule(joint, forward), fx.GraphModule(joint, backward)


def default_partition(
    joint_module: fx.GraphModule,
    joint_inputs=None,
    *,
    num_fwd_outputs: int,
    **kwargs,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Save every value computed by the forward that the backward reads; recompute nothing
    else. Values the backward can compute without the forward (from saved inputs only) are
    computed in the backward."""
    fwd_outputs, bwd_outputs = joint_outputs(joint_module, num_fwd_outputs)
    forward_nodes = ancestors(fwd_outputs)
    forward_nodes |= {n for n in joint_module.graph.nodes if is_primal(n)}
    forward_nodes |= tuple_elements(forward_nodes)
    backward_nodes = ancestors(bwd_outputs, stop=forward_nodes) - forward_nodes
    saved: list[fx.Node] = []
    for node in joint_module.graph.nodes:
        if node in forward_nodes and any(user in backward_nodes for user in node.users):
            saved.append(node)
    saved_values = [n for n in saved if not is_symbolic(n)]
    saved_symints = [n for n in saved if is_symbolic(n)]
    return split_with_saved_values(joint_module, saved_values, saved_symints, num_fwd_outputs)
