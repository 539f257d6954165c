"""Tracing an export at the pre-dispatch level: above autograd, so the graph keeps what the
user called rather than what autograd and the CompositeImplicit decompositions turn it into.

Below autograd (the default export), ``F.linear`` is already ``t`` + ``addmm`` and a
``torch.no_grad()`` block has left no trace. Before autograd dispatch, the graph keeps
``aten.linear``, ``aten.conv2d``, ``aten.dropout``, grad-mode switches as
``torch._C._set_grad_enabled`` calls, and higher-order operators (``torch.cond``,
``map``) with their branches as subgraphs::

    def forward(self, arg0_1, arg1_1, arg2_1):
        linear = torch.ops.aten.linear.default(arg2_1, arg0_1, arg1_1)
        _set_grad_enabled = torch._C._set_grad_enabled(False)
        mul = torch.ops.aten.mul.Tensor(linear, 2)
        _set_grad_enabled_1 = torch._C._set_grad_enabled(True)
        true_graph_0 = self.true_graph_0
        false_graph_0 = self.false_graph_0
        cond = torch.ops.higher_order.cond(gt, true_graph_0, false_graph_0, (linear,))

It is still functional: mutations are functionalized (at the pre-dispatch level) and
returned as extra outputs, exactly as in the default export; the calling convention and
the signature are the same.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import make_fx

from .functional import FunctionalTensorMode, below_functionalization, from_functional, to_functional


def trace_pre_dispatch(
    graph_fn: Callable, fake_args: Sequence, *, decompositions: dict, fake_mode
) -> fx.GraphModule:
    """make_fx at the pre-dispatch level over pre-dispatch functionalization, on fake
    arguments: ``graph_fn``'s flat outputs from its flat inputs (named ``argN_1``)."""

    def functional(*args):
        with below_functionalization():
            outputs = graph_fn(*(to_functional(arg) for arg in args))
        return [from_functional(output) for output in outputs]

    functionalization = FunctionalTensorMode(
        pre_dispatch=True, export=True, _allow_token_discovery=True
    )
    with fake_mode, enable_python_dispatcher(), functionalization:
        gm = make_fx(
            functional,
            decomposition_table=decompositions,
            pre_dispatch=True,
            record_module_stack=True,
        )(*fake_args)
    # Flat placeholders and a flat tuple of outputs, as every export graph has.
    gm.graph._codegen = fx.graph.CodeGen()
    (output,) = gm.graph.find_nodes(op="output")
    output.args = (tuple(pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None)),)
    # Grad-mode switches are side effects, which dead-code elimination keeps.
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
