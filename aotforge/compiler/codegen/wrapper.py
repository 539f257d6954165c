"""The generated Python wrapper: allocates buffers, launches kernels, calls ATen externs,
frees buffers after their last use (handing their memory to later buffers of the same size)
and returns the outputs. Example (a layer norm)::

    def call(args):
        primals_1, primals_2, primals_3 = args
        args.clear()
        buf2 = empty_strided((16, 64), (64, 1), device=device_0, dtype=torch.float32)
        kernel0.run(primals_1, primals_2, primals_3, buf2)
        del primals_1
        return (buf2,)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .. import ir
from ..ir import ComputedBuffer, ExternCall, InputBuffer, StorageView
from ..lowering.graph import GraphLowering
from ..scheduler import KernelGroup, Schedule, reads_in_kernel
from .triton import TritonKernel, module_prelude


@dataclasses.dataclass
class CompiledGraph:
    call: Callable[[list], Any]
    wrapper_source: str
    kernel_source: str
    kernel_count: int
    extern_count: int
    kernels: list = dataclasses.field(default_factory=list)  # runtime.launch.Kernel objects


def _ints(values) -> tuple:
    return tuple(int(v) for v in values)


class WrapperCodegen:
    def __init__(self, graph: GraphLowering, plan: Schedule, interpret: bool):
        self.graph, self.plan, self.interpret = graph, plan, interpret
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = {}
        self.devices: dict[str, str] = {}
        self.buffers: dict[str, Any] = {}
        for op in graph.operations:
            if isinstance(op, ComputedBuffer) and op.mutates is None:
                self.buffers[op.name] = op
            elif isinstance(op, ExternCall):
                for out in op.outputs:
                    if out is not None:
                        self.buffers[out.name] = out
        for buffer in graph.inputs:
            if buffer is not None:
                self.buffers[buffer.name] = buffer
        self.namespace.update(graph.constants)
        self.buffers.update(graph.constant_buffers)

    # --- rendering values as Python source ----------------------------------------------

    def device(self, device: torch.device) -> str:
        key = str(device)
        if key not in self.devices:
            name = f"device_{len(self.devices)}"
            self.devices[key] = name
            self.namespace[name] = torch.device(device)
        return self.devices[key]

    def view(self, value: StorageView) -> str:
        buffer = value.buffer
        layout = buffer.layout
        if (_ints(value.size) == _ints(layout.size) and _ints(value.stride) == _ints(layout.stride)
                and int(value.offset) == int(layout.offset)):
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

    # --- the program ----------------------------------------------------------------------

    def generate(self) -> CompiledGraph:
        graph, plan = self.graph, self.plan
        names = [b.name if b is not None else f"arg_{i}" for i, b in enumerate(graph.inputs)]
        self.lines += ["def call(args):", f"    {', '.join(names)}{',' if len(names) == 1 else ''} = args",
                       "    args.clear()"]
        mutated = {op.name for op in graph.operations if isinstance(op, ComputedBuffer) and op.mutates is not None}
        for buffer in graph.inputs:
            if buffer is not None and buffer.layout.size:
                check = "check_mutated_input" if buffer.name in mutated else "ensure_layout"
                self.lines.append(f"    {buffer.name} = {check}({buffer.name}, {_ints(buffer.layout.size)}, "
                                  f"{_ints(buffer.layout.stride)})")
        kernels: list[str] = []
        buffer_dtypes = {name: b.dtype for name, b in self.buffers.items()}
        buffer_numels = {name: b.layout.storage_numel() for name, b in self.buffers.items()}
        freed: list[str] = []  # memory free for reuse: allocated buffers after their last use
        # an ATen call may return a view of its argument: such arguments keep their memory
        no_reuse = {n for s in plan.steps if isinstance(s, ExternCall) and _may_alias(s) for n in _extern_arg_names(s)}
        kernel_count = extern_count = 0
        for position, step in enumerate(plan.steps):
            if isinstance(step, KernelGroup):
                kernel_count += 1
                kernel = TritonKernel(step, plan.stored, buffer_numels)
                reads = {n.name: {name for name, _ in reads_in_kernel(n, step.numel, step.rnumel) or []}
                         for n in step.nodes}
                source = kernel.generate(buffer_dtypes, reads)
                kernels.append(f"@triton.jit\n{source.source}\n")
                for buffer in step.nodes:
                    if buffer.mutates is None and buffer.name in plan.stored:
                        self._allocate(buffer, freed)
                self.lines.append(f"    {source.name}.run({', '.join(source.arguments)})")
                self.namespace.setdefault("_kernel_sources", {})[source.name] = source
            else:
                extern_count += 1
                self._extern(step)
            for name in plan.frees.get(position, []):
                if name in graph.constants:
                    continue  # module-level: nothing to free
                buffer = self.buffers.get(name)
                if isinstance(buffer, ComputedBuffer) and name not in no_reuse:
                    freed.append(name)  # kept alive until a buffer of the same size takes it
                else:
                    self.lines.append(f"    del {name}")
        outputs = [self.literal(v) for v in graph.outputs]
        self.lines.append(f"    return ({', '.join(outputs)}{',' if len(outputs) == 1 else ''})")
        kernel_source = module_prelude(self.interpret) + "\n\n" + "\n\n".join(kernels)
        wrapper_source = "\n".join(self.lines) + "\n"
        call, kernel_objects = self._load(kernel_source, wrapper_source)
        return CompiledGraph(call, wrapper_source, kernel_source, kernel_count, extern_count, kernel_objects)

    def _allocate(self, buffer: ComputedBuffer, freed: list[str]) -> None:
        size, stride = _ints(buffer.layout.size), _ints(buffer.layout.stride)
        for candidate in freed:
            old = self.buffers[candidate]
            if (old.dtype, old.device, old.layout.storage_numel()) == (buffer.dtype, buffer.device, buffer.layout.storage_numel()):
                freed.remove(candidate)
                self.lines.append(f"    {buffer.name} = reinterpret_tensor({candidate}, {size}, {stride}, "
                                  f"0); del {candidate}  # reuse")
                self.plan.reuse[buffer.name] = candidate
                return
        self.lines.append(f"    {buffer.name} = empty_strided({size}, {stride}, device={self.device(buffer.device)}, "
                          f"dtype={buffer.dtype})")

    def _extern(self, call: ExternCall) -> None:
        op = call.op
        if isinstance(op, torch._ops.OpOverload) and op.namespace in ("aten", "prims"):
            target = f"torch.ops.{op.namespace}.{op._schema.name.split('::')[1]}.{op._overloadname}"
        else:
            target = self.literal(op)
        arguments = [self.literal(a) for a in call.args] + [f"{k}={self.literal(v)}" for k, v in call.kwargs.items()]
        self.lines.append(f"    {call.name} = {target}({', '.join(arguments)})")
        for out in call.outputs:
            if out is None:
                continue
            source = call.name if call.single_output else f"{call.name}[{out.output_index}]"
            self.lines.append(f"    {out.name} = ensure_layout({source}, {_ints(out.layout.size)}, {_ints(out.layout.stride)})")
        self.lines.append(f"    del {call.name}")

    def _load(self, kernel_source: str, wrapper_source: str) -> tuple[Callable, list]:
        from ..runtime import launch

        module = launch.load_module(kernel_source, "kernels")
        namespace = dict(self.namespace)
        sources = namespace.pop("_kernel_sources", {})
        for name, source in sources.items():
            dtypes = [getattr(self.buffers.get(argument), "dtype", None) for argument in source.arguments]
            namespace[name] = launch.Kernel(getattr(module, name), name, source.source, source.kind, source.numel,
                                            source.rnumel, source.reduction_contiguous, source.mutates,
                                            # hands the kernel to the compile pool (GPU only)
                                            arg_dtypes=None if None in dtypes else dtypes)
        namespace.update(torch=torch, empty_strided=torch.empty_strided, reinterpret_tensor=launch.reinterpret_tensor,
                         ensure_layout=launch.ensure_layout, check_mutated_input=launch.check_mutated_input)
        code = compile(wrapper_source, f"<aotforge wrapper {id(self)}>", "exec")
        exec(code, namespace)
        return namespace["call"], [namespace[name] for name in sources]


def _may_alias(call: ExternCall) -> bool:
    op = call.op
    if isinstance(op, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in op._schema.returns)
    return True


def _extern_arg_names(call: ExternCall) -> set[str]:
    from ..scheduler import extern_reads

    return extern_reads(call)


_ = (ir, InputBuffer)
