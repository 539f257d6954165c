"""aotforge: an ahead-of-time autograd and graph compiler for PyTorch.

    torch.compile(model, backend="aotforge")          # Dynamo -> AOT autograd -> our compiler
    torch.compile(model, backend="aotforge_eager")    # Dynamo -> AOT autograd -> graphs as FX
    aotforge.aot_function(fn, fw_compiler, bw_compiler)
    aotforge.inspect(compiled)                        # graphs, partition, kernels, timings
"""
from .aot import (
    AOTConfig,
    GraphSignature,
    aot_export_joint_simple,
    aot_export_module,
    aot_module_simplified,
    make_boxed_compiler,
    make_boxed_func,
    load_exported,
    nop,
    run_exported,
    save_exported,
)
from .backends import register_backends
from .compat import (
    default_decompositions,
    draw_graph,
    get_aot_compilation_context,
    get_aot_graph_name,
    memory_efficient_fusion,
    print_compile,
)
from .config import config
from .inspection import aot_function, aot_module, inspect
from .partition import default_partition, min_cut_rematerialization_partition

compiled_function = aot_function
compiled_module = aot_module


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
    "default_decompositions",
    "default_partition",
    "draw_graph",
    "get_aot_compilation_context",
    "get_aot_graph_name",
    "inspect",
    "make_boxed_compiler",
    "memory_efficient_fusion",
    "min_cut_rematerialization_partition",
    "make_boxed_func",
    "load_exported",
    "nop",
    "print_compile",
    "run_exported",
    "save_exported",
]
