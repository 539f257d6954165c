"""``analyze_reads(lowered) -> BufferReads``: which buffers each operation reads, and at which
index inside a kernel of a given shape, computed once per (operation, kernel shape).

A body's record is walked with the kernel's index substituted (sympy index arithmetic, not
cheap). Fusion asks the same question for the same buffer many times (one per candidate
kernel), so the answers are kept here::

    buf1 = exp(load(buf0, i0*8 + i1))    reads: buf1 -> {buf0}
    in a kernel (x=16, r=8):             buf0 at rindex + 8*xindex
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import sympy

from ..indexing import node_indices, simplify_index, store_index
from ..ir import ComputedBuffer, ExternCall, LoweredGraph, ReductionBody, StorageView, product
from ..ops import ReadRecorder

IndexedReads = tuple[tuple[str, sympy.Expr], ...]


def kernel_shape(buffer: ComputedBuffer) -> tuple[sympy.Expr, sympy.Expr]:
    """(numel, rnumel): the iteration space of a buffer in a kernel of its own (expressions
    when sizes are symbolic)."""
    body = buffer.body
    rnumel = sympy.expand(product(body.reduction_ranges)) if isinstance(body, ReductionBody) else sympy.Integer(1)
    return sympy.expand(product(body.ranges)), rnumel


def extern_reads(call: ExternCall) -> frozenset[str]:
    names: set[str] = set()

    def visit(obj: Any) -> None:
        if isinstance(obj, StorageView):
            names.add(obj.buffer.name)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
    visit(call.args)
    visit(call.kwargs)
    return frozenset(names)


def _record(buffer: ComputedBuffer, numel: int, rnumel: int) -> Optional[IndexedReads]:
    indices = node_indices(buffer, numel, rnumel)
    if indices is None:
        return None
    recorder = ReadRecorder()
    buffer.body.walk(recorder, *indices)
    return tuple((name, simplify_index(index)) for name, index in recorder.reads)


@dataclasses.dataclass(frozen=True)
class BufferReads:
    """Reads of every operation of a lowered graph. ``of(op)`` gives the buffer names an
    operation reads; ``in_kernel`` gives the indices of those reads in a kernel of the given
    shape (computed on first request, then kept)."""

    operations: tuple  # the lowered graph's operations, in program order
    names: dict  # id(operation) -> frozenset of buffer names it reads
    _indexed: dict = dataclasses.field(default_factory=dict, repr=False)
    _writes: dict = dataclasses.field(default_factory=dict, repr=False)

    def of(self, op: Any) -> frozenset[str]:
        return self.names[id(op)]

    def in_kernel(self, buffer: ComputedBuffer, numel: int, rnumel: int) -> Optional[IndexedReads]:
        key = (id(buffer), numel, rnumel)
        if key not in self._indexed:
            self._indexed[key] = _record(buffer, numel, rnumel)
        return self._indexed[key]

    def write_index(self, buffer: ComputedBuffer, numel: int, rnumel: int) -> sympy.Expr:
        key = (id(buffer), numel, rnumel)
        if key not in self._writes:
            index, _ = node_indices(buffer, numel, rnumel)
            self._writes[key] = store_index(buffer, index)
        return self._writes[key]

    def __str__(self) -> str:
        lines = []
        for op in self.operations:
            lines.append(f"{op.name} reads {', '.join(sorted(self.of(op))) or 'nothing'}")
        return "\n".join(lines) + "\n"


def analyze_reads(lowered: LoweredGraph) -> BufferReads:
    names: dict = {}
    reads = BufferReads(lowered.operations, names)
    for op in lowered.operations:
        if isinstance(op, ExternCall):
            names[id(op)] = extern_reads(op)
        else:
            names[id(op)] = frozenset(name for name, _ in reads.in_kernel(op, *kernel_shape(op)) or ())
    return reads
