"""aotforge: an ahead-of-time autograd and graph compiler for PyTorch.

    torch.compile(model, backend="aotforge")          # Dynamo -> AOT autograd -> our compiler
    torch.compile(model, backend="aotforge_eager")    # Dynamo -> AOT autograd -> graphs as FX
    aotforge.aot_function(fn, fw_compiler, bw_compiler)
"""
from .aot import (
    AOTConfig,
    GraphSignature,
    aot_export_joint_simple,
    aot_export_module,
    aot_function,
    aot_module,
    aot_module_simplified,
    compiled_function,
    compiled_module,
    make_boxed_compiler,
    make_boxed_func,
    load_exported,
    nop,
    run_exported,
    save_exported,
)
from .backends import register_backends
from .config import config
from .partition import default_partition, min_cut_rematerialization_partition


def compile_fx(model, example_inputs, **kwargs):
    """The ``aotforge`` torch.compile backend: AOT autograd plus our compiler
    (see ``aotforge.compiler.pipeline``)."""
    from .compiler import compile_fx as _compile_fx

    return _compile_fx(model, example_inputs, **kwargs)


register_backends()

__all__ = [
    "AOTConfig",
    "GraphSignature",
    "aot_export_joint_simple",
    "aot_export_module",
    "aot_function",
    "aot_module",
    "aot_module_simplified",
    "compiled_function",
    "compiled_module",
    "compile_fx",
    "config",
    "default_partition",
    "make_boxed_compiler",
    "min_cut_rematerialization_partition",
    "make_boxed_func",
    "load_exported",
    "nop",
    "run_exported",
    "save_exported",
]
