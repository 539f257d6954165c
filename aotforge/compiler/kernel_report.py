"""``kernel_report(compiled) -> KernelReport``: what each generated kernel costs, without a GPU.

Per kernel: the bytes it must move (each buffer it reads from outside the kernel once, each
buffer it stores once), the bytes its loads and stores move (a load per distinct address
expression over the elements it walks), the accesses that are not coalesced along the
kernel's vector dimension (neighbouring lanes more than one element apart), its pointer
arguments, whether its index arithmetic is 64-bit, and, with ``registers=True`` where
Triton can build for sm_90 here, its registers and local-memory (spill) bytes per thread. The defects
that once cost BERT and nanoGPT 1.5-2.7x inductor's kernel time show here on a CPU: a
pointwise kernel reading across rows (``uncoalesced``), a kernel of 78 pointers, a kernel
that moves far more than it must. Written to the dump as ``<kind>_kernel_report.txt``.

    kernel         kind  elements  pointers  must move  moves   idx  uncoalesced
    aot_poi_...    poi   50.3M     2         302.0 MB   302.0 MB i32  ptr0 load of p_1 (stride 512)
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import tempfile
from typing import Any, Optional

import sympy

from .codegen.kernel import texpr
from .indexing import RINDEX, XINDEX
from .ir import ComputedBuffer, ExternCall, StorageView
from .schedule.reads import analyze_reads

# Triton's signature spelling of each element type
POINTER_TYPES = {"tl.float32": "fp32", "tl.float64": "fp64", "tl.float16": "fp16", "tl.bfloat16": "bf16",
                 "tl.int8": "i8", "tl.int16": "i16", "tl.int32": "i32", "tl.int64": "i64", "tl.uint8": "u8",
                 "tl.int1": "i1"}
# lanes sampled along the vector dimension to find an access's stride
SAMPLES = 64
# an access is coalesced when this share of neighbouring lanes read the same or the next element
COALESCED_SHARE = 0.75


@dataclasses.dataclass(frozen=True)
class Access:
    buffer: str
    kind: str  # load | store
    stride: int  # the most common distance between neighbouring lanes, in elements
    coalesced: bool


@dataclasses.dataclass(frozen=True)
class KernelStats:
    name: str
    kind: str
    numel: int
    rnumel: int
    pointers: int
    int64: bool
    must_move: int  # bytes
    moves: int  # bytes
    accesses: tuple  # Access
    registers: Optional[int] = None
    spill_bytes: Optional[int] = None

    @property
    def uncoalesced(self) -> tuple:
        return tuple(a for a in self.accesses if not a.coalesced)


@dataclasses.dataclass(frozen=True)
class KernelReport:
    graph: str
    kernels: tuple  # KernelStats

    def __str__(self) -> str:
        header = ["kernel", "kind", "elements", "ptrs", "must move", "moves", "idx", "regs/spill", "not coalesced"]
        rows = []
        for k in self.kernels:
            registers = "" if k.registers is None else f"{k.registers}/{k.spill_bytes}"
            bad = ", ".join(f"{a.kind} {a.buffer} (stride {a.stride})" for a in k.uncoalesced)
            rows.append([k.name, k.kind, _count(k.numel * k.rnumel), str(k.pointers), _bytes(k.must_move),
                         _bytes(k.moves), "i64" if k.int64 else "i32", registers, bad])
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header] + rows]
        must, moves = sum(k.must_move for k in self.kernels), sum(k.moves for k in self.kernels)
        flagged = sum(1 for k in self.kernels if k.uncoalesced)
        lines.append(f"{self.graph}: {len(self.kernels)} kernels, must move {_bytes(must)}, move {_bytes(moves)}, "
                     f"{flagged} with accesses not coalesced")
        return "\n".join(lines) + "\n"


def kernel_report(compiled: Any, registers: bool = False) -> KernelReport:
    """The report of a ``CompiledGraph`` (``fn.compiled_graph``, ``observe()``) with its records."""
    if compiled.lowered is None or compiled.kernel_plan is None:
        return KernelReport(compiled.kind, ())
    return report_of(compiled.kind, compiled.lowered, compiled.kernel_plan, compiled.kernels, registers)


def report_of(graph: str, lowered: Any, plan: Any, sources: tuple, registers: bool = False,
              reads: Any = None) -> KernelReport:
    reads = reads if reads is not None else analyze_reads(lowered)
    hint = lowered.sizes.hint if lowered.sizes is not None else int
    buffers = _buffers(lowered, hint)
    by_group = {source.group: source for source in sources}
    stats = []
    for group in plan.kernels():
        source = by_group.get(group.name)
        if source is None:
            continue
        stats.append(_kernel_stats(group, source, plan, reads, buffers, hint, registers))
    return KernelReport(graph, tuple(stats))


def _buffers(lowered: Any, hint) -> dict[str, tuple[int, int]]:
    """buffer name -> (elements, bytes per element)."""
    out = {}
    buffers = [b for b in lowered.inputs if b is not None] + list(lowered.constant_buffers.values())
    for op in lowered.operations:
        buffers += [b for b in op.outputs if b is not None] if isinstance(op, ExternCall) else [op]
    for buffer in buffers:
        out[buffer.name] = (hint(buffer.layout.storage_numel()), _itemsize(buffer.dtype))
    return out


def _itemsize(dtype) -> int:
    return dtype.itemsize if hasattr(dtype, "itemsize") else 4


def _kernel_stats(group, source, plan, reads, buffers, hint, registers: bool) -> KernelStats:
    numel, rnumel = hint(group.numel), hint(group.rnumel)
    members = {node.name for node in group.nodes}
    vector = RINDEX if group.is_reduction and group.reduction_contiguous else XINDEX
    loads: dict[tuple[str, str], sympy.Expr] = {}
    for node in group.nodes:
        for name, index in reads.in_kernel(node, group.numel, group.rnumel) or ():
            if name not in members:
                loads.setdefault((name, str(index)), index)
    stores = [(node.name, reads.write_index(node, group.numel, group.rnumel)) for node in group.nodes
              if node.name in plan.stored or node.mutates is not None]
    must = sum(_bytes_of(buffers, name) for name in {name for name, _ in loads})
    must += sum(_elements(index, numel, rnumel) * buffers.get(name, (0, 4))[1] for name, index in stores)
    moves = sum(_elements(index, numel, rnumel) * buffers.get(name, (0, 4))[1] for (name, _), index in loads.items())
    moves += sum(_elements(index, numel, rnumel) * buffers.get(name, (0, 4))[1] for name, index in stores)
    accesses = [_access(name, "load", index, vector, numel, rnumel, hint) for (name, _), index in loads.items()]
    accesses += [_access(name, "store", index, vector, numel, rnumel, hint) for name, index in stores]
    regs = spills = None
    if registers and source.language == "triton":
        regs, spills = sm90_registers(source)
    return KernelStats(source.name, {"pointwise": "poi", "persistent": "per", "looped": "red"}.get(source.kind, source.kind),
                       numel, rnumel, len(source.arguments), bool(source.int64), must, moves, tuple(accesses), regs, spills)


def _bytes_of(buffers: dict, name: str) -> int:
    elements, itemsize = buffers.get(name, (0, 4))
    return elements * itemsize


def _elements(index: sympy.Expr, numel: int, rnumel: int) -> int:
    """Elements an access walks: every (x, r) lane it depends on."""
    symbols = index.free_symbols
    return (numel if XINDEX in symbols else 1) * (rnumel if RINDEX in symbols else 1)


def _access(name: str, kind: str, index: sympy.Expr, vector: sympy.Symbol, numel: int, rnumel: int, hint) -> Access:
    if vector not in index.free_symbols:
        return Access(name, kind, 0, True)  # the same address across lanes: one transaction
    evaluate = _evaluator(index, hint)
    length = min(SAMPLES, numel if vector is XINDEX else rnumel)
    other = {XINDEX: 0, RINDEX: 0}
    deltas = []
    previous = None
    for lane in range(length):
        other[vector] = lane
        address = evaluate(other[XINDEX], other[RINDEX])
        if previous is not None:
            deltas.append(address - previous)
        previous = address
    if not deltas:
        return Access(name, kind, 1, True)
    stride = collections.Counter(deltas).most_common(1)[0][0]
    near = sum(1 for d in deltas if d in (0, 1))
    return Access(name, kind, stride, near >= COALESCED_SHARE * len(deltas))


def _evaluator(index: sympy.Expr, hint):
    """``(x, r) -> address`` for an index expression, as Python integer arithmetic (the same
    printer as the kernels'); size symbols take their hints."""
    text = texpr(index)
    # an index read from a tensor (``indirectN``) is data: lanes are walked as if it were 0
    names = {str(s): 0 if str(s).startswith("indirect") else hint(s)
             for s in index.free_symbols if s not in (XINDEX, RINDEX)}
    code = compile(text, "<index>", "eval")

    def evaluate(x: int, r: int) -> int:
        return eval(code, {"__builtins__": {"min": min, "max": max}}, {**names, "xindex": x, "rindex": r})
    return evaluate


def sm90_registers(source: Any) -> tuple[Optional[int], Optional[int]]:
    """(registers, local-memory bytes per thread: spills and stack arrays) of a Triton kernel
    built for sm_90 with the block sizes its first launch would use, read from the cubin by the
    ``cuobjdump`` Triton ships; (None, None) where that cannot be done on this machine."""
    tool = _cuobjdump()
    if tool is None:
        return None, None
    try:
        import triton
        from triton.backends.compiler import GPUTarget

        compiled = triton.compile(_ast_source(source), target=GPUTarget("cuda", 90, 32))
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "kernel.cubin")
            with open(path, "wb") as handle:
                handle.write(compiled.asm["cubin"])
            out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, timeout=120)
    except Exception:  # noqa: BLE001  (a report never fails a compile)
        return None, None
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out.stdout)
    if usage is None:
        return None, None
    return int(usage.group(1)), int(usage.group(2)) + int(usage.group(3))


def _cuobjdump() -> Optional[str]:
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    except Exception:  # noqa: BLE001
        return None
    return path if os.access(path, os.X_OK) else None


def _ast_source(source: Any):
    """The kernel as Triton's compiler takes it: its module (prelude and helpers), the pointer
    types of its buffers, 32-bit sizes, and the block sizes its first launch would use."""
    import importlib.util
    import sys

    import triton

    from .codegen.triton import TRITON_DTYPE, module_prelude
    from .runtime.launch import candidate_configs

    text = module_prelude(False) + f"\n\n@triton.jit\n{source.source}\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(text)  # @triton.jit reads its function's source from the file
    spec = importlib.util.spec_from_file_location(f"aotforge_report_{source.name}", handle.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    interpret = os.environ.pop("TRITON_INTERPRET", None)  # a compiled kernel, not an interpreted one
    try:
        spec.loader.exec_module(module)
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    kernel = getattr(module, source.name)
    signature = {f"ptr{i}": "*" + POINTER_TYPES[TRITON_DTYPE[dtype]] for i, dtype in enumerate(source.dtypes)}
    interpret = os.environ.pop("TRITON_INTERPRET", None)  # the GPU's block sizes, not the interpreter's
    try:
        config = candidate_configs(source.kind, int(source.numel), int(source.rnumel), source.reduction_contiguous)[0]
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    blocks = {k: v for k, v in config.items() if k.isupper()}
    for name in kernel.arg_names:
        if name not in signature:
            signature[name] = "constexpr" if name in blocks else "i32"
    return triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=blocks)


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
