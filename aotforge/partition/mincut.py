"""Min-cut rematerialization: save the fewest bytes, recompute the cheap rest in the backward.

The default partition saves every forward value the backward reads. Many of those are cheap
to recompute from a smaller set (``gelu(x)`` from ``x``, which the backward needs anyway), so
we choose what to save as a minimum cut in a flow network built from the joint graph:

* every node ``n`` becomes an edge ``n.in -> n.out`` whose capacity is the cost of saving
  ``n`` (its bytes, weighted up the further it is from the backward; nothing for values the
  backward needs anyway: parameters, and inputs a gradient formula reads; a view costs what
  its base does, and is dropped from the saved set when its base is saved); data
  dependencies are infinite edges ``n.out -> user.in``;
* the source feeds the inputs and every op that may not be recomputed (compute-heavy, random,
  unknown), so their values can reach the backward only by being saved;
* the sink drains everything the backward computes (the tangents and all that depends on
  them) and every value a gradient is.

A cut separates the source from the sink; the nodes whose ``in -> out`` edge is cut are the
saved values and the backward recomputes everything between them and its own nodes.

Before (joint; the default partition saves ``add`` and ``gelu``)::

    def joint(primals_1, primals_2, tangents_1):
        mm = aten.mm(primals_1, primals_2);  add = aten.add(mm, 1)
        gelu = aten.gelu(add);  mul = aten.mul(gelu, gelu)
        mul_1 = aten.mul(tangents_1, gelu);  mul_2 = aten.mul(mul_1, 2)
        gelu_backward = aten.gelu_backward(mul_2, add);  ...

After (min-cut saves only ``add``; the backward recomputes ``gelu`` from it)::

    def forward(primals_1, primals_2):       def backward(primals_1, primals_2, add, tangents_1):
        mm = aten.mm(primals_1, primals_2)       gelu = aten.gelu(add)
        add = aten.add(mm, 1)                    mul_1 = aten.mul(tangents_1, gelu); ...
        gelu = aten.gelu(add)
        mul = aten.mul(gelu, gelu)
        return (mul, primals_1, primals_2, add)

``aotforge.config.activation_memory_budget`` trades speed for memory: 1 is the cut above;
0 saves only the inputs (and what never-recomputed ops such as dropout produced) and
recomputes everything else, matmuls included; in between a knapsack keeps the compute-heavy
ops whose outputs buy the most runtime per byte, within ``min + budget * (max - min)`` saved
bytes.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Iterable, Sequence

import networkx as nx
import torch
import torch.fx as fx

from .. import debug
from ..config import config
from . import op_costs
from .report import format_report, summarize
from .default import (
    ancestors,
    default_partition,
    is_primal,
    is_symbolic,
    is_tangent,
    joint_outputs,
    split_with_saved_values,
)
from .schedule import estimate_peak_memory, reorder_backward_for_memory

# Saving a value d nodes from the backward costs bytes * (DISTANCE_SCALE + min(d, DISTANCE_CAP))
# / DISTANCE_SCALE: a value made early in the forward stays alive through all of it, and a tie
# in bytes is better broken towards values the backward reads directly. Kept mild (at most 2x)
# so that the cut still minimizes bytes first.
DISTANCE_SCALE = 32
DISTANCE_CAP = 32
# A SymInt is a few bytes to save; it still needs a cost so that the cut prefers it over a
# tensor that would let the backward recompute it.
SYMINT_COST = 1
# Buckets of the budget knapsack's dynamic program: finer is slower but fills the budget better.
KNAPSACK_BUCKETS = 1000
# Rounds of "shrink the knapsack and cut again" before falling back on saving only inputs.
BUDGET_ROUNDS = 8


@dataclasses.dataclass
class JointInfo:
    """How each node of the joint graph relates to the forward and the backward."""

    primals: list[fx.Node]
    tangents: list[fx.Node]
    bwd_outputs: list  # the gradients (None where an input needs none)
    live: set[fx.Node]  # nodes some output depends on; everything else is dead code
    forward: set[fx.Node]  # what the forward outputs need, plus the inputs
    tangent_closure: set[fx.Node]  # depends on a tangent: only the backward can compute it
    backward_required: set[fx.Node]  # tangent closure plus the gradients themselves
    static_inputs: set[fx.Node]  # parameters and buffers: alive anyway, free to save
    distance: dict[fx.Node, int]  # forward node -> hops to the nearest backward user


def min_cut_rematerialization_partition(
    joint_module: fx.GraphModule,
    joint_inputs=None,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Sequence[int] | None = None,
    memory_budget: float | None = None,
    **kwargs,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition ``joint_module`` into (forward, backward), saving a minimum cut of values.

    A drop-in for ``default_partition``: same arguments, same calling convention.
    ``static_lifetime_input_indices`` lists the primals that live as long as the model
    (parameters, buffers); saving them costs nothing. ``memory_budget`` overrides
    ``aotforge.config.activation_memory_budget`` for this call.
    """
    budget = config.activation_memory_budget if memory_budget is None else memory_budget
    _check_budget(budget)
    info = classify_joint(joint_module, num_fwd_outputs, static_lifetime_input_indices or ())
    if not info.tangent_closure and not any(
        isinstance(o, fx.Node) for o in joint_outputs(joint_module, num_fwd_outputs)[1]
    ):
        # Nothing in the backward: there is nothing to cut.
        return default_partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs)
    saved = choose_saved_values(joint_module.graph, info, budget)
    saved = drop_redundant_saves(joint_module.graph, info, saved)
    saved_values = [n for n in saved if not is_symbolic(n)]
    saved_symints = [n for n in saved if is_symbolic(n)]
    fw_module, bw_module = split_with_saved_values(
        joint_module, saved_values, saved_symints, num_fwd_outputs
    )
    bw_module = reorder_backward_for_memory(bw_module)
    summary = summarize(
        saved_values,
        saved_symints,
        recomputed_nodes(fw_module, bw_module, joint_module),
        budget,
        info.static_inputs,
        estimate_peak_memory(bw_module),
    )
    fw_module.meta["partition"] = summary
    if debug.enabled("partition") or debug.dump_dir():
        default_bytes = default_saved_bytes(joint_module, joint_inputs, num_fwd_outputs)
        debug.artifact("partition", "min_cut_report", format_report(summary, default_bytes), ".txt")
        debug.graph_artifact("partition", "min_cut_forward", fw_module)
        debug.graph_artifact("partition", "min_cut_backward", bw_module)
    return fw_module, bw_module


def _check_budget(budget: float) -> None:
    if not isinstance(budget, (int, float)) or not 0.0 <= budget <= 1.0:
        raise ValueError(
            f"activation_memory_budget must be a number in [0, 1], got {budget!r}: 1 saves "
            "what min-cut chooses for speed, 0 saves only the inputs. Set it with "
            "aotforge.config.patch(activation_memory_budget=...) or "
            "AOTFORGE_ACTIVATION_MEMORY_BUDGET."
        )


# --- classifying the joint graph ---------------------------------------------------------


def classify_joint(
    joint: fx.GraphModule, num_fwd_outputs: int, static_lifetime_input_indices: Iterable[int]
) -> JointInfo:
    """Sort the joint graph's nodes into forward, backward and neither (see ``JointInfo``)."""
    placeholders = joint.graph.find_nodes(op="placeholder")
    primals = [n for n in placeholders if is_primal(n)]
    tangents = [n for n in placeholders if is_tangent(n)]
    others = [n.target for n in placeholders if n not in primals and n not in tangents]
    if others:
        raise ValueError(
            f"joint graph inputs {others} are neither primals_N nor tangents_N: the "
            "partitioner cannot tell whether the forward or the backward receives them. "
            "Rename them following the joint graph convention (primals first, then tangents)."
        )
    (output,) = joint.graph.find_nodes(op="output")
    total = len(output.args[0])
    if not 0 <= num_fwd_outputs <= total:
        raise ValueError(
            f"num_fwd_outputs={num_fwd_outputs} but the joint graph returns {total} values; "
            "it must count the forward outputs that come before the gradients."
        )
    fwd_outputs, bwd_outputs = joint_outputs(joint, num_fwd_outputs)
    live = ancestors([*fwd_outputs, *bwd_outputs]) | set(placeholders)
    forward = ancestors(fwd_outputs) | set(primals)
    tangent_closure: set[fx.Node] = set()
    for node in joint.graph.nodes:  # topological order: inputs come before their users
        reads_tangent = any(a in tangent_closure for a in node.all_input_nodes)
        if node in live and (is_tangent(node) or reads_tangent):
            tangent_closure.add(node)
    backward_required = tangent_closure | {o for o in bwd_outputs if isinstance(o, fx.Node)}
    indices = set(static_lifetime_input_indices)
    bad = sorted(i for i in indices if not 0 <= i < len(primals))
    if bad:
        raise ValueError(
            f"static_lifetime_input_indices {bad} are out of range for {len(primals)} primals"
        )
    static_inputs = {p for i, p in enumerate(primals) if i in indices}
    return JointInfo(
        primals=primals,
        tangents=tangents,
        bwd_outputs=bwd_outputs,
        live=live,
        forward=forward,
        tangent_closure=tangent_closure,
        backward_required=backward_required,
        static_inputs=static_inputs,
        distance=_distance_to_backward(joint.graph, live, forward),
    )


def _distance_to_backward(graph: fx.Graph, live: set, forward: set) -> dict[fx.Node, int]:
    """Hops from each forward node to its nearest user outside the forward."""
    distance: dict[fx.Node, int] = {}
    far = DISTANCE_CAP
    for node in reversed(graph.nodes):
        if node not in forward:
            continue
        hops = far
        for user in node.users:
            if user in live and user.op != "output":
                hops = min(hops, 1 if user not in forward else distance[user] + 1)
        distance[node] = hops
    return distance


# --- the flow network ----------------------------------------------------------------------

SOURCE, SINK = "source", "sink"


def save_cost(node: fx.Node, info: JointInfo) -> int | None:
    """Capacity of ``node``'s ``in -> out`` edge; None means it cannot be saved at all."""
    if node.op == "get_attr":
        return None  # a constant of the module: both graphs read it, nothing to save
    value = node.meta.get("val")
    if isinstance(value, torch.SymInt):
        return SYMINT_COST
    if not isinstance(value, torch.Tensor):
        return None  # tuples (their getitems are saved instead), SymFloats, no value
    if node in info.static_inputs or (
        node.op == "placeholder" and any(u in info.tangent_closure for u in node.users)
    ):
        # Values the backward needs anyway: parameters live as long as the model, and an
        # input a gradient formula reads is saved whatever the cut; recomputing from them
        # is free.
        return 0
    # A saved view keeps its base's memory alive, so it is as far from the backward as its
    # base; at equal cost the base is saved (+1), and the backward recomputes the view.
    base = op_costs.view_base(node)
    distance = min(info.distance.get(base, info.distance.get(node, 1)), DISTANCE_CAP)
    cost = max(op_costs.tensor_bytes(value), 1) * (DISTANCE_SCALE + distance)
    return cost + 1 if base is not node else cost


def solve_min_cut(
    graph: fx.Graph,
    info: JointInfo,
    recomputable: set[fx.Node] | None = None,
    saveable: set[fx.Node] | None = None,
) -> list[fx.Node]:
    """The values to save: a minimum cut of the flow network (see the module docstring).

    ``recomputable``: forward nodes of kind ``compute`` the backward may recompute (the
    budget's knapsack chooses them). ``saveable``: if given, only these nodes may be saved
    (budget 0 passes the inputs and what may not be recomputed).
    """
    recomputable = recomputable or set()
    network = nx.DiGraph()
    for node in graph.nodes:
        if node not in info.live or node.op == "output":
            continue
        node_in, node_out = (node, "in"), (node, "out")
        if node in info.tangent_closure:
            network.add_edge(node_in, SINK)  # no capacity: infinite
            continue
        if node in info.backward_required:
            network.add_edge(node_out, SINK)
        if (
            node.op == "placeholder"
            or _always_banned(node)
            or (_banned(node) and node in info.forward and node not in recomputable)
            or _cast_for_library_calls(node, info)
        ):
            network.add_edge(SOURCE, node_in)
        cost = save_cost(node, info)
        if saveable is not None and node not in saveable:
            cost = None
        if cost is None:
            network.add_edge(node_in, node_out)
        else:
            network.add_edge(node_in, node_out, capacity=cost)
        for user in node.users:
            if user in info.live and user.op != "output":
                network.add_edge(node_out, (user, "in"))
    try:
        _, (reachable, _) = nx.minimum_cut(network, SOURCE, SINK)
    except nx.NetworkXUnbounded as error:
        path = _infinite_path(network)
        raise RuntimeError(
            "aotforge min-cut partition: a value the backward needs can be neither saved nor "
            f"recomputed (path {path}). This is a partitioner bug; as a workaround pass "
            "partition_fn=aotforge.partition.default_partition."
        ) from error
    order = {n: i for i, n in enumerate(graph.nodes)}
    saved = [
        node
        for (node, side) in reachable - {SOURCE}
        if side == "in" and (node, "out") not in reachable and (node, "out") in network
    ]
    return sorted(saved, key=order.__getitem__)


def _banned(node: fx.Node) -> bool:
    """Not recomputable at budget 1: compute-heavy, random or unknown ops."""
    return node.op == "call_function" and op_costs.op_kind(node) not in op_costs.RECOMPUTABLE_KINDS


def _cast_for_library_calls(node: fx.Node, info: JointInfo) -> bool:
    """A cast (or copy) that library calls read in both the forward and the backward: the
    forward has it in memory anyway, and a recomputed one is a pass over memory of its own in
    the backward, since a matmul cannot fuse it. BERT's backward recast its weights to bf16
    (73 launches) and its 12 attention-probability tensors (3.6 GB moved) for its matmuls."""
    if node.op != "call_function" or node not in info.forward or op_costs.op_kind(node) != op_costs.CAST:
        return False
    readers = _readers_through_views(node, info)
    return any(u in info.forward for u in readers) and any(u not in info.forward for u in readers)


def _readers_through_views(node: fx.Node, info: JointInfo) -> list[fx.Node]:
    """The library calls (matmul, convolution, attention) that read ``node`` or a view of it."""
    out, pending = [], list(node.users)
    while pending:
        user = pending.pop()
        if user not in info.live or user.op != "call_function":
            continue
        if op_costs.is_view(user):
            pending.extend(user.users)
        elif op_costs.op_kind(user) == op_costs.COMPUTE:
            out.append(user)
    return out


def _always_banned(node: fx.Node) -> bool:
    """Never recomputable whatever the budget: random draws, collectives (a recomputed one is
    a collective the other ranks may not issue) and ops we know nothing about."""
    return node.op == "call_function" and op_costs.op_kind(node) in NEVER_RECOMPUTED


NEVER_RECOMPUTED = (op_costs.RANDOM, op_costs.COLLECTIVE, op_costs.UNKNOWN)


def _infinite_path(network: nx.DiGraph) -> str:
    infinite = nx.DiGraph(
        (u, v) for u, v, data in network.edges(data=True) if "capacity" not in data
    )
    try:
        path = nx.shortest_path(infinite, SOURCE, SINK)
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        return "?"
    return " -> ".join(p if isinstance(p, str) else f"{p[0].name}.{p[1]}" for p in path)


# --- the memory budget ---------------------------------------------------------------------


def choose_saved_values(graph: fx.Graph, info: JointInfo, budget: float) -> list[fx.Node]:
    """The saved values for ``budget`` (1: fastest min-cut; 0: inputs only; between: knapsack)."""
    if budget == 0:
        return save_only_inputs(graph, info)
    fastest = solve_min_cut(graph, info)
    if budget == 1:
        return fastest
    smallest = save_only_inputs(graph, info)
    max_bytes, min_bytes = saved_bytes(fastest), saved_bytes(smallest)
    if max_bytes <= min_bytes:
        return fastest
    target = min_bytes + budget * (max_bytes - min_bytes)
    candidates = [
        n
        for n in graph.nodes
        if n in info.forward and n in info.live and _banned(n) and not _always_banned(n)
    ]
    # Knapsack: keep saving the compute-heavy outputs worth the most runtime per byte, within
    # the bytes the budget leaves above the inputs-only floor; recompute the others. The cut
    # then decides the rest; if it overshoots (recomputing an op also needs its inputs), shrink
    # the knapsack by the overshoot and try again.
    sizes = [op_costs.node_bytes(n) for n in candidates]
    runtimes = [op_costs.estimate_flops(n) for n in candidates]
    capacity = target - min_bytes
    for _ in range(BUDGET_ROUNDS):
        kept = knapsack(sizes, runtimes, capacity)
        recompute = {n for i, n in enumerate(candidates) if i not in kept}
        saved = solve_min_cut(graph, info, recomputable=recompute)
        overshoot = saved_bytes(saved) - target
        if overshoot <= 0:
            return saved
        capacity -= overshoot
        if capacity <= 0:
            break
    return smallest


def save_only_inputs(graph: fx.Graph, info: JointInfo) -> list[fx.Node]:
    """Budget 0: save only inputs; recompute everything else, matmuls included. What the
    never-recomputed ops produce is saved too: random draws cannot be redrawn, and ops we know
    nothing about are not replayed.

    A saved input may be one the runtime mutates after the forward (batch norm's running
    statistics, which a recomputed batch norm reads); the runtime saves a clone of those."""
    saveable = set(info.primals)
    for node in graph.nodes:
        if node in info.live and _always_banned(node):
            saveable.add(node)
            # its elements, also nested ones (run_and_save_rng_state returns (state, (out, mask)))
            elements = [u for u in node.users if u.target is operator.getitem]
            while elements:
                element = elements.pop()
                saveable.add(element)
                elements.extend(u for u in element.users if u.target is operator.getitem)
    everything = {n for n in graph.nodes if _banned(n) and not _always_banned(n)}
    return solve_min_cut(graph, info, recomputable=everything, saveable=saveable)


def knapsack(sizes: Sequence[int], values: Sequence[int], capacity: float) -> set[int]:
    """0/1 knapsack: the indices of items to keep, maximizing total value within ``capacity``
    bytes. Sizes are rounded up to ``KNAPSACK_BUCKETS`` buckets, so a chosen set never
    exceeds the capacity."""
    if capacity <= 0:
        return set()
    unit = capacity / KNAPSACK_BUCKETS
    weights = [int(-(-size // unit)) if size > 0 else 0 for size in sizes]
    best = [0] * (KNAPSACK_BUCKETS + 1)  # best[c]: the most value within c buckets
    taken: list[list[bool]] = []
    for weight, value in zip(weights, values):
        row = [False] * (KNAPSACK_BUCKETS + 1)
        for room in range(KNAPSACK_BUCKETS, weight - 1, -1):
            if best[room - weight] + value > best[room]:
                best[room] = best[room - weight] + value
                row[room] = True
        taken.append(row)
    kept: set[int] = set()
    room = KNAPSACK_BUCKETS
    for index in range(len(weights) - 1, -1, -1):
        if taken[index][room]:
            kept.add(index)
            room -= weights[index]
    return kept


def saved_bytes(saved: Iterable[fx.Node]) -> int:
    return sum(op_costs.node_bytes(n) for n in saved)


# --- after the cut ---------------------------------------------------------------------------


def drop_redundant_saves(graph: fx.Graph, info: JointInfo, saved: list[fx.Node]) -> list[fx.Node]:
    """Remove saved values the backward does not need.

    * A view whose base is saved too costs nothing to recompute: save only the base.
    * A value whose every backward use goes through other saved values is never read
      (a zero-cost parameter the cut happened to include, say).
    """
    saved_set = set(saved)
    views = {n for n in saved_set if _view_of_saved(n, saved_set)}
    kept = saved_set - views
    for view in views:
        # the view's other arguments (symbolic sizes) must be computable from what is saved
        inputs = ancestors([view], stop=kept | set(info.tangents))
        if any(n.op == "placeholder" and n not in kept for n in inputs):
            kept.add(view)
    needed = ancestors(info.bwd_outputs, stop=kept | set(info.tangents))
    return [n for n in saved if n in kept and n in needed]


def _view_of_saved(node: fx.Node, saved: set[fx.Node]) -> bool:
    while op_costs.is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        if node in saved:
            return True
    return False


def _outputs(graph: fx.Graph) -> list:
    (output,) = graph.find_nodes(op="output")
    return list(output.args[0])


def recomputed_nodes(
    fw_module: fx.GraphModule, bw_module: fx.GraphModule, joint: fx.GraphModule
) -> list[fx.Node]:
    """Joint nodes computed in both graphs: the forward computes them and the backward again."""
    forward_names = {n.name for n in fw_module.graph.nodes if n.op == "call_function"}
    backward_names = {n.name for n in bw_module.graph.nodes if n.op == "call_function"}
    both = forward_names & backward_names
    return [n for n in joint.graph.nodes if n.name in both]


def default_saved_bytes(joint: fx.GraphModule, joint_inputs, num_fwd_outputs: int) -> int:
    """Saved bytes under the default partition, for the report's comparison."""
    fw_module, _ = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs)
    return saved_bytes(_outputs(fw_module.graph)[num_fwd_outputs:])


def explain_partition(
    joint_module: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs
) -> str:
    """Partition ``joint_module`` with min-cut and return the report (for ``aotforge.explain``)."""
    fw_module, _ = min_cut_rematerialization_partition(
        joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
    )
    default_bytes = default_saved_bytes(joint_module, joint_inputs, num_fwd_outputs)
    return format_report(fw_module.meta["partition"], default_bytes)
