"""The scheduler: group computed buffers into kernels, then plan allocation and frees.

Fusion is greedy in program order. A buffer joins an earlier kernel when

1. its iteration space fits the kernel's ``(numel, rnumel)``: a reduction with the same
   sizes (sibling reductions: mean and variance of the same rows), an elementwise buffer over
   ``numel * rnumel`` elements (an epilogue after a reduction), or one value per output row;
2. every buffer of that kernel it reads, it reads at exactly the element the kernel wrote
   (the value is still in registers; nothing crosses threads);
3. everything else it reads was produced before that kernel runs.

Buffers that nothing outside their kernel reads are never stored. Frees follow the last use,
and a freed buffer's memory is handed to the next allocation of the same size.

    buf0 = sum(x, -1)          kernel0 (x=N, r=D): buf0, buf1, buf2
    buf1 = sum((x-buf0/D)^2)   (buf0 and buf1 stay in registers;
    buf2 = (x-buf0/D)*rsqrt(buf1/D) ...      only buf2 is stored)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import sympy

from .indexing import XINDEX, RINDEX, node_indices, simplify_index, store_index
from .ir import ComputedBuffer, ExternCall, ReductionBody, StorageView, product
from ..config import config
from .ops import ReadRecorder, use_handler


@dataclasses.dataclass
class KernelGroup:
    numel: int
    rnumel: int
    nodes: list[ComputedBuffer]
    position: int
    name: str = ""

    @property
    def is_reduction(self) -> bool:
        return any(isinstance(n.body, ReductionBody) for n in self.nodes)


@dataclasses.dataclass
class Schedule:
    steps: list[Any]  # KernelGroup | ExternCall
    stored: set[str]  # computed buffers that must be written to memory
    frees: dict[int, list[str]]  # step -> names to release after it
    reuse: dict[str, str]  # new buffer -> freed buffer whose memory it takes


def reads_in_kernel(buffer: ComputedBuffer, numel: int, rnumel: int) -> Optional[list[tuple[str, Any]]]:
    indices = node_indices(buffer, numel, rnumel)
    if indices is None:
        return None
    recorder = ReadRecorder()
    with use_handler(recorder):
        if isinstance(buffer.body, ReductionBody):
            buffer.body.fn(*indices)
        else:
            buffer.body.fn(indices[0])
    return [(name, simplify_index(index)) for name, index in recorder.reads]


def buffer_reads(buffer: ComputedBuffer) -> set[str]:
    body = buffer.body
    numel = int(product(body.ranges))
    rnumel = int(product(body.reduction_ranges)) if isinstance(body, ReductionBody) else 1
    return {name for name, _ in reads_in_kernel(buffer, numel, rnumel) or []}


def write_index(buffer: ComputedBuffer, numel: int, rnumel: int) -> sympy.Expr:
    index, _ = node_indices(buffer, numel, rnumel)
    return store_index(buffer, index)


def _reshaped_for(group: KernelGroup, buffer: ComputedBuffer) -> Optional[KernelGroup]:
    """An elementwise kernel over N*D elements can become a (rows=N, row length=D) kernel, so
    that a reduction over its rows joins it (the producer of a softmax's input)."""
    if group.rnumel != 1 or not isinstance(buffer.body, ReductionBody):
        return None
    numel, rnumel = _sizes(buffer)
    if rnumel == 1 or numel * rnumel != group.numel:
        return None
    if any(node_indices(n, numel, rnumel) is None or n.mutates is not None for n in group.nodes):
        return None
    return KernelGroup(numel, rnumel, group.nodes, group.position, group.name)


def _fits(group: KernelGroup, buffer: ComputedBuffer, produced_at: dict[str, int],
          readers_after: dict[str, list[int]]) -> bool:
    body = buffer.body
    if isinstance(body, ReductionBody):
        numel, rnumel = int(product(body.ranges)), int(product(body.reduction_ranges))
        if (numel, rnumel) != (group.numel, group.rnumel):
            return False
    if node_indices(buffer, group.numel, group.rnumel) is None:
        return False
    if buffer.mutates is not None and group.rnumel != 1:
        return False
    if group.numel == 1 and group.rnumel > config.persistent_reduction_limit and not isinstance(body, ReductionBody):
        return False  # one program would do all the work
    reads = reads_in_kernel(buffer, group.numel, group.rnumel)
    if reads is None:
        return False
    members = {n.name: n for n in group.nodes}
    for name, index in reads:
        if name in members:
            if index.free_symbols - {XINDEX, RINDEX}:
                return False
            if sympy.expand(index - write_index(members[name], group.numel, group.rnumel)) != 0:
                return False
        elif produced_at.get(name, -1) > group.position:
            return False
        # a write into an input must not overtake a read of the old value elsewhere
        if buffer.mutates is not None and any(p > group.position for p in readers_after.get(buffer.name, [])):
            return False
    if buffer.mutates is not None:
        for member in group.nodes:
            for name, index in reads_in_kernel(member, group.numel, group.rnumel) or []:
                if name == buffer.name and sympy.expand(index - write_index(buffer, group.numel, group.rnumel)) != 0:
                    return False
    return True


def _sizes(buffer: ComputedBuffer) -> tuple[int, int]:
    body = buffer.body
    rnumel = int(product(body.reduction_ranges)) if isinstance(body, ReductionBody) else 1
    return int(product(body.ranges)), rnumel


def _sibling_kind(group: KernelGroup, buffer: ComputedBuffer) -> bool:
    """Kernels that share only inputs fuse when both are elementwise or both reduce; an
    elementwise buffer never rides along with an unrelated reduction."""
    if isinstance(buffer.body, ReductionBody) == group.is_reduction:
        return True
    # an elementwise buffer over the same rows reads them while they are in registers
    return group.is_reduction and _sizes(buffer)[0] == group.numel * group.rnumel


def schedule(operations: list[Any], output_names: set[str]) -> Schedule:
    steps: list[Any] = []
    produced_at: dict[str, int] = {}  # buffer name -> step that produces it
    readers_after: dict[str, list[int]] = {}  # buffer name -> steps that read it
    reads_of: dict[str, set[str]] = {}
    for op in operations:
        if isinstance(op, ExternCall):
            position = len(steps)
            steps.append(op)
            for name in extern_reads(op):
                readers_after.setdefault(name, []).append(position)
            for out in op.outputs:
                if out is not None:
                    produced_at[out.name] = position
            continue
        reads = buffer_reads(op)
        reads_of[op.name] = reads
        producers = sorted({produced_at[n] for n in reads
                            if n in produced_at and isinstance(steps[produced_at[n]], KernelGroup)}, reverse=True)
        siblings = sorted({i for i, s in enumerate(steps) if isinstance(s, KernelGroup) and i not in producers
                           and _sibling_kind(s, op) and any(reads & reads_of.get(m.name, set()) for m in s.nodes)},
                          reverse=True)
        # independent reductions of the same shape share a launch (the two column sums of a
        # layer norm's backward)
        same_shape = [i for i, s in enumerate(steps) if isinstance(s, KernelGroup) and s.is_reduction
                      and isinstance(op.body, ReductionBody) and i not in producers and i not in siblings
                      and (s.numel, s.rnumel) == _sizes(op)][-1:]
        candidates = producers + siblings + same_shape
        chosen = None
        for position in candidates:
            if _fits(steps[position], op, produced_at, readers_after):
                chosen = steps[position]
                break
            reshaped = _reshaped_for(steps[position], op)
            if reshaped is not None and _fits(reshaped, op, produced_at, readers_after):
                steps[position] = chosen = reshaped
                break
        if chosen is None:
            body = op.body
            rnumel = int(product(body.reduction_ranges)) if isinstance(body, ReductionBody) else 1
            chosen = KernelGroup(int(product(body.ranges)), rnumel, [], len(steps))
            steps.append(chosen)
        chosen.nodes.append(op)
        if op.mutates is None:
            produced_at[op.name] = chosen.position
        for name in reads:
            readers_after.setdefault(name, []).append(chosen.position)

    for index, step in enumerate(s for s in steps if isinstance(s, KernelGroup)):
        step.name = f"kernel{index}"

    # what must reach memory: outputs, mutations, and anything another step reads
    stored: set[str] = set(output_names)
    for op in operations:
        if isinstance(op, ComputedBuffer) and op.mutates is not None:
            stored.add(op.name)
    for name, readers in readers_after.items():
        if name in produced_at and any(r != produced_at[name] for r in readers):
            stored.add(name)

    last_use: dict[str, int] = {}
    for name, readers in readers_after.items():
        last_use[name] = max(readers)
    frees: dict[int, list[str]] = {}
    for name, position in last_use.items():
        if name in output_names or (name in produced_at and name not in stored):
            continue
        frees.setdefault(position, []).append(name)
    return Schedule(steps, stored, frees, {})


def extern_reads(call: ExternCall) -> set[str]:
    names: set[str] = set()

    def visit(obj):
        if isinstance(obj, StorageView):
            names.add(obj.buffer.name)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                visit(o)
    visit(call.args)
    visit(call.kwargs)
    return names
