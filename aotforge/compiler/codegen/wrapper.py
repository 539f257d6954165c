"""``emit_wrapper(lowered, plan, memory, kernels) -> Program``: the Python program that runs a
compiled graph. It checks input layouts, allocates buffers as the memory plan says, launches
kernels, calls ATen for extern calls, frees buffers after their last use and returns the
outputs. Example (a layer norm)::

    def call(args):
        primals_1, primals_2, primals_3 = args
        args.clear()
        primals_1 = ensure_layout(primals_1, (16, 64), (64, 1))
        buf2 = empty_strided_cpu((16, 64), (64, 1), torch.float32)
        kernel0.run(primals_1, primals_2, primals_3, buf2)
        del primals_1
        return (buf2,)

On the CPU the inputs of static layout are checked at once (``input_layouts``, below) and each
run of consecutive C++ kernels is one call into the graph's translation unit::

        if not input_layouts.check(primals_1, primals_2, primals_3):
            primals_1 = ensure_layout(primals_1, (16, 64), (64, 1))
            ...
            input_layouts.remember(primals_1, primals_2, primals_3)
        buf2 = empty_strided_cpu((16, 64), (64, 1), torch.float32)
        if aot_failed := launch_kernels(0, primals_1, primals_2, primals_3, buf2): raise kernel_error(aot_failed)

The program only renders decisions made by earlier stages; it decides nothing itself.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

import sympy

from ..ir import ComputedBuffer, ExternCall, LoweredGraph, StorageView, same_size
from ..schedule import KernelGroup, KernelPlan, MemoryPlan
from .kernel import KernelSource, texpr


@dataclasses.dataclass(frozen=True)
class Program:
    """The wrapper's source and the objects it refers to by name (devices, constants, callables
    that are not ATen ops). Kernels are bound by the loader under their group names."""

    source: str
    namespace: dict

    def __str__(self) -> str:
        return self.source


def _sizes(values) -> str:
    """A tuple of sizes as Python source: numbers, or expressions of the size symbols the
    wrapper bound at its top (``(s0, 32)``)."""
    texts = [pyexpr(v) for v in values]
    return f"({', '.join(texts)}{',' if len(texts) == 1 else ''})"


def pyexpr(value: Any) -> str:
    value = sympy.sympify(value)
    return str(int(value)) if value.is_Integer else texpr(value)


INT32_MAX = 2**31 - 1
# the wrapper's two shortcuts (False: as before them, for A/B timing): one check of every
# input of static layout (launch.InputLayouts), and each run of consecutive C++ kernels as
# one call (codegen/cpp_entry.py)
CHECK_INPUTS_ONCE = True
RUN_KERNELS_TOGETHER = True
# Frees and fresh allocations of fewer bytes do not end a run of kernels (_kernel_runs)
SMALL_BUFFER_BYTES = 4096


class _Writer:
    def __init__(self, lowered: LoweredGraph):
        self.lowered = lowered
        self.buffers = lowered.buffers()
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = dict(lowered.constants)
        self.devices: dict[str, str] = {}
        # the graph's GPU when all its GPU buffers are on one (allocated on the fast path)
        gpus = {b.device for b in self.buffers.values() if b.device.type == "cuda"}
        self.cuda_device = next(iter(gpus)) if len(gpus) == 1 and next(iter(gpus)).index is not None else None

    def device(self, device: torch.device) -> str:
        key = str(device)
        if key not in self.devices:
            self.devices[key] = f"device_{len(self.devices)}"
            self.namespace[self.devices[key]] = torch.device(device)
        return self.devices[key]

    def view(self, value: StorageView) -> str:
        buffer, layout = value.buffer, value.buffer.layout
        if (len(value.size) == len(layout.size) and all(map(same_size, value.size, layout.size))
                and all(map(same_size, value.stride, layout.stride)) and same_size(value.offset, layout.offset)):
            return buffer.name
        return (f"reinterpret_tensor({buffer.name}, {_sizes(value.size)}, {_sizes(value.stride)}, "
                f"{pyexpr(sympy.expand(value.offset - layout.offset))})")

    def literal(self, obj: Any) -> str:
        if isinstance(obj, StorageView):
            return self.view(obj)
        if isinstance(obj, (list, tuple)):
            inner = ", ".join(self.literal(o) for o in obj)
            return f"[{inner}]" if isinstance(obj, list) else f"({inner}{',' if len(obj) == 1 else ''})"
        if isinstance(obj, torch.dtype):
            return str(obj)
        if isinstance(obj, torch.device):
            return self.device(obj)
        if isinstance(obj, (torch.memory_format, torch.layout)):
            return str(obj)
        if obj is None or isinstance(obj, (bool, int, str)):
            return repr(obj)
        if isinstance(obj, float):
            return repr(obj) if obj == obj and abs(obj) != float("inf") else f"float('{obj}')"
        if isinstance(obj, sympy.Expr):  # a symbolic size (an argument, or a graph output)
            return pyexpr(obj)
        name = f"constant_{len(self.namespace)}"
        self.namespace[name] = obj
        return name

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def inputs(self, mutated: set[str], overflow_checks: list) -> None:
        """Unpack the arguments, read the size symbols from them (once per call) and check
        the input layouts. ``overflow_checks``: sizes that kernels index with 32-bit
        arithmetic; a call whose sizes exceed it runs the graph's ATen calls instead."""
        names = [b.name if b is not None else f"arg_{i}" for i, b in enumerate(self.lowered.inputs)]
        self.lines.append("def call(args):")
        self.emit(f"{', '.join(names) or '()'}{',' if len(names) == 1 else ''} = args")
        sizes = self.lowered.sizes
        for symbol, source in (sizes.sources.items() if sizes is not None else ()):
            kind, position = source[0], names[source[1]]
            read = {"int": position, "size": f"{position}.size({source[-1]})",
                    "stride": f"{position}.stride({source[-1]})", "offset": f"{position}.storage_offset()"}[kind]
            self.emit(f"{symbol} = {read}")
        if overflow_checks:
            bound = overflow_checks[0] if len(overflow_checks) == 1 else f"max({', '.join(overflow_checks)})"
            self.emit(f"if {bound} > {INT32_MAX}:")
            self.emit("    return run_aten_graph(args)  # sizes past 32-bit indexing")
        self.emit("args.clear()")
        checked = [b for b in self.lowered.inputs if b is not None and b.layout.size]
        # CPU inputs of static layout: one check of them all (launch.InputLayouts) skips their
        # per-input checks when each is laid out as in the last call that ran them (a GPU
        # graph's Python hides behind its kernels, and CUDA graphs replay without it)
        static = [b.name for b in checked
                  if b.device.type == "cpu" and _static(b.layout.size) and _static(b.layout.stride)]
        guarded = set(static) if len(static) > 1 and CHECK_INPUTS_ONCE else set()
        if guarded:
            self.emit(f"if not input_layouts.check({', '.join(static)}):")
            checked = [b for b in checked if b.name in guarded] + [b for b in checked if b.name not in guarded]
        for buffer in checked:
            check = "check_mutated_input" if buffer.name in mutated else "ensure_layout"
            indent = "    " if buffer.name in guarded else ""
            self.emit(f"{indent}{buffer.name} = {check}({buffer.name}, {_sizes(buffer.layout.size)}, "
                      f"{_sizes(buffer.layout.stride)})")
            if guarded and buffer.name == static[-1]:
                self.emit(f"    input_layouts.remember({', '.join(static)})")

    def allocate(self, name: str, reuses: Any, in_place: bool = False, deferred: "list | None" = None) -> None:
        """``deferred``: the names to delete after a run of kernels (``kernel_run``) instead of here."""
        buffer = self.buffers[name]
        size, stride = _sizes(buffer.layout.size), _sizes(buffer.layout.stride)
        if reuses is not None and in_place:  # the kernel still reads it; deleted after the kernel
            self.emit(f"{name} = reinterpret_tensor({reuses}, {size}, {stride}, 0)  # in place")
        elif reuses is not None and deferred is not None:  # an earlier kernel of the run still reads it
            self.emit(f"{name} = reinterpret_tensor({reuses}, {size}, {stride}, 0)  # reuse")
            deferred.append(reuses)
        elif reuses is not None:
            self.emit(f"{name} = reinterpret_tensor({reuses}, {size}, {stride}, 0); del {reuses}  # reuse")
        elif buffer.device.type == "cpu" or buffer.device == self.cuda_device:
            # torch's allocation fast path, past the dispatcher (a CUDA one allocates on the
            # current device: the call runs under a guard for the graph's device, see guard_device)
            self.emit(f"{name} = empty_strided_{buffer.device.type}({size}, {stride}, {buffer.dtype})")
        else:
            self.emit(f"{name} = empty_strided({size}, {stride}, device={self.device(buffer.device)}, "
                      f"dtype={buffer.dtype})")

    def kernel_run(self, steps: range, plan: KernelPlan, memory: MemoryPlan, sources: dict, positions: dict) -> None:
        """Consecutive C++ kernels as one call (codegen/cpp_entry.py): every buffer of the run is
        allocated before it, and nothing is freed until it returns: a buffer freed between two
        of its kernels could be handed by the allocator to a later buffer of the same run while
        the call still holds its address."""
        deferred: list[str] = []
        arguments = []
        for index in steps:
            for allocation in memory.allocations.get(index, ()):
                self.allocate(allocation.buffer, allocation.reuses, allocation.in_place, deferred)
            name = plan.steps[index].name
            arguments += [str(positions[name]), *_launch_arguments(sources[name])]
        self.emit(f"if aot_failed := launch_kernels({', '.join(arguments)}): raise kernel_error(aot_failed)")
        for index in steps:
            deferred += memory.frees.get(index, ())
        if deferred:
            self.emit(f"del {', '.join(dict.fromkeys(deferred))}")

    def extern(self, call: ExternCall) -> None:
        op = call.op
        if isinstance(op, torch._ops.OpOverload) and op.namespace in ("aten", "prims"):
            target = f"torch.ops.{op.namespace}.{op._schema.name.split('::')[1]}.{op._overloadname}"
        else:
            target = self.literal(op)
        arguments = [self.literal(a) for a in call.args] + [f"{k}={self.literal(v)}" for k, v in call.kwargs.items()]
        self.emit(f"{call.name} = {target}({', '.join(arguments)})")
        for out in call.outputs:
            if out is None:
                continue
            source = call.name + "".join(f"[{i}]" for i in out.output_index or ())
            self.emit(f"{out.name} = ensure_layout({source}, {_sizes(out.layout.size)}, {_sizes(out.layout.stride)})")
        self.emit(f"del {call.name}")


def emit_wrapper(lowered: LoweredGraph, plan: KernelPlan, memory: MemoryPlan,
                 kernels: tuple[KernelSource, ...]) -> Program:
    """The codegen stage for the wrapper: render the plan and the memory plan as Python."""
    writer = _Writer(lowered)
    mutated = {op.name for op in lowered.operations if isinstance(op, ComputedBuffer) and op.mutates is not None}
    writer.inputs(mutated, _overflow_checks(lowered, kernels))
    sources = {k.group: k for k in kernels}
    # C++ kernels: each run of consecutive kernels is one call into the translation unit
    together = RUN_KERNELS_TOGETHER and kernels and all(k.language == "cpp" for k in kernels)
    runs = _kernel_runs(plan.steps, memory, writer.buffers) if together else {}
    positions = {k.group: i for i, k in enumerate(kernels)}
    skip_to = 0
    for index, step in enumerate(plan.steps):
        if index < skip_to:
            continue
        if index in runs:
            skip_to = runs[index]
            writer.kernel_run(range(index, skip_to), plan, memory, sources, positions)
            continue
        for allocation in memory.allocations.get(index, ()):
            writer.allocate(allocation.buffer, allocation.reuses, allocation.in_place)
        if isinstance(step, KernelGroup):
            writer.emit(f"{step.name}.run({', '.join(_launch_arguments(sources[step.name]))})")
        else:
            writer.extern(step)
        for name in memory.frees.get(index, ()):
            writer.emit(f"del {name}")
    outputs = [writer.literal(v) for v in lowered.outputs]
    writer.emit(f"return ({', '.join(outputs)}{',' if len(outputs) == 1 else ''})")
    lines = guard_device(writer.lines, writer.cuda_device)
    return Program("\n".join(lines) + "\n", writer.namespace)


def _kernel_runs(steps, memory: MemoryPlan, buffers: dict) -> dict[int, int]:
    """The runs of consecutive kernel steps: {first step: the step after the run}. A run ends
    before a kernel that allocates a new buffer after an earlier kernel of the run freed one
    (frees wait for the run's end): the allocator then sees the allocations and frees in the
    memory plan's order, and can hand the freed memory on as before (a convolution net's
    backward was 1-2% slower with such runs, its large buffers taken anew from the system).
    Buffers under ``SMALL_BUFFER_BYTES`` do not count: MobileNetV3's 34 BatchNorm counters
    (``num_batches_tracked + 1``, each freeing the old one's reference) were 34 calls, not one."""
    def large(names) -> bool:
        return any(_nbytes(buffers.get(name)) >= SMALL_BUFFER_BYTES for name in names)

    runs: dict[int, int] = {}
    start, freed = None, False
    for index, step in enumerate([*steps, None]):
        kernel = isinstance(step, KernelGroup)
        fresh = kernel and large(a.buffer for a in memory.allocations.get(index, ()) if a.reuses is None)
        if start is not None and (not kernel or (freed and fresh)):
            runs[start], start = index, None
        if kernel:
            start, freed = (index, False) if start is None else (start, freed)
            freed = freed or large(memory.frees.get(index, ()))
    return runs


def _nbytes(buffer: Any) -> float:
    """A buffer's size in bytes; infinite when not known (symbolic sizes, no such buffer)."""
    try:
        return math.prod(int(n) for n in buffer.layout.size) * buffer.dtype.itemsize
    except (AttributeError, TypeError):
        return math.inf


def guard_device(lines: list[str], device: "torch.device | None") -> list[str]:
    """The body of ``call`` under a guard that makes ``device`` the current GPU: the fast
    allocations are made on the current device, and Triton launches on it."""
    if device is None:
        return lines
    return [lines[0], f"    with torch.cuda._DeviceGuard({device.index}):", *("    " + line for line in lines[1:])]


def _static(values) -> bool:
    return all(sympy.sympify(v).is_Integer for v in values)


def _launch_arguments(kernel: KernelSource) -> list[str]:
    """The buffers, then for a kernel of symbolic sizes the values of its size symbols and
    its two sizes (a static kernel knows its sizes)."""
    if not kernel.dynamic:
        return list(kernel.arguments)
    sizes = [pyexpr(kernel.numel)] + ([pyexpr(kernel.rnumel)] if kernel.kind != "pointwise" else [])
    return list(kernel.arguments) + [s.name for s in kernel.size_symbols] + sizes


def _overflow_checks(lowered: LoweredGraph, kernels: tuple) -> list[str]:
    """Symbolic sizes that kernels with 32-bit indexing address (see ``inputs``)."""
    if not any(k.dynamic and not k.int64 for k in kernels):
        return []
    spans = {b.layout.storage_numel() for b in lowered.buffers().values()}
    spans |= {sympy.expand(sympy.sympify(k.numel) * k.rnumel) for k in kernels}
    return sorted(pyexpr(e) for e in spans if not sympy.sympify(e).is_Integer)
