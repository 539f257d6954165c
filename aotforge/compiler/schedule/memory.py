"""``plan_memory(lowered, plan, reads) -> MemoryPlan``: what the wrapper allocates before each
step, and what it releases after it.

A buffer is released after the last step that reads it (or writes into it). A released
computed buffer whose memory a later buffer of the same size and dtype can take is kept for
that buffer (no allocator call, and the memory is warm); anything else is deleted at once::

    kernel0: allocate buf1
    extern0: after: free buf1 (kept)
    kernel1: allocate buf4 in buf1's memory; after: free primals_1
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ... import op_table
from ..ir import ComputedBuffer, ExternCall, LoweredGraph, same_size
from .fusion import KernelGroup, KernelPlan
from .reads import BufferReads


@dataclasses.dataclass(frozen=True)
class Allocation:
    buffer: str
    reuses: Optional[str] = None  # a released buffer whose memory this one takes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    steps: tuple  # the name of each step of the plan (kernel group or extern call)
    allocations: dict  # step index -> tuple of Allocation, made before the step runs
    frees: dict  # step index -> names deleted after the step
    kept: dict  # step index -> names released after the step but kept for a later Allocation

    def __str__(self) -> str:
        lines = []
        for index, name in enumerate(self.steps):
            parts = []
            allocations = [a.buffer if a.reuses is None else f"{a.buffer} in {a.reuses}'s memory"
                           for a in self.allocations.get(index, ())]
            if allocations:
                parts.append("allocate " + ", ".join(allocations))
            released = list(self.frees.get(index, ())) + [f"{n} (kept)" for n in self.kept.get(index, ())]
            if released:
                parts.append("after: free " + ", ".join(released))
            lines.append(f"{name}: " + ("; ".join(parts) or "-"))
        return "\n".join(lines) + "\n"


def _may_alias(call: ExternCall) -> bool:
    """An ATen call whose schema says an output may alias an input (or an unknown callable)."""
    op = call.op
    if isinstance(op, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in op._schema.returns)
    return True


def _in_flight(call: ExternCall) -> bool:
    """A collective reads its inputs until its wait, on another stream (NCCL) or thread
    (gloo): their memory must not be handed to a buffer computed in between."""
    return op_table.kind(call.op) == op_table.COLLECTIVE


def _last_uses(plan: KernelPlan, reads: BufferReads) -> dict[str, int]:
    last: dict[str, int] = {}
    for index, step in enumerate(plan.steps):
        if isinstance(step, ExternCall):
            used = set(reads.of(step))
        else:
            used = set()
            for node in step.nodes:
                used |= reads.of(node)
                if node.mutates is not None:  # a write into a buffer is a use of it
                    used.add(node.name)
        for name in sorted(used):
            last[name] = index
    return last


def plan_memory(lowered: LoweredGraph, plan: KernelPlan, reads: BufferReads) -> MemoryPlan:
    buffers = lowered.buffers()
    outputs = {v.buffer.name for v in lowered.outputs if hasattr(v, "buffer")}
    produced = {n.name for s in plan.kernels() for n in s.nodes if n.mutates is None}
    # an ATen call may return a view of its argument, a collective reads its arguments until
    # its wait: such arguments keep their memory
    no_reuse = {n for s in plan.steps if isinstance(s, ExternCall) and (_may_alias(s) or _in_flight(s))
                for n in reads.of(s)}

    releases: dict[int, list[str]] = {}
    for name, index in sorted(_last_uses(plan, reads).items(), key=lambda item: (item[1], item[0])):
        if name in outputs or name in lowered.constants or (name in produced and name not in plan.stored):
            continue
        releases.setdefault(index, []).append(name)

    allocations: dict[int, tuple] = {}
    pool: list[str] = []  # released computed buffers whose memory a later buffer may take
    taken: set[str] = set()
    released_at: dict[str, int] = {}
    for index, step in enumerate(plan.steps):
        if isinstance(step, KernelGroup):
            made = []
            for node in step.nodes:
                if node.mutates is None and node.name in plan.stored:
                    reuse = _take(pool, buffers, node)
                    if reuse is not None:
                        taken.add(reuse)
                    made.append(Allocation(node.name, reuse))
            if made:
                allocations[index] = tuple(made)
        for name in releases.get(index, []):
            released_at[name] = index
            if isinstance(buffers.get(name), ComputedBuffer) and name not in no_reuse:
                pool.append(name)

    frees: dict[int, tuple] = {}
    kept: dict[int, tuple] = {}
    for index, names in releases.items():
        frees[index] = tuple(n for n in names if n not in taken)
        kept[index] = tuple(n for n in names if n in taken)
    return MemoryPlan(tuple(s.name for s in plan.steps), allocations, {k: v for k, v in frees.items() if v}, {k: v for k, v in kept.items() if v})


def _take(pool: list[str], buffers: dict, buffer: ComputedBuffer) -> Optional[str]:
    wanted = (buffer.dtype, buffer.device, buffer.layout.storage_numel())
    for candidate in pool:
        old = buffers[candidate]
        # symbolic sizes: equal expressions are equal for every call
        if (old.dtype, old.device) == wanted[:2] and same_size(old.layout.storage_numel(), wanted[2]):
            pool.remove(candidate)
            return candidate
    return None
