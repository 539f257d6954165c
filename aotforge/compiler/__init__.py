"""aotforge's compiler: FX graph of ATen ops -> fused Triton kernels + a Python wrapper.

``compile_fx_inner`` (pipeline.py) is a flat list of stages, each a function from one frozen,
printable record to the next::

    passes/              post-grad FX graph: DCE, CSE, view->reshape, no-op removal, constant
                         folding, pattern rewrites, in-place -> functional
    lowering/            lower(gm) -> LoweredGraph (ir.py): buffers whose bodies are written
                         against ``ops`` (ops.py) and captured once as records (body.py); ATen
                         op -> IR through one table (LOWERINGS); anything else -> an ATen extern call
    schedule/            analyze_reads -> BufferReads; fuse -> KernelPlan; plan_memory -> MemoryPlan
    codegen/kernel.py    emit_kernels -> KernelSource per kernel (pointwise, persistent or looped),
                         spelled by a target's printer (codegen/triton.py)
    codegen/wrapper.py   emit_wrapper -> Program: the Python that allocates, launches, calls ATen, frees
    runtime/             load -> CompiledGraph (compiled.py); kernel modules (modules.py), launch,
                         autotune (launch.py)
    kernel_report.py     kernel_report(compiled) -> KernelReport: bytes, coalescing, pointers,
                         index width and (sm_90 build) registers of each kernel, no GPU needed

Shared by every stage and target: index expressions (expr.py), dtype rules (dtypes.py), the
reductions table (reduction_kinds.py).

``AOTFORGE_LOG=graphs,ir,output_code,compile_time`` prints each stage; ``AOTFORGE_DUMP_DIR=dir``
writes them, numbered in the order they were made.
"""
from .decompositions import select_decomposition_table
from .kernel_report import KernelReport, kernel_report
from .pipeline import compile_fx, compile_fx_inner, observe
from . import function_cache  # noqa: F401,E402  (registers aot_function's cache with the AOT layer)
from .runtime.compiled import CompiledGraph

__all__ = ["CompiledGraph", "KernelReport", "compile_fx", "compile_fx_inner", "kernel_report", "observe",
           "select_decomposition_table"]
