"""Splitting a joint graph traced without functionalization (``disable_functionalization``).

Such a graph keeps in-place ops (``sin_``, ``_foreach_mul_``, ``copy_``), often with no users,
and its values change after they are computed. A partitioner that takes what the forward
outputs depend on, and recomputes the rest in the backward, would drop those ops or read a
value after a later op mutated it. So the split follows the order of the trace instead: every
op traced before the backward began (``joint_fn`` tags the backward's nodes) runs in the
forward, in order, and the forward saves the values the backward reads. Nothing is
recomputed, whatever partition_fn was chosen: recomputing across in-place ops is unsafe.
"""
from __future__ import annotations

import torch.fx as fx

from ..partition.default import is_primal, is_symbolic, is_tangent, joint_outputs

# The node meta key (copied by make_fx from the current node meta) and value that mark the
# joint's backward; PyTorch's partitioners read the same tag.
PHASE_KEY = "partitioner_tag"
BACKWARD = "is_backward"


def is_backward_node(node: fx.Node) -> bool:
    return is_tangent(node) or node.meta.get(PHASE_KEY) == BACKWARD


def split_by_phase(joint: fx.GraphModule, num_fwd_outputs: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graphs with the runtime's calling convention::

        forward(primals...) -> (*forward_outputs, *saved_tensors, *saved_symints)
        backward(*saved_symints, *saved_tensors, *tangents) -> (*gradients)
    """
    fwd_outputs, bwd_outputs = joint_outputs(joint, num_fwd_outputs)
    nodes = [n for n in joint.graph.nodes if n.op != "output"]
    backward_nodes = {n for n in nodes if is_backward_node(n)}
    saved: list[fx.Node] = []
    for node in nodes:
        if node in backward_nodes:
            continue
        read_by_backward = any(user in backward_nodes for user in node.users)
        if read_by_backward or node in bwd_outputs:
            saved.append(node)
    saved_values = [n for n in saved if not is_symbolic(n)]
    saved_symints = [n for n in saved if is_symbolic(n)]
    forward = _copy_in_order(
        [n for n in nodes if n not in backward_nodes and n.op != "placeholder"],
        [n for n in nodes if is_primal(n)],
        [*fwd_outputs, *saved_values, *saved_symints],
    )
    backward = _copy_in_order(
        [n for n in nodes if n in backward_nodes and n.op != "placeholder"],
        [*saved_symints, *saved_values, *(n for n in nodes if is_tangent(n))],
        bwd_outputs,
    )
    return fx.GraphModule(joint, forward), fx.GraphModule(joint, backward)


def _copy_in_order(body: list[fx.Node], inputs: list[fx.Node], outputs: list) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in body:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    graph.eliminate_dead_code()  # keeps in-place ops: FX counts mutating ops as impure
    graph.lint()
    return graph
