"""``load(...) -> CompiledGraph``: the last stage. It imports each kernel (one module per
distinct kernel source, shared by every graph of the process), binds the launchers and runs
the wrapper's source; the result carries every record that led to it and the compile-time
breakdown, so that what the compiler did can be printed after the fact."""
from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch

from ..codegen.cpp import translation_unit
from ..codegen.kernel import KernelSource
from ..codegen.triton import module_prelude
from ..codegen.wrapper import Program
from ..ir import LoweredGraph
from ..schedule import KernelPlan, MemoryPlan
from . import direct, launch, modules

# launchers by (kernel source name, numel, rnumel): identical kernels of any graph share one,
# so each is compiled and autotuned once while some graph uses it; a launcher (with its
# module) goes when the last graph using it does
_launchers: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()
_launchers_lock = threading.Lock()


@dataclasses.dataclass
class CompiledGraph:
    """A compiled graph: the callable (boxed: takes one list of arguments) and its records."""

    kind: str  # forward | backward | inference
    call: Callable[[list], Any]
    lowered: Optional[LoweredGraph]
    kernel_plan: Optional[KernelPlan]
    memory_plan: Optional[MemoryPlan]
    kernels: tuple  # KernelSource per kernel group
    program: Optional[Program]
    launchers: dict  # group name -> launch.Kernel
    timings: dict  # stage -> seconds, in the order the stages ran
    # seconds the compile pool's workers spent on this graph's kernels (in parallel, so not
    # part of the stages above: compare with pool_wait to see whether the pool kept up)
    pool_seconds: float = 0.0
    # the CUDA graphs that replay it (runtime/cudagraphs.py), when config.cudagraphs is on
    cudagraphs: Any = None
    # loaded from the compiled-graph cache: no lowering records, only their counts
    cached_stats: Optional[dict] = None

    # the code generator's language, which names the path of a graph with no kernels at all
    # (a CPU graph of library calls alone is still on the C++ path)
    language: str = "triton"

    @property
    def path(self) -> str:
        if self.program is None:
            return "aten"
        return self.kernels[0].language if self.kernels else self.language

    @property
    def wrapper_source(self) -> str:
        return self.program.source if self.program is not None else ""

    @property
    def kernel_source(self) -> str:
        """Every distinct kernel of the graph, as one module's (or translation unit's) text."""
        unique = {k.name: k.source for k in self.kernels}
        if self.kernels and self.kernels[0].language == "cpp":
            return translation_unit(list(unique.values()))
        return module_prelude(modules.interpreting()) + "\n\n" + "\n\n".join(
            f"@triton.jit\n{text}\n" for text in unique.values())

    @property
    def stats(self) -> dict:
        if self.program is None:
            return dict(path="aten", kind=self.kind, kernels=0, seconds=sum(self.timings.values()))
        if self.cached_stats is not None:
            counts = dict(self.cached_stats)
        else:
            counts = dict(externs=len(self.kernel_plan.steps) - len(self.kernels), lowered=dict(self.lowered.lowered_ops),
                          fallbacks=dict(self.lowered.fallback_ops), lowering_errors=list(self.lowered.lowering_errors))
        return dict(path=self.path, kind=self.kind, kernels=len(self.kernels), unique_kernels=len({k.name for k in self.kernels}),
                    **counts, wrapper=self.wrapper_source,
                    kernel_source=self.kernel_source, seconds=sum(self.timings.values()), timings=dict(self.timings))

    def describe_timings(self) -> str:
        total = sum(self.timings.values())
        parts = ", ".join(f"{stage} {seconds:.3f}s" for stage, seconds in self.timings.items())
        pool = f"; compile pool workers: {self.pool_seconds:.3f}s in parallel" if self.pool_seconds else ""
        return f"{self.kind} graph: {total:.3f}s ({parts}){pool}"

    def __str__(self) -> str:
        sections = [f"# {self.kind} graph, {self.path} path", self.describe_timings()]
        if self.cached_stats is not None:
            sections.append("(loaded from the compiled-graph cache: no lowering records)")
        for title, record in (("lowered graph", self.lowered), ("kernel plan", self.kernel_plan),
                              ("memory plan", self.memory_plan)):
            if record is not None:
                sections.append(f"## {title}\n{record}")
        if self.kernels:
            sections.append(f"## kernels\n{self.kernel_source}")
        if self.program is not None:
            sections.append(f"## wrapper\n{self.program}")
        if self.cudagraphs is not None:
            sections.append(f"## CUDA graphs\n{self.cudagraphs}")
        return "\n\n".join(sections)


def triton_kernels(kernels: tuple, precompile: bool = True) -> dict:
    """The Triton target's loader: each kernel group's launcher. Longest sources first: each
    launcher hands its kernel to the compile pool as it is made, and starting the slowest
    compiles first keeps the pool's last round short."""
    return {source.group: triton_launcher(source, precompile) for source in sorted(kernels, key=lambda k: -len(k.source))}


def _cpp_kernels(kernels: tuple, precompile: bool = True) -> dict:
    from . import cpp_launch  # loaded with the first C++ graph

    return cpp_launch.load_kernels(kernels, precompile)


# each kernel language's loader: kernel sources -> {kernel group: launcher with run(*arguments)}
LOADERS: dict[str, Callable[..., dict]] = {"triton": triton_kernels, "cpp": _cpp_kernels}


def triton_launcher(source: KernelSource, precompile: bool = True) -> Any:
    """The Triton target's loader: the launcher (``launch.Kernel``) of one kernel source,
    shared by identical kernels of every graph. ``precompile``: hand it to the compile pool."""
    key = (source.name, source.numel, source.rnumel)
    with _launchers_lock:
        found = _launchers.get(key)
        if found is not None:
            return found
    module = modules.load_module(module_prelude(modules.interpreting()) + f"\n\n@triton.jit\n{source.source}\n",
                                source.name)
    # with the argument dtypes the kernel is handed to the compile pool at once (GPU only)
    kernel = launch.Kernel(getattr(module, source.name), source.name, source.source, source.kind, source.numel,
                           source.rnumel, source.reduction_contiguous, source.mutates,
                           arg_dtypes=None if None in source.dtypes or not precompile else source.dtypes,
                           hints=source.hints if source.dynamic else None)
    kernel.module = module  # the module lives as long as a kernel of it
    with _launchers_lock:
        return _launchers.setdefault(key, kernel)


def load(kind: str, lowered: LoweredGraph, plan: KernelPlan, memory: MemoryPlan, kernels: tuple,
         program: Program, timings: dict, run_aten_graph: Optional[Callable[[list], Any]] = None,
         launcher: Optional[Callable[[KernelSource], Any]] = None, precompile: bool = True,
         language: str = "triton") -> CompiledGraph:
    """``run_aten_graph``: the graph's own ATen calls, for a call whose symbolic sizes are
    too large for the kernels' 32-bit indexing. The kernels are loaded by their language's
    loader (``LOADERS``), or by ``launcher`` (a target of the caller's own: one object with
    ``run(*arguments)`` per kernel source). ``precompile`` (Triton): hand the kernels to the
    compile pool (False for a graph from the compiled-graph cache: Triton's cache holds its
    binaries, and loading one at the first launch is quicker than a worker's round trip)."""
    started = time.perf_counter()
    if launcher is not None:
        launchers = {source.group: launcher(source) for source in kernels}
    else:
        launchers = LOADERS[kernels[0].language if kernels else "triton"](kernels, precompile)
    namespace = dict(program.namespace)
    # the wrapper calls each Triton kernel through a call site of this graph (direct.CallSite)
    namespace.update({group: direct.CallSite(k) if isinstance(k, launch.Kernel) else k for group, k in launchers.items()})
    namespace.update(torch=torch, empty_strided=torch.empty_strided, empty_strided_cpu=launch.empty_strided_cpu,
                     empty_strided_cuda=launch.empty_strided_cuda, reinterpret_tensor=launch.reinterpret_tensor,
                     ensure_layout=launch.ensure_layout, check_mutated_input=launch.check_mutated_input,
                     run_aten_graph=run_aten_graph, input_layouts=launch.InputLayouts())
    if kernels and kernels[0].language == "cpp":  # the wrapper launches runs of kernels (cpp_entry.py)
        from . import cpp_launch

        namespace["launch_kernels"], namespace["kernel_error"] = cpp_launch.graph_entry(kernels, launchers)
    code = compile(program.source, f"<aotforge {kind} wrapper>", "exec")
    exec(code, namespace)
    timings["load"] = time.perf_counter() - started
    return CompiledGraph(kind, namespace["call"], lowered, plan, memory, kernels, program, launchers, timings,
                         language=language)
