"""Ahead-of-time autograd: trace forward and backward into functional graphs and run them
with eager's semantics."""
from .api import aot_function, aot_module, aot_module_simplified, compiled_function, compiled_module
from .boxing import make_boxed_compiler, make_boxed_func, nop
from .export import (
    BackwardSignature,
    ExportError,
    GraphSignature,
    aot_export_joint_simple,
    aot_export_module,
)
from .exported import load_exported, run_exported, save_exported
from .schemas import AOTConfig, OutputKind, ViewAndMutationMeta

__all__ = [
    "AOTConfig",
    "BackwardSignature",
    "ExportError",
    "GraphSignature",
    "OutputKind",
    "ViewAndMutationMeta",
    "aot_export_joint_simple",
    "aot_export_module",
    "aot_function",
    "aot_module",
    "aot_module_simplified",
    "compiled_function",
    "compiled_module",
    "load_exported",
    "make_boxed_compiler",
    "make_boxed_func",
    "nop",
    "run_exported",
    "save_exported",
]
