"""``emit_wrapper(lowered, plan, memory, kernels) -> Program``: the Python program that runs a
compiled graph. It checks input layouts, allocates buffers as the memory plan says, launches
kernels, calls ATen for extern calls, frees buffers after their last use and returns the
outputs. Example (a layer norm)::

    def call(args):
        primals_1, primals_2, primals_3 = args
        args.clear()
        primals_1 = ensure_layout(primals_1, (16, 64), (64, 1))
        buf2 = empty_strided((16, 64), (64, 1), device=device_0, dtype=torch.float32)
        kernel0.run(primals_1, primals_2, primals_3, buf2)
        del primals_1
        return (buf2,)

The program only renders decisions made by earlier stages; it decides nothing itself.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..ir import ComputedBuffer, ExternCall, LoweredGraph, StorageView
from ..schedule import KernelGroup, KernelPlan, MemoryPlan
from .triton import KernelSource


@dataclasses.dataclass(frozen=True)
class Program:
    """The wrapper's source and the objects it refers to by name (devices, constants, callables
    that are not ATen ops). Kernels are bound by the loader under their group names."""

    source: str
    namespace: dict

    def __str__(self) -> str:
        return self.source


def _ints(values) -> tuple:
    return tuple(int(v) for v in values)


class _Writer:
    def __init__(self, lowered: LoweredGraph):
        self.lowered = lowered
        self.buffers = lowered.buffers()
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = dict(lowered.constants)
        self.devices: dict[str, str] = {}

    def device(self, device: torch.device) -> str:
        key = str(device)
        if key not in self.devices:
            self.devices[key] = f"device_{len(self.devices)}"
            self.namespace[self.devices[key]] = torch.device(device)
        return self.devices[key]

    def view(self, value: StorageView) -> str:
        buffer, layout = value.buffer, value.buffer.layout
        if (_ints(value.size), _ints(value.stride), int(value.offset)) == (_ints(layout.size), _ints(layout.stride),
                                                                           int(layout.offset)):
            return buffer.name
        return (f"reinterpret_tensor({buffer.name}, {_ints(value.size)}, {_ints(value.stride)}, "
                f"{int(value.offset) - int(layout.offset)})")

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
        if isinstance(obj, torch.SymInt):
            return repr(int(obj))
        name = f"constant_{len(self.namespace)}"
        self.namespace[name] = obj
        return name

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def inputs(self, mutated: set[str]) -> None:
        names = [b.name if b is not None else f"arg_{i}" for i, b in enumerate(self.lowered.inputs)]
        self.lines.append("def call(args):")
        self.emit(f"{', '.join(names) or '()'}{',' if len(names) == 1 else ''} = args")
        self.emit("args.clear()")
        for buffer in self.lowered.inputs:
            if buffer is not None and buffer.layout.size:
                check = "check_mutated_input" if buffer.name in mutated else "ensure_layout"
                self.emit(f"{buffer.name} = {check}({buffer.name}, {_ints(buffer.layout.size)}, "
                          f"{_ints(buffer.layout.stride)})")

    def allocate(self, name: str, reuses: Any) -> None:
        buffer = self.buffers[name]
        size, stride = _ints(buffer.layout.size), _ints(buffer.layout.stride)
        if reuses is not None:
            self.emit(f"{name} = reinterpret_tensor({reuses}, {size}, {stride}, 0); del {reuses}  # reuse")
        else:
            self.emit(f"{name} = empty_strided({size}, {stride}, device={self.device(buffer.device)}, "
                      f"dtype={buffer.dtype})")

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
            source = call.name if call.single_output else f"{call.name}[{out.output_index}]"
            self.emit(f"{out.name} = ensure_layout({source}, {_ints(out.layout.size)}, {_ints(out.layout.stride)})")
        self.emit(f"del {call.name}")


def emit_wrapper(lowered: LoweredGraph, plan: KernelPlan, memory: MemoryPlan,
                 kernels: tuple[KernelSource, ...]) -> Program:
    """The codegen stage for the wrapper: render the plan and the memory plan as Python."""
    writer = _Writer(lowered)
    mutated = {op.name for op in lowered.operations if isinstance(op, ComputedBuffer) and op.mutates is not None}
    writer.inputs(mutated)
    sources = {k.group: k for k in kernels}
    for index, step in enumerate(plan.steps):
        for allocation in memory.allocations.get(index, ()):
            writer.allocate(allocation.buffer, allocation.reuses)
        if isinstance(step, KernelGroup):
            writer.emit(f"{step.name}.run({', '.join(sources[step.name].arguments)})")
        else:
            writer.extern(step)
        for name in memory.frees.get(index, ()):
            writer.emit(f"del {name}")
    outputs = [writer.literal(v) for v in lowered.outputs]
    writer.emit(f"return ({', '.join(outputs)}{',' if len(outputs) == 1 else ''})")
    return Program("\n".join(writer.lines) + "\n", writer.namespace)
