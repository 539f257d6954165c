"""Shared helpers: trace a function the way AOT autograd hands graphs to the compiler."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aotforge.compiler import compile_fx_inner, select_decomposition_table
from aotforge.config import config


def trace(fn, *args, decompose: bool = True) -> torch.fx.GraphModule:
    table = select_decomposition_table() if decompose else {}
    return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"), decomposition_table=table,
                   tracing_mode="fake")(*args)


def compile_and_run(fn, *args, triton: bool = True, **patches):
    """Compile ``fn`` (graph outputs as a tuple) and run it; returns (outputs, stats)."""
    with config.patch(triton_on_cpu=triton, **patches):
        gm = trace(fn, *args)  # under the patch: the decompositions depend on the path
        compiled = compile_fx_inner(gm, list(args))
        outputs = compiled([a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    return outputs, compiled.compiled_graph.stats
