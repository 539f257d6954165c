"""The CPU target's loader: a graph's C++ kernels (codegen/cpp.py) compiled as one translation
unit (cpp_build.py: the system C++ compiler, cached on disk) and called through ctypes.

A kernel takes its buffers' data pointers and its sizes, and returns 0 or the code of an error
it met (integer division by zero, an index out of bounds: cpp_ops.ERRORS), which is raised
here as the error eager raises; a kernel never traps and never reads out of bounds.

The wrapper does not call the kernels one by one: each run of consecutive kernels is one call
of the translation unit's entry (codegen/cpp_entry.py), made a Python builtin here
(``graph_entry``); a kernel's own ctypes ``run`` remains for a library without the entry."""
from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch

from .. import index_checks
from ..codegen.cpp import UNIT_PRELUDE as PRELUDE  # what every unit starts with (precompiled: cpp_pch.py)
from ..codegen.cpp_entry import PYTHON_API, graph_translation_unit, launch_sizes
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
        self.entry = None  # the library's aot_launch builtin (load_kernels), shared by its kernels

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
    library = cpp_build.load_library(graph_translation_unit(kernels), "aot_graph", PRELUDE)
    library.function("aot_set_num_threads", [ctypes.c_int])(torch.get_num_threads())
    detail = library.function("aot_error_detail", [ctypes.POINTER(ctypes.c_int64)])
    functions = {}
    for name, source in unique.items():
        pointers = [ctypes.c_void_p] * len(source.arguments)
        sizes = [ctypes.c_int64] * (len(source.size_symbols) + (1 if source.kind == "pointwise" else 2))
        function = library.function(name, pointers + sizes)
        function.restype = ctypes.c_int
        functions[name] = function
    launchers = {k.group: CppKernel(functions[k.name], k, library, detail) for k in kernels}
    entry = _fast_entry(library)
    for launcher in launchers.values():
        launcher.entry = entry
    return launchers


# --- the wrapper's launch of a run of kernels (codegen/cpp_entry.py) ---------------------------

USE_ENTRY = True  # False: every run through the kernels' ctypes launchers (A/B timing, a fallback)


class _MethodDef(ctypes.Structure):
    """CPython's PyMethodDef."""
    _fields_ = [("name", ctypes.c_char_p), ("method", ctypes.c_void_p), ("flags", ctypes.c_int), ("doc", ctypes.c_char_p)]


METH_FASTCALL = 0x80


class _EntryHolder:
    """The builtin's ``self``: holds what the builtin uses as long as it lives (the library,
    the name it calls, its PyMethodDef)."""

    def __init__(self, library: Any, name: str) -> None:
        self.library, self.name = library, name
        self.definition: Any = None


def _fast_entry(library: Any) -> Any:
    """The translation unit's ``aot_launch`` as a Python builtin (METH_FASTCALL), or None where
    the Python C API cannot be handed to it (an interpreter whose API ctypes cannot reach):
    then the wrapper's runs go through each kernel's ctypes launcher, as before."""
    try:
        api = (ctypes.c_void_p * len(PYTHON_API))(*[ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p)
                                                    for name in PYTHON_API])
        holder = _EntryHolder(library, sys.intern("data_ptr"))
        init = library.function("aot_entry_init", [ctypes.c_void_p, ctypes.py_object])
        init.restype = ctypes.c_void_p
        holder.definition = _MethodDef(b"aot_launch", init(api, holder.name), METH_FASTCALL, None)
        make = ctypes.pythonapi.PyCFunction_NewEx
        make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.py_object, ctypes.c_void_p]
        return make(ctypes.addressof(holder.definition), holder, None)
    except (AttributeError, OSError, ValueError, cpp_build.CppCompileError):
        return None


def graph_entry(kernels: tuple[KernelSource, ...], launchers: dict) -> tuple[Any, Any]:
    """The wrapper's ``launch_kernels`` and ``kernel_error`` for a C++ graph. ``launchers``: the
    group's launchers (a caller's own target's too: those run one by one through ``run``)."""
    ordered = [launchers[k.group] for k in kernels]
    entries = {getattr(launcher, "entry", None) for launcher in ordered}
    entry = next(iter(entries)) if len(entries) == 1 else None
    if entry is None or not USE_ENTRY:
        return _run_one_by_one(kernels, ordered), _no_error

    def kernel_error(code: int) -> Exception:
        if code < 0:  # the wrapper and the translation unit disagree: never a silent wrong answer
            return RuntimeError("aotforge: a launch of C++ kernels that does not match the graph's kernels")
        return ordered[code >> 8]._error(code & 255)
    return entry, kernel_error


def _run_one_by_one(kernels: tuple[KernelSource, ...], ordered: list) -> Any:
    """The same call as the entry's, through each kernel's ``run`` (which raises its errors)."""
    counts = [(launcher.run, len(k.arguments) + launch_sizes(k)) for k, launcher in zip(kernels, ordered)]

    def launch_kernels(*arguments: Any) -> int:
        at = 0
        while at < len(arguments):
            run, count = counts[arguments[at]]
            run(*arguments[at + 1:at + 1 + count])
            at += 1 + count
        return 0
    return launch_kernels


def _no_error(code: int) -> Exception:
    return RuntimeError(f"aotforge: C++ kernels returned {code}")  # (one by one, each raised its own)
