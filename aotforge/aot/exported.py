"""Using an exported graph: call it like the module, save it, load it back.

``run_exported(gm, signature, mod, *args)`` is the caller's side of the export contract:
it passes the module's parameters and buffers and the flattened arguments, writes the
updated buffers (and inputs) back as eager would have, and returns the module's outputs
(structured as the module returned them) and the gradients by name::

    gm, signature = aot_export_module(model, (x, target), trace_joint=True, output_loss_index=0)
    (loss, logits), gradients = run_exported(gm, signature, model, x, target)
    for name, parameter in model.named_parameters():
        parameter.data -= 0.1 * gradients[name]

``save_exported`` / ``load_exported`` keep the graph's node names, which the signature uses;
the file is plain data (``export_format``), so loading one runs no code from it.
"""
from __future__ import annotations

import json
import pickle
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from . import export_format
from .export import BackwardSignature, ExportError, GraphSignature

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
        _check_matches(_expected_input(node), value, path)
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


def _shape_text(shape: tuple) -> str:
    sizes = ", ".join("any" if size is None else str(size) for size in shape)
    return f"({sizes},)" if len(shape) == 1 else f"({sizes})"


def _expected_input(node: fx.Node) -> Optional[export_format.InputSpec]:
    """What the graph input was traced with: from its fake value in a freshly exported
    graph, from the record the file kept in a loaded one."""
    if "val" in node.meta:
        return export_format.InputSpec.of(node.meta["val"])
    return node.meta.get("aotforge_input")


def _check_matches(expected: Optional[export_format.InputSpec], value, path: str) -> None:
    """The graph was traced for these shapes and dtypes; another shape could broadcast or
    reshape silently into a wrong answer, so it is an error."""
    if expected is None or expected.kind != "tensor":
        return
    if not isinstance(value, torch.Tensor):
        raise ExportError(f"run_exported: {path} must be a tensor, got {type(value).__name__}")
    # Dynamic sizes (None; dynamic_shapes=True) are checked by the graph's own guards.
    static_match = value.dim() == len(expected.shape) and all(
        want is None or want == got for want, got in zip(expected.shape, value.shape)
    )
    if not static_match or value.dtype != expected.dtype:
        raise ExportError(
            f"run_exported: {path} has shape {tuple(value.shape)} and dtype {value.dtype}, but "
            f"the graph was exported for shape {_shape_text(expected.shape)} and dtype "
            f"{expected.dtype}. Export again with inputs of the new shape."
        )


def save_exported(path, gm: fx.GraphModule, signature: Optional[GraphSignature] = None) -> None:
    """Write an exported graph (node by node, with its constants and node names) and its
    signature to ``path``. ``load_exported`` reads it back without unpickling any code (see
    ``export_format``)."""
    description, constants = export_format.encode(gm, signature)
    text = json.dumps(description)
    torch.save(
        {
            "format": export_format.FORMAT,
            "version": export_format.VERSION,
            "description": text,
            "constants": constants,
            "checksum": export_format.checksum(text, constants),
        },
        path,
    )


def load_exported(path) -> tuple[fx.GraphModule, Optional[GraphSignature]]:
    """Read what ``save_exported`` wrote: the graph, with its original node names (which the
    signature refers to), and the signature.

    The file is read with ``torch.load(weights_only=True)``: a file holding any Python object
    other than tensors and plain data is refused before anything in it runs. A file cut short
    or edited is reported as damaged. The loaded graph checks its inputs as the exported one
    did (``run_exported``'s shape and dtype checks, the graph's own assertions).
    """
    try:
        saved = torch.load(path, weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except pickle.UnpicklingError as error:
        reason = _unpickler_reason(error)
        if "GLOBAL" in reason:
            raise ExportError(
                f"load_exported: refused to load {path}: it names Python code to run on "
                f"loading ({reason}). save_exported never writes that: the file was written by "
                f"an aotforge older than export format version {export_format.VERSION} (export "
                "and save the model again), or was crafted. Nothing in it was run."
            ) from None
        raise _damaged(path, f"torch.load refused it: {reason}") from None
    except Exception as error:
        raise _damaged(path, f"torch.load failed: {type(error).__name__}: {_first_line(error)}") from None
    if not isinstance(saved, dict) or saved.get("format") != export_format.FORMAT:
        raise ExportError(f"load_exported: {path} was not written by aotforge's save_exported")
    if saved.get("version") != export_format.VERSION:
        raise ExportError(
            f"load_exported: {path} has export format version {saved.get('version')!r}; this "
            f"aotforge reads version {export_format.VERSION}. Export and save the model again."
        )
    text, constants = saved.get("description"), saved.get("constants")
    if (
        not isinstance(text, str)
        or not isinstance(constants, dict)
        or not all(isinstance(c, torch.Tensor) for c in constants.values())
        or saved.get("checksum") != export_format.checksum(text, constants)
    ):
        raise ExportError(
            f"load_exported: {path} is damaged: its contents do not match the checksum "
            "save_exported wrote (the file was edited or corrupted). Save the export again."
        )
    try:
        gm, fields = export_format.decode(json.loads(text), constants)
        signature = None if fields is None else _signature_from_fields(fields)
    except (export_format.DamagedFile, json.JSONDecodeError, TypeError, KeyError) as error:
        raise ExportError(
            f"load_exported: {path} is damaged: its graph description is invalid ({error})."
        ) from None
    return gm, signature


def _signature_from_fields(fields: dict) -> GraphSignature:
    backward = fields.pop("backward_signature")
    if backward is not None:
        backward = BackwardSignature(**backward)
    return GraphSignature(**fields, backward_signature=backward)


def _damaged(path, reason: str) -> ExportError:
    return ExportError(
        f"load_exported: {path} is damaged (cut short or edited) or is not a file save_exported "
        f"wrote; nothing in it was run ({reason})."
    )


def _unpickler_reason(error: pickle.UnpicklingError) -> str:
    """The part of torch's weights-only refusal that says what it found (its first and last
    paragraphs are the same advice for every file)."""
    lines = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
    lines = [line for line in lines if not line.startswith("Check the documentation")]
    text = " ".join(lines).split("WeightsUnpickler error:")[-1]
    # Drop torch's advice to allow-list the global: here that would defeat the check.
    text = text.split(" Please use `torch.serialization.add_safe_globals")[0].strip()
    return text or _first_line(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
