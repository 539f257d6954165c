"""A C++ graph's entry point: one call from the wrapper runs a run of consecutive kernels.

The wrapper (wrapper.py) launches the kernels between two ATen calls as one call::

    if aot_failed := launch_kernels(0, primals_1, primals_4, buf0, 1, primals_3, buf1): raise kernel_error(aot_failed)

each kernel as its position in the graph's kernel tuple, its tensors, then (a kernel of
symbolic sizes) its sizes. ``aot_launch``, a METH_FASTCALL function of the translation unit
(made a Python builtin by runtime/cpp_launch.py), reads every tensor's ``data_ptr()``, releases
the GIL as a ctypes call does, runs the kernels in order and stops at the first error: it
returns ``position * 256 + code`` (0 when all ran), from which the launcher raises the failing
kernel's own exception. Against a ctypes call per kernel (argument conversion, a list of data
pointers built in Python) this is one crossing per run and no per-kernel Python.

The library never links against libpython (it loads wherever ctypes runs): the Python C API
functions it calls are handed in by the loader (``aot_entry_init``) as function pointers.
"""
from __future__ import annotations

import torch

from .cpp import translation_unit
from .cpp_ops import CPP_STORAGE_TYPE
from .kernel import KernelSource

# arguments converted on the stack; a longer run converts into a heap buffer
STACK_WORDS = 512

ENTRY_PRELUDE = r'''
// --- the graph's entry (codegen/cpp_entry.py) ------------------------------------------------
#include <cstddef>
#include <vector>
namespace {
struct AotPyObject;
// the Python C API, handed in by the loader in this order (aot_entry_init)
struct AotPyApi {
    AotPyObject* (*call_method)(AotPyObject*, AotPyObject* const*, size_t, AotPyObject*);  // PyObject_VectorcallMethod
    void* (*as_pointer)(AotPyObject*);  // PyLong_AsVoidPtr
    long long (*as_int)(AotPyObject*);  // PyLong_AsLongLong
    AotPyObject* (*from_int)(long long);  // PyLong_FromLongLong
    void (*decref)(AotPyObject*);  // Py_DecRef
    AotPyObject* (*error)();  // PyErr_Occurred
    void* (*save_thread)();  // PyEval_SaveThread
    void (*restore_thread)(void*);  // PyEval_RestoreThread
};
AotPyApi aot_py;
AotPyObject* aot_data_ptr_name = nullptr;  // "data_ptr", held by the loader
// one kernel of the graph: how to call it from converted words (pointers, then sizes)
struct AotEntry { int (*run)(const int64_t*); int pointers; int sizes; };
'''

ENTRY_FUNCTION = r'''
AotPyObject* aot_launch(AotPyObject*, AotPyObject* const* args, ptrdiff_t nargs) {
    // every argument converted while the GIL is held, then the kernels run without it
    int64_t stack[AOT_STACK_WORDS];
    std::vector<int64_t> heap;
    int64_t* words = stack;
    if (nargs > AOT_STACK_WORDS) { heap.resize(nargs); words = heap.data(); }
    ptrdiff_t n = 0;
    for (ptrdiff_t i = 0; i < nargs;) {
        long long index = aot_py.as_int(args[i]);
        if (index == -1 && aot_py.error()) return nullptr;
        if (index < 0 || index >= aot_entry_count) return aot_py.from_int(-1);  // not this graph's call
        const AotEntry& entry = aot_entries[index];
        if (i + 1 + entry.pointers + entry.sizes > nargs) return aot_py.from_int(-1);
        words[n++] = index;
        for (int k = 0; k < entry.pointers; ++k) {
            AotPyObject* address = aot_py.call_method(aot_data_ptr_name, args + i + 1 + k, 1, nullptr);
            if (address == nullptr) return nullptr;  // not a tensor: its exception
            void* pointer = aot_py.as_pointer(address);
            aot_py.decref(address);
            if (pointer == nullptr && aot_py.error()) return nullptr;
            words[n++] = reinterpret_cast<int64_t>(pointer);
        }
        for (int k = 0; k < entry.sizes; ++k) {
            long long size = aot_py.as_int(args[i + 1 + entry.pointers + k]);
            if (size == -1 && aot_py.error()) return nullptr;
            words[n++] = size;
        }
        i += 1 + entry.pointers + entry.sizes;
    }
    void* state = aot_py.save_thread();
    long long result = 0;
    for (ptrdiff_t j = 0; j < n;) {
        const AotEntry& entry = aot_entries[words[j]];
        int code = entry.run(words + j + 1);
        if (code) { result = words[j] * 256 + code; break; }  // the failing kernel and its error
        j += 1 + entry.pointers + entry.sizes;
    }
    aot_py.restore_thread(state);
    return aot_py.from_int(result);
}
}  // namespace

// takes the Python C API and returns aot_launch, which the loader makes a builtin of (with a
// PyMethodDef in the loader's memory: the builtin's deallocation reads it, and may come after
// the library is unloaded)
extern "C" void* aot_entry_init(void* const* api, AotPyObject* data_ptr_name) {
    void** slots = reinterpret_cast<void**>(&aot_py);
    for (size_t k = 0; k < sizeof(AotPyApi) / sizeof(void*); ++k) slots[k] = api[k];
    aot_data_ptr_name = data_ptr_name;
    return reinterpret_cast<void*>(&aot_launch);
}
'''

# the API functions aot_entry_init takes, in AotPyApi's order
PYTHON_API = ("PyObject_VectorcallMethod", "PyLong_AsVoidPtr", "PyLong_AsLongLong", "PyLong_FromLongLong",
              "Py_DecRef", "PyErr_Occurred", "PyEval_SaveThread", "PyEval_RestoreThread")


def launch_sizes(kernel: KernelSource) -> int:
    """How many sizes the wrapper passes after a kernel's tensors (a static kernel's are in
    its entry): its size symbols' values, then numel (and rnumel for a reduction)."""
    if not kernel.dynamic:
        return 0
    return len(kernel.size_symbols) + (1 if kernel.kind == "pointwise" else 2)


def _pointer_type(dtype: torch.dtype) -> str:
    # as the kernel's header spells it (cpp.py: a bool is a byte)
    return "uint8_t" if dtype == torch.bool else CPP_STORAGE_TYPE[dtype]


def _caller(position: int, kernel: KernelSource) -> str:
    """The entry's call of one kernel: its pointers and sizes from the converted words."""
    pointers = [f"reinterpret_cast<{_pointer_type(d)}*>(w[{i}])" for i, d in enumerate(kernel.dtypes)]
    if kernel.dynamic:
        sizes = [f"w[{len(pointers) + i}]" for i in range(launch_sizes(kernel))]
    else:
        sizes = [str(int(kernel.numel))] + ([str(int(kernel.rnumel))] if kernel.kind != "pointwise" else [])
    return f"int aot_run_{position}(const int64_t* w) {{ return {kernel.name}({', '.join(pointers + sizes)}); }}"


def graph_translation_unit(kernels: tuple[KernelSource, ...]) -> str:
    """A graph's C++ file: each distinct kernel once (translation_unit), then the entry, whose
    table has one row per kernel of the graph in the order of ``kernels`` (the positions the
    wrapper passes). The compiled-graph cache rebuilds it with this same function."""
    unique = {k.name: k for k in kernels}
    for k in kernels:  # the wrapper passes a tensor per argument, the entry reads one per dtype
        if len(k.dtypes) != len(k.arguments):
            raise ValueError(f"aotforge: kernel {k.name} has {len(k.arguments)} arguments but {len(k.dtypes)} dtypes")
    callers = [_caller(i, k) for i, k in enumerate(kernels)]
    rows = [f"{{aot_run_{i}, {len(k.dtypes)}, {launch_sizes(k)}}}" for i, k in enumerate(kernels)]
    table = (f"const AotEntry aot_entries[] = {{{', '.join(rows)}}};\n"
             f"constexpr long long aot_entry_count = {len(kernels)};\n"
             f"constexpr ptrdiff_t AOT_STACK_WORDS = {STACK_WORDS};\n")
    return (translation_unit([k.source for k in unique.values()]) + ENTRY_PRELUDE + "\n".join(callers) + "\n"
            + table + ENTRY_FUNCTION)
