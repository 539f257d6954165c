"""The remaining ``functorch.compile`` names users call: ``print_compile``, ``draw_graph``,
``memory_efficient_fusion``, ``get_aot_graph_name``, ``get_aot_compilation_context`` and
``default_decompositions``, with the same signatures."""
from __future__ import annotations

import copy
import os
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn

from .aot.boxing import make_boxed_compiler
from .inspection import aot_function, aot_module, graph_being_compiled
from .partition import min_cut_rematerialization_partition

aten = torch.ops.aten

# Backward formulas and activations that functorch.compile decomposes by default, so that a
# fusing compiler sees pointwise ops instead of opaque *_backward kernels.
DEFAULT_DECOMPOSITION_OPS = [
    aten.detach, aten.gelu_backward, aten.leaky_relu_backward, aten.sigmoid_backward,
    aten.threshold_backward, aten.hardtanh_backward, aten.hardsigmoid_backward,
    aten.hardswish_backward, aten.tanh_backward, aten.silu_backward, aten.elu_backward,
    aten.cudnn_batch_norm, aten.cudnn_batch_norm_backward, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.elu, aten.leaky_relu, aten.hardtanh, aten.hardswish,
    aten.hardsigmoid, aten.conj_physical, aten.is_same_size,
]


def _default_decompositions() -> dict:
    from torch._decomp import get_decompositions

    return get_decompositions(DEFAULT_DECOMPOSITION_OPS)


default_decompositions = _default_decompositions()


@make_boxed_compiler
def print_compile(fx_g: fx.GraphModule, _: Any) -> fx.GraphModule:
    """A compiler that prints each graph's code and runs it as FX."""
    print(fx_g.code)
    return fx_g


def draw_graph(traced: fx.GraphModule, fname: str, figname: str = "fx_graph",
               clear_meta: bool = True, prog: Optional[Union[str, list]] = None,
               parse_stack_trace: bool = False, dot_graph_shape: Optional[str] = None) -> None:
    """Draw ``traced`` to ``fname`` (the extension picks the format: .svg, .png, .dot)."""
    from torch.fx.passes import graph_drawer

    if not getattr(graph_drawer, "HAS_PYDOT", False):
        raise ImportError(
            "aotforge.draw_graph needs pydot and Graphviz: `pip install pydot` and install "
            "Graphviz's `dot` (apt-get install graphviz / brew install graphviz); or print "
            "the graph instead with gm.print_readable()"
        )
    if clear_meta:
        traced = fx.GraphModule(traced, copy.deepcopy(traced.graph))
        for node in traced.graph.nodes:
            node.meta = {}
    base, ext = os.path.splitext(fname)
    ext = ext or ".svg"
    kwargs = {"parse_stack_trace": parse_stack_trace}
    if dot_graph_shape is not None:
        kwargs["dot_graph_shape"] = dot_graph_shape
    drawer = graph_drawer.FxGraphDrawer(traced, figname, **kwargs)
    dot = drawer.get_main_dot_graph()
    writer = getattr(dot, "write_" + ext.lstrip("."))
    path = base + ext
    if prog is None:
        writer(path)
    else:
        writer(path, prog=prog)


def memory_efficient_fusion(fn: Union[Callable, nn.Module], **kwargs: Any):
    """``aot_function`` / ``aot_module`` with min-cut rematerialization, the default
    decompositions and aotforge's compiler for the forward and backward graphs."""
    from .compiler import compile_fx_inner  # loaded at first use: ``import aotforge`` stays light

    settings = {
        "fw_compiler": compile_fx_inner,
        "bw_compiler": compile_fx_inner,
        "partition_fn": min_cut_rematerialization_partition,
        "decompositions": default_decompositions,
    }
    settings.update(kwargs)
    if isinstance(fn, nn.Module):
        return aot_module(fn, **settings)
    return aot_function(fn, **settings)


# --- the graph being compiled (set by aotforge.inspection's recorders) ----------------------

def get_aot_compilation_context() -> tuple[list[str], str, int]:
    """(graph names, model name, n-th graph of that model) of the graph whose compiler is
    running now; ([], "", 0) outside a compile."""
    value = graph_being_compiled()
    if value is None:
        return [], "", 0
    names, model, nth = value
    return list(names), model, nth


def get_aot_graph_name() -> str:
    """``<model>__<graph>_<n>`` for the graph whose compiler is running now."""
    names, model, nth = get_aot_compilation_context()
    return f"{model}__{'_'.join(names)}_{nth}"
