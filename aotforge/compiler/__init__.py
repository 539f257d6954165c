"""aotforge's compiler: FX graph of ATen ops -> fused Triton kernels + a Python wrapper.

The stages, one module each (imports flow downward)::

    compile_fx.py        entry points: compile_fx (torch.compile backend), compile_fx_inner
    decompositions.py    the decomposition table (core ATen + softmax, norms, activations)
    passes/              graph -> graph: DCE, CSE, view->reshape, no-op removal, constant
                         folding, pattern rewrites, in-place -> functional
    ops.py, ir.py        the loop-level IR: bodies written against ``ops``; values, buffers
    lowering/            ATen op -> IR, one table (LOWERINGS); anything else -> ATen extern
    indexing.py          index arithmetic in kernel space (xindex, rindex)
    scheduler.py         fusion into kernels, stores that can be skipped, frees
    codegen/triton.py    one kernel's Triton source (pointwise, persistent or looped reduction)
    codegen/wrapper.py   the Python program that allocates, launches, calls ATen, frees
    runtime/             loading generated modules, block sizes and autotuning, helpers

``AOTFORGE_LOG=graphs,output_code`` prints each stage; ``AOTFORGE_DUMP_DIR=dir`` writes them.
"""
from .compile_fx import compile_fx, compile_fx_inner
from .decompositions import select_decomposition_table

__all__ = ["compile_fx", "compile_fx_inner", "select_decomposition_table"]
