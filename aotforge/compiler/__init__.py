"""aotforge's compiler: FX graph of ATen ops -> fused Triton kernels + a Python wrapper."""
from .compile_fx import compile_fx, compile_fx_inner
from .decompositions import select_decomposition_table

__all__ = ["compile_fx", "compile_fx_inner", "select_decomposition_table"]
