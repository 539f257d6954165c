"""The CPU target's loader: a graph's C++ kernels (codegen/cpp.py) compiled as one translation
unit (cpp_build.py: the system C++ compiler, cached on disk) and called through ctypes.

A kernel takes its buffers' data pointers and its sizes, and returns 0 or the code of an error
it met (integer division by zero, an index out of bounds: cpp_ops.ERRORS), which is raised
here as the error eager raises; a kernel never traps and never reads out of bounds."""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from .. import index_checks
from ..codegen.cpp import translation_unit
from ..codegen.cpp_ops import ERRORS
from ..codegen.kernel import KernelSource
from . import cpp_build


class CppKernel:
    """One kernel's launcher (the wrapper calls ``run(*buffers, *sizes)``)."""

    best = "c++"  # nothing to tune or compile at the first launch (the pipeline's first-call timing)
    pool_seconds = 0.0

    def __init__(self, function: Any, source: KernelSource, library: Any, detail: Any = None):
        self.function = function
        self.detail = detail  # the library's aot_error_detail (a bad index's value, size and check)
        self.name = source.name
        self.source = source.source
        self.kind = source.kind
        self.numel, self.rnumel = source.numel, source.rnumel
        self.buffers = len(source.arguments)
        # a static kernel's sizes are not passed by the wrapper
        self.sizes = () if source.dynamic else (source.numel,) + ((source.rnumel,) if source.kind != "pointwise" else ())
        self.library = library  # the loaded library lives as long as a kernel of it

    def run(self, *arguments: Any) -> None:
        # the wrapper passes the buffers first, then a dynamic kernel's sizes
        buffers = self.buffers
        code = self.function(*[a.data_ptr() for a in arguments[:buffers]], *arguments[buffers:], *self.sizes)
        if code:
            raise self._error(code)

    def _error(self, code: int) -> Exception:
        if code == 2 and self.detail is not None:  # a bad index: eager's exception and message
            detail = (ctypes.c_int64 * 3)()
            self.detail(detail)  # (this thread's last failed call: the one that just returned)
            value, size, check = detail
            return index_checks.index_error(index_checks.decode(check), value, size)
        return RuntimeError(f"{ERRORS.get(code, f'error {code}')} (in aotforge's C++ kernel {self.name})")


def load_kernels(kernels: tuple[KernelSource, ...], precompile: bool = True) -> dict[str, CppKernel]:
    """Each kernel group's launcher; one library for all of them (distinct sources once)."""
    if not kernels:
        return {}
    unique = {k.name: k for k in kernels}
    library = cpp_build.load_library(translation_unit([k.source for k in unique.values()]), "aot_graph")
    library.function("aot_set_num_threads", [ctypes.c_int])(torch.get_num_threads())
    detail = library.function("aot_error_detail", [ctypes.POINTER(ctypes.c_int64)])
    functions = {}
    for name, source in unique.items():
        pointers = [ctypes.c_void_p] * len(source.arguments)
        sizes = [ctypes.c_int64] * (len(source.size_symbols) + (1 if source.kind == "pointwise" else 2))
        function = library.function(name, pointers + sizes)
        function.restype = ctypes.c_int
        functions[name] = function
    return {k.group: CppKernel(functions[k.name], k, library, detail) for k in kernels}
