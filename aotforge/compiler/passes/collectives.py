"""Passes for graphs with functional collectives (``_c10d_functional``: what DTensor, tensor
parallelism and traced FSDP put in a graph). A collective is issued by one op and completed
by ``wait_tensor`` on its result; in between, the collective runs on another stream (NCCL)
or thread (gloo) while the graph goes on computing.

Collectives keep the graph's order: every rank must issue the same collectives in the same
order, or the job hangs. Waits may move later, so that the compute in between overlaps the
communication.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ... import op_table


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and op_table.packet_of(node.target) is getattr(
        torch.ops._c10d_functional, "wait_tensor", None)


def _mutates(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each wait down to just before the first node that reads its result::

        ag = all_gather_into_tensor(w, 2, "0")          ag = all_gather_into_tensor(w, 2, "0")
        full = wait_tensor(ag)                    ->    h = relu(x @ v)     # runs while ag is
        h = relu(x @ v)                                 full = wait_tensor(ag)  # in flight
        y = h @ full                                    y = h @ full

    A wait never moves past an op that writes into memory (an input mutation copied back in
    the graph, FSDP's ``set_``): the collective may still be reading what it would write."""
    for wait in reversed([n for n in gm.graph.nodes if is_wait(n)]):
        users = set(wait.users)
        stop = wait.next
        while stop.op != "output" and stop not in users and not _mutates(stop):
            stop = stop.next
        if stop is not wait.next:
            stop.prepend(wait)
    return gm
