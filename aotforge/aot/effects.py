"""Effect tokens: ops with side effects stay in the graphs, in program order.

A side-effectful op (``aten._print``, ``aten._linalg_check_errors`` in torch >= 2.13, a custom
op registered with ``torch._higher_order_ops.effects._register_effectful_op``) has no output the
graph needs, so dead-code elimination would drop it and a scheduler could reorder it.
Functionalization rewrites each into ``with_effects(token, op, *args) -> (new_token, *results)``:
the token is a dummy value threaded from one effectful op to the next, so their order becomes
a data dependence. We keep tokens inside the graphs: a chain starts at ``prims._make_token()``
and ends in ``prims._sink_tokens([...])`` (which DCE keeps), so no token ever becomes a graph
input or output, and the runtime and the user never see one.

Before (what functionalization leaves; the token is a discovered graph input)::

    def forward(self, primals_1, tangents_token):
        with_effects = higher_order.with_effects(tangents_token, aten._print.default, 'hi')
        getitem = with_effects[0]
        return (mul,)

After::

    def forward(self, primals_1):
        _make_token = prims._make_token.default()
        with_effects = higher_order.with_effects(_make_token, aten._print.default, 'hi')
        getitem = with_effects[0]
        _sink_tokens = prims._sink_tokens.default([getitem])
        return (mul,)

The joint graph has two chains, the forward's and the backward's (the backward's effects run
when the backward runs, as in eager). For partitioning, each chain's sunk tokens are lifted into
outputs of its side (so the partitioner keeps the chain on that side, and never moves a backward
effect into the forward), then put back into ``_sink_tokens`` nodes in the two graphs.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

prims = torch.ops.prims

# Node metadata key: which phase of the joint trace made a token input or a sink.
PHASE = "aotforge_effects_phase"
# The name functionalization gives a token input it discovers while tracing.
TOKEN_INPUT_PREFIX = "tangents_token"


def _functional_mode():
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL)


def _proxy_mode():
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)


def end_phase(phase: str) -> None:
    """Close the token chain of this phase of the trace ("forward" or "backward"): sink the
    tokens the functional mode holds and forget them, so that the next phase starts its own
    chain. Also marks the token inputs discovered so far as belonging to this phase.

    A no-op outside a traced functionalization, or when no effectful op ran."""
    mode = _functional_mode()
    proxy = _proxy_mode()
    if mode is None or proxy is None or not getattr(mode, "_tokens", None):
        return
    tokens = list(mode._tokens.values())
    mode._tokens = {}
    graph = proxy.tracer.graph
    torch.ops.prims._sink_tokens.default(tokens)
    sinks = graph.find_nodes(op="call_function", target=prims._sink_tokens.default)
    sinks[-1].meta[PHASE] = phase
    for node in graph.find_nodes(op="placeholder"):
        if node.name.startswith(TOKEN_INPUT_PREFIX):
            node.meta.setdefault(PHASE, phase)


def is_token_input(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.name.startswith(TOKEN_INPUT_PREFIX)


def _replace_with_make_token(graph: fx.Graph, placeholder: fx.Node) -> None:
    first_user = min(placeholder.users, key=_position(graph), default=None)
    with graph.inserting_before(first_user if first_user is not None else placeholder):
        token = graph.call_function(prims._make_token.default, ())
    token.meta["val"] = placeholder.meta.get("val")
    placeholder.replace_all_uses_with(token)
    graph.erase_node(placeholder)


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__


def finish_trace(gm: fx.GraphModule) -> None:
    """After tracing: forward token inputs become ``_make_token()`` nodes. The backward's stay
    inputs (named ``tangents_token``, so the partitioner treats what they feed as backward
    work) until ``partition_with_effects`` makes them tokens of the backward graph."""
    for node in list(gm.graph.find_nodes(op="placeholder")):
        if is_token_input(node) and node.meta.get(PHASE) != "backward":
            _replace_with_make_token(gm.graph, node)
    _sink_loose_tokens(gm.graph)


def _sink_loose_tokens(graph: fx.Graph) -> None:
    """A ``with_effects`` the user called directly (with a token of their own) whose new token
    nobody reads would be dropped as dead code: sink its token too."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.higher_order.with_effects):
        token = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), None)
        if token is not None and token.users:
            continue
        if token is None:
            with graph.inserting_after(node):
                token = graph.call_function(operator.getitem, (node, 0))
            token.meta["val"] = node.meta["val"][0] if "val" in node.meta else None
        with graph.inserting_after(token):
            sink = graph.call_function(prims._sink_tokens.default, ([token],))
        reads_tangent = any(
            n.op == "placeholder" and n.name.startswith("tangents") for n in _ancestors(node)
        )
        sink.meta[PHASE] = "backward" if reads_tangent else "forward"


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    work = [node]
    while work:
        current = work.pop()
        if current not in seen:
            seen.add(current)
            work.extend(current.all_input_nodes)
    return seen


def has_effects(gm: fx.GraphModule) -> bool:
    return bool(gm.graph.find_nodes(op="call_function", target=prims._sink_tokens.default))


def _lift_sinks(joint: fx.GraphModule, num_fwd_outputs: int) -> tuple[int, int]:
    """Move the tokens of the joint's sinks into its outputs: the forward's right after the
    forward outputs, the backward's at the end. Returns how many of each."""
    graph = joint.graph
    (output,) = graph.find_nodes(op="output")
    outputs = list(output.args[0])
    forward_tokens: list = []
    backward_tokens: list = []
    for sink in graph.find_nodes(op="call_function", target=prims._sink_tokens.default):
        tokens = backward_tokens if sink.meta.get(PHASE) == "backward" else forward_tokens
        tokens.extend(sink.args[0])
        graph.erase_node(sink)
    output.args = (
        (*outputs[:num_fwd_outputs], *forward_tokens, *outputs[num_fwd_outputs:], *backward_tokens),
    )
    joint.recompile()
    return len(forward_tokens), len(backward_tokens)


def _sink_outputs(gm: fx.GraphModule, start: int, count: int) -> None:
    """Replace outputs ``[start, start + count)`` of ``gm`` by one ``_sink_tokens`` of them."""
    if count == 0:
        return
    graph = gm.graph
    (output,) = graph.find_nodes(op="output")
    outputs = list(output.args[0])
    tokens = outputs[start : start + count]
    with graph.inserting_before(output):
        graph.call_function(prims._sink_tokens.default, (tokens,))
    output.args = (tuple(outputs[:start] + outputs[start + count :]),)
    gm.recompile()


def partition_with_effects(partition_fn: Callable) -> Callable:
    """``partition_fn`` for joint graphs whose effect chains end in sinks (see the module
    docstring); the graphs it returns keep the calling convention of token-free ones."""

    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        if not has_effects(joint) and not any(is_token_input(n) for n in joint.graph.nodes):
            return partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        num_forward, num_backward = _lift_sinks(joint, num_fwd_outputs)
        forward, backward = partition_fn(
            joint, joint_inputs, num_fwd_outputs=num_fwd_outputs + num_forward, **kwargs
        )
        _sink_outputs(forward, num_fwd_outputs, num_forward)
        for node in list(backward.graph.find_nodes(op="placeholder")):
            if is_token_input(node):
                _replace_with_make_token(backward.graph, node)
        (output,) = backward.graph.find_nodes(op="output")
        _sink_outputs(backward, len(output.args[0]) - num_backward, num_backward)
        return forward, backward

    return partition
