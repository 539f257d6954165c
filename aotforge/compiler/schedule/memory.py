"""``plan_memory(lowered, plan, reads) -> MemoryPlan``: what the wrapper allocates before each
step, and what it releases after it.

A buffer is released after the last step that reads it (or writes into it); an ATen call's
output that nothing reads is released right after the call (max pooling's indices in an
inference graph). A new buffer takes the memory of a buffer of the same size and dtype where
it can, so the memory is not held twice:

- *in place*: a pointwise kernel whose output element ``i`` is computed from element ``i`` of
  a buffer that dies in this kernel writes into that buffer (batch norm and ReLU after a
  convolution write over the convolution's output);
- *kept*: a buffer released after an earlier step is kept, instead of deleted, for a later
  buffer, when no ATen call between the two allocates (its output could have had the memory)::

    kernel0: allocate buf1
    extern0: after: free buf1 (kept)
    kernel1: allocate buf4 in buf1's memory; after: free primals_1
    extern1: -
    kernel2: allocate buf6 in buf5's memory (in place); after: free buf5

Computed buffers and the outputs of ATen calls whose schema says they alias nothing take part;
graph inputs, constants and outputs never do.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ... import op_table
from ..ir import ComputedBuffer, ExternBuffer, ExternCall, LoweredGraph, same_size
from .fusion import KernelGroup, KernelPlan
from .reads import BufferReads


@dataclasses.dataclass(frozen=True)
class Allocation:
    buffer: str
    reuses: Optional[str] = None  # a released buffer whose memory this one takes
    # the reused buffer is still read by this step (element i before element i is written):
    # its name is released after the step, not at the allocation
    in_place: bool = False


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
            allocations = [a.buffer if a.reuses is None else
                           f"{a.buffer} in {a.reuses}'s memory" + (" (in place)" if a.in_place else "")
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
    """Step index of each buffer's last use. An ATen call's outputs are used by the call, so
    an output nothing reads is released after the call that made it."""
    last: dict[str, int] = {}
    for index, step in enumerate(plan.steps):
        if isinstance(step, ExternCall):
            used = set(reads.of(step)) | {out.name for out in step.outputs if out is not None}
        else:
            used = set()
            for node in step.nodes:
                used |= reads.of(node)
                if node.mutates is not None:  # a write into a buffer is a use of it
                    used.add(node.name)
        for name in sorted(used):
            last[name] = index
    return last


# ATen calls of several outputs that allocate each output on its own (no two share memory), so
# each output's memory may be taken once it dies: BatchNorm's normalized output is written
# over by the ReLU after it, as eager's ``relu_`` does (ResNet-18's training forward: 17 fresh
# activations a step otherwise).
SEPARATE_OUTPUTS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "native_layer_norm", "native_group_norm",
    "max_pool2d_with_indices", "convolution_backward", "native_batch_norm_backward",
    "native_layer_norm_backward", "native_group_norm_backward") if hasattr(torch.ops.aten, name))


def _reusable(lowered: LoweredGraph, plan: KernelPlan, reads: BufferReads) -> set[str]:
    """Buffers whose memory a later buffer may take once they are released: computed buffers,
    and outputs of ATen calls that alias nothing and allocate each output on its own (one
    output, or ``SEPARATE_OUTPUTS``): a fresh tensor of the layout the graph was compiled for.
    Arguments of an ATen call that may return a view of them keep
    their memory, as that view may outlive their last use, and so do a collective's, which it
    reads until its wait."""
    viewed = {n for s in plan.steps if isinstance(s, ExternCall) and (_may_alias(s) or _in_flight(s))
              for n in reads.of(s)}
    names = set()
    for name, buffer in lowered.buffers().items():
        if isinstance(buffer, ComputedBuffer):
            names.add(name)
        elif (isinstance(buffer, ExternBuffer) and (buffer.call.single_output or buffer.call.op in SEPARATE_OUTPUTS)
              and not _may_alias(buffer.call)):
            names.add(name)
    return names - viewed


def plan_memory(lowered: LoweredGraph, plan: KernelPlan, reads: BufferReads) -> MemoryPlan:
    buffers = lowered.buffers()
    outputs = {v.buffer.name for v in lowered.outputs if hasattr(v, "buffer")}
    produced = {n.name for s in plan.kernels() for n in s.nodes if n.mutates is None}
    reusable = _reusable(lowered, plan, reads)

    releases: dict[int, list[str]] = {}
    for name, index in sorted(_last_uses(plan, reads).items(), key=lambda item: (item[1], item[0])):
        if name in outputs or name in lowered.constants or (name in produced and name not in plan.stored):
            continue
        releases.setdefault(index, []).append(name)

    allocations: dict[int, tuple] = {}
    pool: list[str] = []  # released buffers whose memory a later buffer may take
    taken: set[str] = set()  # released after an earlier step, kept for a later buffer
    overwritten: set[str] = set()  # written over in place: their memory is the new buffer's
    for index, step in enumerate(plan.steps):
        if isinstance(step, ExternCall) and any(out is not None for out in step.outputs):
            pool.clear()  # the call's outputs could have had this memory: do not hold it past the call
        if isinstance(step, KernelGroup):
            dying = [n for n in releases.get(index, []) if n in reusable]
            made = []
            for node in step.nodes:
                if node.mutates is not None or node.name not in plan.stored:
                    continue
                old = _in_place(step, node, dying, buffers, reads)
                if old is not None:
                    dying.remove(old)
                    overwritten.add(old)
                    made.append(Allocation(node.name, old, in_place=True))
                    continue
                reuse = _take(pool, buffers, node)
                if reuse is not None:
                    taken.add(reuse)
                made.append(Allocation(node.name, reuse))
            if made:
                allocations[index] = tuple(made)
        pool.extend(n for n in releases.get(index, []) if n in reusable and n not in overwritten)

    frees: dict[int, tuple] = {}
    kept: dict[int, tuple] = {}
    for index, names in releases.items():
        frees[index] = tuple(n for n in names if n not in taken)
        kept[index] = tuple(n for n in names if n in taken)
    return MemoryPlan(tuple(s.name for s in plan.steps), allocations, {k: v for k, v in frees.items() if v},
                      {k: v for k, v in kept.items() if v})


def _fits(old, new: ComputedBuffer) -> bool:
    # symbolic sizes: equal expressions are equal for every call
    return ((old.dtype, old.device) == (new.dtype, new.device)
            and same_size(old.layout.storage_numel(), new.layout.storage_numel()))


def _take(pool: list[str], buffers: dict, buffer: ComputedBuffer) -> Optional[str]:
    for candidate in pool:
        if _fits(buffers[candidate], buffer):
            pool.remove(candidate)
            return candidate
    return None


def _in_place(group: KernelGroup, node: ComputedBuffer, dying: list[str], buffers: dict,
              reads: BufferReads) -> Optional[str]:
    """A buffer released after ``group`` that ``node`` can be written over: in a pointwise
    kernel, ``node`` is the only member that reads it, and reads it only at the element it
    writes (each element is read before it is overwritten, and never after), and no other
    member reads ``node`` (a member that recomputed ``node`` would read overwritten input)."""
    if group.rnumel != 1 or node.layout.offset != 0:
        return None
    others = [n for n in group.nodes if n is not node]
    if any(node.name in reads.of(n) for n in others):
        return None
    members = {n.name for n in group.nodes}  # (a member that writes into a buffer has its name)
    indexed = reads.in_kernel(node, group.numel, group.rnumel)
    if indexed is None:
        return None
    written = reads.write_index(node, group.numel, group.rnumel)
    for name in dying:
        old = buffers[name]
        if (name in members or not _fits(old, node) or old.layout.offset != 0
                or any(name in reads.of(n) for n in others)):
            continue
        if all(index == written for read, index in indexed if read == name):
            return name
    return None


def live_bytes(lowered: LoweredGraph, plan: KernelPlan, memory: MemoryPlan) -> tuple[int, ...]:
    """Bytes of memory the program holds while each step runs: the computed buffers it
    allocates (a reused buffer counts once) and the outputs of its ATen calls, from allocation
    to the ``del`` after their last use; buffers kept for a later allocation stay counted.
    Graph inputs and constants are the caller's and not counted (the caller holds them for
    the whole call). Symbolic sizes count at their example values."""
    hint = lowered.sizes.hint if lowered.sizes is not None else int
    buffers = lowered.buffers()

    def size_of(name: str) -> int:
        buffer = buffers[name]
        return hint(buffer.layout.storage_numel()) * buffer.dtype.itemsize

    live: dict[str, int] = {}  # the buffer that holds a block of memory -> the block's bytes
    during = []
    for index, step in enumerate(plan.steps):
        for allocation in memory.allocations.get(index, ()):
            if allocation.reuses is not None and allocation.reuses not in live:
                raise AssertionError(f"memory plan: {allocation.buffer} takes the memory of {allocation.reuses}, "
                                     "which no live buffer holds (given twice, or never allocated)")
            held = live.pop(allocation.reuses) if allocation.reuses is not None else size_of(allocation.buffer)
            live[allocation.buffer] = held
        if isinstance(step, ExternCall) and not _may_alias(step):
            live.update({out.name: size_of(out.name) for out in step.outputs if out is not None})
        during.append(sum(live.values()))
        for name in memory.frees.get(index, ()):
            live.pop(name, None)
    return tuple(during)
