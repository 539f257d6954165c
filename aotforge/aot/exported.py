"""Using an exported graph: call it like the module, save it, load it back.

``run_exported(gm, signature, mod, *args)`` is the caller's side of the export contract:
it passes the module's parameters and buffers and the flattened arguments, writes the
updated buffers (and inputs) back as eager would have, and returns the module's outputs
(structured as the module returned them) and the gradients by name::

    gm, signature = aot_export_module(model, (x, target), trace_joint=True, output_loss_index=0)
    (loss, logits), gradients = run_exported(gm, signature, model, x, target)
    for name, parameter in model.named_parameters():
        parameter.data -= 0.1 * gradients[name]

``save_exported`` / ``load_exported`` keep the graph's node names, which the signature uses.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .export import ExportError, GraphSignature

__all__ = ["load_exported", "run_exported", "save_exported"]


def run_exported(
    gm: fx.GraphModule, signature: GraphSignature, mod: nn.Module, *args, **kwargs
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Run ``gm`` as ``mod(*args, **kwargs)`` would run, and return ``(outputs, gradients)``.

    The module's buffers (and any mutated input) are updated in place, as eager would have
    done. ``gradients`` maps each parameter name (and ``args[i]`` / ``kwargs['k']`` for
    inputs that take a gradient) to its gradient; it is empty for an inference export.
    Inputs must have the shapes and dtypes the graph was exported for.
    """
    named_state = {**dict(mod.named_parameters()), **dict(mod.named_buffers())}
    for name in (*signature.parameters, *signature.buffers):
        if name not in named_state:
            raise ExportError(
                f"run_exported: the module has no parameter or buffer {name!r}, which the "
                "graph takes; pass the module the graph was exported from."
            )
    state = [named_state[n] for n in (*signature.parameters, *signature.buffers)]
    flat_user, _ = pytree.tree_flatten((tuple(args), kwargs))
    flat = [*state, *flat_user]
    structure = pytree.tree_structure(((*state, *args), kwargs))
    if structure != signature.in_spec:
        raise ExportError(
            f"run_exported: the arguments do not have the structure the graph was exported "
            f"for: expected {signature.in_spec}, got {structure}."
        )
    placeholders = gm.graph.find_nodes(op="placeholder")
    paths = [*signature.parameters, *signature.buffers, *signature._user_input_paths()]
    for node, value, path in zip(placeholders, flat, paths):
        _check_matches(node.meta.get("val"), value, path)
    with torch.no_grad():
        values = gm(*flat)
    (output_node,) = gm.graph.find_nodes(op="output")
    named = dict(zip((getattr(n, "name", None) for n in output_node.args[0]), values))

    with torch.no_grad():
        for name, fqn in {**signature.buffers_to_mutate, **signature.parameters_to_mutate}.items():
            named_state[fqn].copy_(named[name])
        input_by_name = dict(zip(signature.user_inputs, flat_user))
        for name, input_name in signature.user_inputs_to_mutate.items():
            input_by_name[input_name].copy_(named[name])

    outputs = pytree.tree_unflatten([named[n] for n in signature.user_outputs], signature.out_spec)
    gradients: dict[str, torch.Tensor] = {}
    backward = signature.backward_signature
    if backward is not None:
        path_by_input = dict(zip(signature.user_inputs, signature._user_input_paths()))
        gradients.update({fqn: named[n] for n, fqn in backward.gradients_to_parameters.items()})
        gradients.update(
            {path_by_input[i]: named[n] for n, i in backward.gradients_to_user_inputs.items()}
        )
    return outputs, gradients


def _shape_text(tensor: torch.Tensor) -> str:
    sizes = ", ".join(str(size) for size in tensor.shape)
    return f"({sizes},)" if tensor.dim() == 1 else f"({sizes})"


def _check_matches(expected, value, path: str) -> None:
    """The graph was traced for these shapes and dtypes; another shape could broadcast or
    reshape silently into a wrong answer, so it is an error."""
    if not isinstance(expected, torch.Tensor):
        return
    if not isinstance(value, torch.Tensor):
        raise ExportError(f"run_exported: {path} must be a tensor, got {type(value).__name__}")
    # Symbolic sizes (dynamic_shapes=True) are checked by the graph's own guards.
    static_match = value.dim() == expected.dim() and all(
        isinstance(want, torch.SymInt) or want == got
        for want, got in zip(expected.shape, value.shape)
    )
    if not static_match or value.dtype != expected.dtype:
        raise ExportError(
            f"run_exported: {path} has shape {tuple(value.shape)} and dtype {value.dtype}, but "
            f"the graph was exported for shape {_shape_text(expected)} and dtype "
            f"{expected.dtype}. Export again with inputs of the new shape."
        )


def save_exported(path, gm: fx.GraphModule, signature: Optional[GraphSignature] = None) -> None:
    """Write an exported graph (its Python code, constants and node names) and its signature
    to ``path`` with torch.save. ``load_exported`` reads it back."""
    torch.save(
        {
            "graph": gm,
            "signature": signature,
            "node_names": [node.name for node in gm.graph.nodes],
            "format": "aotforge-export-1",
        },
        path,
    )


def load_exported(path) -> tuple[fx.GraphModule, Optional[GraphSignature]]:
    """Read what ``save_exported`` wrote: the graph, with its original node names (which the
    signature refers to), and the signature.

    A pickled GraphModule is rebuilt by re-tracing its code, which renames nodes
    (``mean`` becomes ``mean_default``); the saved names are put back so that the signature
    still names the right inputs and outputs. Only load files you trust: this unpickles.
    """
    saved = torch.load(path, weights_only=False)
    if not isinstance(saved, dict) or saved.get("format") != "aotforge-export-1":
        raise ExportError(f"load_exported: {path} was not written by aotforge's save_exported")
    loaded: fx.GraphModule = saved["graph"]
    names = saved["node_names"]
    nodes = list(loaded.graph.nodes)
    if len(nodes) != len(names):
        raise ExportError(
            f"load_exported: the graph in {path} reloaded with {len(nodes)} nodes but was saved "
            f"with {len(names)}; the file is damaged or from an incompatible torch version."
        )
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node, name in zip(nodes, names):
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], lambda n: env[n]))
            continue
        args = fx.map_arg(node.args, lambda n: env[n])
        kwargs = fx.map_arg(node.kwargs, lambda n: env[n])
        env[node] = graph.create_node(node.op, node.target, args, kwargs, name=name)
        env[node].meta = dict(node.meta)
        if env[node].name != name:
            raise ExportError(f"load_exported: could not restore node name {name!r} in {path}")
    return fx.GraphModule(loaded, graph), saved["signature"]
