"""``fuse(lowered, reads) -> KernelPlan``: group computed buffers into kernels.

Fusion is greedy in program order. A buffer joins an earlier kernel when

1. its iteration space fits the kernel's ``(numel, rnumel)``: a reduction with the same
   sizes (sibling reductions: mean and variance of the same rows), an elementwise buffer over
   ``numel * rnumel`` elements (an epilogue after a reduction), or one value per output row;
2. every buffer of that kernel it reads, it reads at exactly the element the kernel wrote
   (the value is still in registers; nothing crosses threads);
3. everything else it reads was produced before that kernel runs.

Buffers that nothing outside their kernel reads are never stored::

    buf0 = sum(x, -1)                          kernel0 reduction x=N r=D: buf0, buf1, buf2
    buf1 = sum((x-buf0/D)^2)                   (buf0 and buf1 stay in registers;
    buf2 = (x-buf0/D)*rsqrt(buf1/D) ...         only buf2 is stored)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import sympy

from ...config import config
from ..indexing import RINDEX, XINDEX, node_indices
from ..ir import ComputedBuffer, ExternCall, LoweredGraph, ReductionBody, same_size, static_int
from ..sizes import is_size_symbol
from .reads import BufferReads, kernel_shape


@dataclasses.dataclass(frozen=True)
class KernelGroup:
    """Buffers computed by one kernel over ``numel`` outputs of ``rnumel`` reduced elements."""

    name: str
    numel: Any  # sympy expressions (symbolic when sizes are)
    rnumel: Any
    nodes: tuple  # ComputedBuffer, in the order the kernel computes them
    # pointwise | persistent (a row held at once) | looped (rows walked in chunks)
    kind: str = "pointwise"
    reduction_contiguous: bool = True  # the reduced axis is the fastest-moving in memory

    @property
    def is_reduction(self) -> bool:
        return any(isinstance(n.body, ReductionBody) for n in self.nodes)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What runs, in order: kernel groups and extern (ATen) calls, and which computed buffers
    must reach memory (outputs, in-place writes, and values read by another step)."""

    steps: tuple  # KernelGroup | ExternCall
    stored: frozenset
    # why a buffer did not join a kernel it was offered to (``buf4 not in kernel1: ...``)
    refusals: tuple = ()

    def kernels(self) -> list[KernelGroup]:
        return [s for s in self.steps if isinstance(s, KernelGroup)]

    def __str__(self) -> str:
        lines = []
        for step in self.steps:
            if isinstance(step, ExternCall):
                outputs = ", ".join(o.name for o in step.outputs if o is not None)
                lines.append(f"{step.name}: {step.op} -> {outputs or 'nothing'}")
                continue
            shape = f"reduction x={step.numel} r={step.rnumel}" if step.rnumel != 1 else f"pointwise x={step.numel}"
            members = []
            for node in step.nodes:
                note = " (in place)" if node.mutates is not None else " (stored)" if node.name in self.stored else ""
                members.append(node.name + note)
            lines.append(f"{step.name}: {shape}: {', '.join(members)}")
        return "\n".join(lines) + "\n"

    def describe_refusals(self) -> str:
        return "".join(f"{line}\n" for line in self.refusals)


@dataclasses.dataclass
class _Group:
    """A kernel group while fusion is still adding to it."""

    numel: Any
    rnumel: Any
    nodes: list
    position: int

    @property
    def is_reduction(self) -> bool:
        return any(isinstance(n.body, ReductionBody) for n in self.nodes)


def _reshaped_for(group: _Group, buffer: ComputedBuffer) -> Optional[_Group]:
    """An elementwise kernel over N*D elements can become a (rows=N, row length=D) kernel, so
    that a reduction over its rows joins it (the producer of a softmax's input)."""
    if group.rnumel != 1 or not isinstance(buffer.body, ReductionBody):
        return None
    numel, rnumel = kernel_shape(buffer)
    if rnumel == 1 or not same_size(numel * rnumel, group.numel):
        return None
    if any(node_indices(n, numel, rnumel) is None or n.mutates is not None for n in group.nodes):
        return None
    return _Group(numel, rnumel, group.nodes, group.position)


def _same_shape(a: tuple, b: tuple) -> bool:
    return same_size(a[0], b[0]) and same_size(a[1], b[1])


@functools.lru_cache(maxsize=65536)
def same_index(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.expand(a - b) == 0


def _same_element(reads: BufferReads, member: ComputedBuffer, index: sympy.Expr, group: _Group) -> bool:
    return same_index(index, reads.write_index(member, group.numel, group.rnumel))


def _refusal(group: _Group, buffer: ComputedBuffer, reads: BufferReads, produced_at: dict[str, int],
             readers_after: dict[str, list[int]]) -> Optional[str]:
    """Why ``buffer`` cannot join ``group``, or None when it can."""
    if isinstance(buffer.body, ReductionBody) and not _same_shape(kernel_shape(buffer), (group.numel, group.rnumel)):
        return "a reduction of another shape"
    if node_indices(buffer, group.numel, group.rnumel) is None:
        return "its iteration space does not fit the kernel's"
    if buffer.mutates is not None and group.rnumel != 1:
        return "an in-place write joins no reduction"
    long_rows = static_int(group.rnumel) is None or group.rnumel > config.persistent_reduction_limit
    if group.numel == 1 and long_rows and not isinstance(buffer.body, ReductionBody):
        return "one program would do all the work"
    indexed = reads.in_kernel(buffer, group.numel, group.rnumel)
    if indexed is None:
        return "its reads do not fit the kernel's shape"
    members = {n.name: n for n in group.nodes}
    for name, index in indexed:
        if name in members:
            if {s for s in index.free_symbols if not is_size_symbol(s)} - {XINDEX, RINDEX}:
                return f"an indirect read of {name}: which element is not known until run time"
            if not _same_element(reads, members[name], index, group):
                return f"it reads {name} at another element than the kernel writes"
        elif produced_at.get(name, -1) > group.position:
            return f"it reads {name}, made after the kernel runs"
    if buffer.mutates is not None:
        # a write into an input must not overtake a read of the old value elsewhere
        if any(p > group.position for p in readers_after.get(buffer.name, [])):
            return f"a later step reads {buffer.name} before the write"
        write = reads.write_index(buffer, group.numel, group.rnumel)
        for member in group.nodes:
            for name, index in reads.in_kernel(member, group.numel, group.rnumel) or ():
                if name == buffer.name and not same_index(index, write):
                    return f"the kernel reads {buffer.name} at another element than the write"
    return None


def _sibling_kind(group: _Group, buffer: ComputedBuffer) -> bool:
    """Kernels that share only inputs fuse when both are elementwise or both reduce; an
    elementwise buffer never rides along with an unrelated reduction."""
    if isinstance(buffer.body, ReductionBody) == group.is_reduction:
        return True
    # an elementwise buffer over the same rows reads them while they are in registers
    return group.is_reduction and same_size(kernel_shape(buffer)[0], group.numel * group.rnumel)


# A buffer joins only kernels among the last FUSION_WINDOW steps before it in program order
# (the backward's order puts each recomputation just before its first use), unless it is the
# only reader of what it reads there (a gradient's final cast: the join saves a store and a
# load), and a kernel it does not read from (horizontal fusion) only within
# HORIZONTAL_POINTER_BUDGET pointer arguments. Without these
# limits, fusion hoisted recomputations into the backward's first kernels: every layer's layer
# norm into the kernel that rebuilds the residual stream, or all of them into one kernel
# (BERT: one persistent reduction making about 100 buffers from 78 pointers, 2.97 ms on an
# H200), every recomputed activation stored and alive at once, far from its use.
FUSION_WINDOW = 6
HORIZONTAL_POINTER_BUDGET = 24


def _candidates(steps: list, op: ComputedBuffer, reads: BufferReads, produced_at: dict[str, int],
                group_reads: dict[int, set[str]], sole_reader: dict[str, bool]) -> list[int]:
    """Kernels ``op`` may join, best first: its producers (latest first), kernels that read
    the same buffers, then the latest independent reduction of the same shape; all of them
    near ``op``, the last two (horizontal fusion) within the pointer budget."""
    own = reads.of(op)
    near = max(0, len(steps) - FUSION_WINDOW)
    producers = {produced_at[n] for n in own if n in produced_at and isinstance(steps[produced_at[n]], _Group)}
    producers = sorted((p for p in producers if p >= near or all(
        sole_reader.get(n, False) for n in own if produced_at.get(n) == p)), reverse=True)
    horizontal = [i for i in range(near, len(steps)) if isinstance(steps[i], _Group) and i not in producers
                  and _pointers_after_join(steps[i], op, reads, group_reads) <= HORIZONTAL_POINTER_BUDGET]
    siblings = sorted((i for i in horizontal if _sibling_kind(steps[i], op) and own & group_reads.get(i, set())),
                      reverse=True)
    # independent reductions of the same shape share a launch (the two column sums of a
    # layer norm's backward)
    same_shape = [i for i in horizontal if steps[i].is_reduction and isinstance(op.body, ReductionBody)
                  and i not in siblings and _same_shape((steps[i].numel, steps[i].rnumel), kernel_shape(op))][-1:]
    return producers + siblings + same_shape


def _pointers_after_join(group: _Group, op: ComputedBuffer, reads: BufferReads,
                         group_reads: dict[int, set[str]]) -> int:
    """At most how many pointer arguments ``group`` has with ``op`` in it: what its members
    read from outside it, and each member (stored, at worst)."""
    members = {n.name for n in group.nodes} | {op.name}
    outside = (group_reads.get(group.position, set()) | reads.of(op)) - members
    return len(outside) + len(members)


def fuse(lowered: LoweredGraph, reads: BufferReads) -> KernelPlan:
    steps: list[Any] = []
    produced_at: dict[str, int] = {}  # buffer name -> step that produces it
    readers_after: dict[str, list[int]] = {}  # buffer name -> steps that read it
    group_reads: dict[int, set[str]] = {}  # step -> names its members read
    refusals: list = []  # (buffer, step, why) for each kernel a buffer could not join
    outputs = {v.buffer.name for v in lowered.outputs if hasattr(v, "buffer")}
    readers: dict[str, int] = {}
    for op in lowered.operations:
        for name in reads.of(op):
            readers[name] = readers.get(name, 0) + 1
    sole_reader = {name: count == 1 and name not in outputs for name, count in readers.items()}
    for op in lowered.operations:
        if isinstance(op, ExternCall):
            position = len(steps)
            steps.append(op)
            for name in reads.of(op):
                readers_after.setdefault(name, []).append(position)
            for out in op.outputs:
                if out is not None:
                    produced_at[out.name] = position
            continue
        chosen, refused = None, []
        for position in _candidates(steps, op, reads, produced_at, group_reads, sole_reader):
            reason = _refusal(steps[position], op, reads, produced_at, readers_after)
            if reason is None:
                chosen = steps[position]
                break
            reshaped = _reshaped_for(steps[position], op)
            if reshaped is not None and _refusal(reshaped, op, reads, produced_at, readers_after) is None:
                steps[position] = chosen = reshaped
                break
            refused.append((position, reason))
        if chosen is None:
            refusals += [(op.name, position, reason) for position, reason in refused]
            chosen = _Group(*kernel_shape(op), [], len(steps))
            steps.append(chosen)
        chosen.nodes.append(op)
        group_reads.setdefault(chosen.position, set()).update(reads.of(op))
        if op.mutates is None:
            produced_at[op.name] = chosen.position
        for name in reads.of(op):
            readers_after.setdefault(name, []).append(chosen.position)

    # what must reach memory: outputs, mutations, and anything another step reads
    stored = {v.buffer.name for v in lowered.outputs if hasattr(v, "buffer")}
    stored |= {op.name for op in lowered.operations if isinstance(op, ComputedBuffer) and op.mutates is not None}
    for name, readers in readers_after.items():
        if name in produced_at and any(r != produced_at[name] for r in readers):
            stored.add(name)

    names = iter(range(len(steps)))
    final = tuple(KernelGroup(f"kernel{next(names)}", s.numel, s.rnumel, tuple(s.nodes), *_kernel_kind(s, reads))
                  if isinstance(s, _Group) else s for s in steps)
    refused = tuple(f"{buffer} not in {final[position].name}: {why}" for buffer, position, why in refusals)
    return KernelPlan(final, frozenset(stored), refused)


def _kernel_kind(group: _Group, reads: BufferReads) -> tuple[str, bool]:
    """(kind, reduction_contiguous) of a finished group. A row is held in registers when its
    length is known, short enough, and contiguous in memory (a strided, column, reduction
    walks its rows in a loop over tiles wide along the outputs)."""
    contiguous = _reduction_contiguous(group, reads)
    if group.rnumel == 1:
        return "pointwise", contiguous
    persistent = (group.rnumel.is_Integer and group.rnumel <= config.persistent_reduction_limit
                  and (contiguous or group.rnumel <= 64))
    return ("persistent" if persistent else "looped"), contiguous


def _reduction_contiguous(group: _Group, reads: BufferReads) -> bool:
    """Whether every read of the group's reduction walks its row contiguously. One strided
    read makes the kernel strided: a cross-entropy backward reads its labels along the row
    but the logits down a column (BERT's MLM bias gradient), and the logits are the bytes."""
    for buffer in group.nodes:
        if isinstance(buffer.body, ReductionBody):
            return all(stride in (0, 1) for stride in _rindex_coefficients(reads, buffer, group.numel, group.rnumel))
    return True


def _rindex_coefficients(reads: BufferReads, buffer: ComputedBuffer, numel: Any, rnumel: Any) -> list[Any]:
    """The step in memory of each of the buffer's reads per step along the row."""
    out = []
    for _, index in reads.in_kernel(buffer, numel, rnumel) or []:
        coefficient = sympy.expand(index).coeff(RINDEX)
        if coefficient.free_symbols & {XINDEX, RINDEX}:
            continue  # walks the row through an integer division: no single step
        out.append(int(coefficient) if coefficient.is_Integer else coefficient)
    return out
