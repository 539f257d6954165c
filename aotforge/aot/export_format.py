"""The on-disk format of an exported graph: plain data, read back without running any code.

A pickled GraphModule is rebuilt by unpickling, which can call any Python function a file
names, before anything could check the file. ``save_exported`` writes, instead, a
description of the graph as JSON text (one record per node) plus its tensor constants;
``torch.load(weights_only=True)`` reads that back (it refuses every Python object that is
not a tensor or plain data), and the graph is rebuilt node by node from the description.
The targets a node may call are resolved from names, and only to ATen/registered operators,
PyTorch's higher-order operators (``cond``, ``map``) or the few Python functions an export
graph uses (``operator.getitem``, comparisons, ``torch._assert``) listed below::

    {"name": "add", "op": "call_function", "target": {"op": "aten::add.Tensor"},
     "args": [{"node": "arg6_1"}, 1], "kwargs": {}}

A SHA-256 checksum of the description and the constants' bytes tells a damaged file (cut
short, edited) from a good one. It protects against accidents, not against an attacker,
who could recompute it; what protects against an attacker is that nothing in the file is
code.

Each graph input keeps what the export traced it with (shape, dtype; ``None`` for a
dynamic size) in ``node.meta["aotforge_input"]``, so that ``run_exported`` still checks the
inputs of a loaded graph.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import operator
import re
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .export import ExportError

FORMAT = "aotforge-export"
VERSION = 2

# Python callables an export graph may contain, by the name the file stores. Everything else
# a node calls must be an operator registered with torch.ops.
PYTHON_FUNCTIONS: dict[str, Callable] = {
    **{
        f"operator.{name}": getattr(operator, name)
        for name in (
            "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg",
            "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_",
        )
    },
    "torch._assert": torch._assert,
    "torch.sym_float": torch.sym_float,
    "torch.sym_int": torch.sym_int,
    "torch.sym_max": torch.sym_max,
    "torch.sym_min": torch.sym_min,
    "torch.sym_not": torch.sym_not,
    "math.ceil": math.ceil,
    "math.floor": math.floor,
    "math.trunc": math.trunc,
    # Pre-dispatch graphs keep grad-mode switches (torch.no_grad() blocks) and autocast
    # regions as calls.
    "torch._C._set_grad_enabled": torch._C._set_grad_enabled,
    **{
        f"torch.amp.autocast_mode.{name}": getattr(torch.amp.autocast_mode, name)
        for name in ("_enter_autocast", "_exit_autocast")
        if hasattr(torch.amp.autocast_mode, name)
    },
}
_NAME_OF_FUNCTION = {function: name for name, function in PYTHON_FUNCTIONS.items()}

NODE_KINDS = ("placeholder", "call_function", "get_attr", "output")

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class DamagedFile(Exception):
    """Raised while decoding: the description is not one ``save_exported`` writes."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """What a graph input was traced with. ``shape`` holds ``None`` for a dynamic size;
    ``dtype`` is None for a non-tensor input, whose ``kind`` is its type name."""

    kind: str  # "tensor", "symint", or the Python type name of a specialized constant
    shape: Optional[tuple] = None
    dtype: Optional[torch.dtype] = None

    @staticmethod
    def of(value) -> Optional["InputSpec"]:
        if isinstance(value, torch.Tensor):
            return InputSpec("tensor", tuple(map(_static_size, value.shape)), value.dtype)
        if isinstance(value, torch.SymInt):
            return InputSpec("symint")
        if value is None:
            return None
        return InputSpec(type(value).__name__)


def _static_size(size) -> Optional[int]:
    """An int, or None for a size that stays symbolic. A symbolic size the trace fixed to a
    constant (a feature size a weight fixes) counts as that constant."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.shape_env.replace(size.node.expr)
    return int(expr) if expr.is_Integer else None


# ---------------------------------------------------------------------------------------------
# Writing


def encode(gm: fx.GraphModule, signature) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(description, constants)``: what ``save_exported`` writes."""
    constants: dict[str, torch.Tensor] = {}
    description = {
        "graph": _encode_graph(gm, "", constants),
        "signature": None if signature is None else _encode_signature(signature),
    }
    return description, constants


def checksum(text: str, constants: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(text.encode())
    for name in sorted(constants):
        tensor = constants[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _encode_graph(gm: fx.GraphModule, prefix: str, constants: dict) -> dict:
    nodes, submodules = [], {}
    for node in gm.graph.nodes:
        if node.op not in NODE_KINDS:
            raise ExportError(
                f"save_exported: node {node.name!r} is a {node.op} node; an exported graph "
                f"holds only {', '.join(NODE_KINDS)} nodes (is this graph from aot_export_module?)"
            )
        record: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            record["target"] = _encode_target(node)
        else:
            record["target"] = node.target
        if node.op == "get_attr":
            value = _get_attribute(gm, node.target)
            if isinstance(value, fx.GraphModule):
                submodules[node.target] = _encode_graph(value, f"{prefix}{node.target}.", constants)
            elif isinstance(value, torch.Tensor):
                constants[prefix + node.target] = value.detach()
            else:
                raise ExportError(
                    f"save_exported: node {node.name!r} reads attribute {node.target!r}, a "
                    f"{type(value).__name__}; only tensors and subgraphs can be saved."
                )
        if node.op == "placeholder":
            spec = InputSpec.of(node.meta.get("val"))
            if spec is None:
                spec = node.meta.get("aotforge_input")  # a graph that was loaded itself
            record["input"] = None if spec is None else _encode_input(spec)
        record["args"] = _encode_value(node.args, node)
        record["kwargs"] = _encode_value(dict(node.kwargs), node)
        nodes.append(record)
    return {"nodes": nodes, "submodules": submodules}


def _get_attribute(gm: fx.GraphModule, target: str):
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _encode_target(node: fx.Node) -> dict:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return {"op": f"{target._schema.name}.{target._overloadname}"}
    if isinstance(target, torch._ops.HigherOrderOperator):
        return {"higher_order": target.name()}
    name = _NAME_OF_FUNCTION.get(target)
    if name is not None:
        return {"function": name}
    raise ExportError(
        f"save_exported: node {node.name!r} calls {target!r}, which the export format does not "
        "store (it holds ATen and registered operators, higher-order operators and "
        f"{', '.join(PYTHON_FUNCTIONS)})."
    )


def _encode_input(spec: InputSpec) -> dict:
    return {
        "kind": spec.kind,
        "shape": None if spec.shape is None else list(spec.shape),
        "dtype": None if spec.dtype is None else str(spec.dtype).removeprefix("torch."),
    }


# Tagged encodings of the argument types JSON has no form for, keyed by Python type.
_TAGGED: dict[type, tuple[str, Callable]] = {
    torch.dtype: ("dtype", lambda v: str(v).removeprefix("torch.")),
    torch.device: ("device", str),
    torch.layout: ("layout", lambda v: str(v).removeprefix("torch.")),
    torch.memory_format: ("memory_format", lambda v: str(v).removeprefix("torch.")),
    complex: ("complex", lambda v: [v.real, v.imag]),
}


def _encode_value(value, node: fx.Node):
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode_value(v, node) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode_value(v, node) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode_value(v, node) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [_encode_value(v, node) for v in (value.start, value.stop, value.step)]}
    if type(value) in _TAGGED:
        tag, to_json = _TAGGED[type(value)]
        return {tag: to_json(value)}
    raise ExportError(
        f"save_exported: node {node.name!r} has an argument of type {type(value).__name__} "
        f"({value!r}), which the export format cannot store."
    )


def _encode_signature(signature) -> dict:
    fields = {}
    for field in dataclasses.fields(signature):
        value = getattr(signature, field.name)
        if field.name in ("in_spec", "out_spec"):
            try:
                value = pytree.treespec_dumps(value)
            except Exception as error:
                raise ExportError(
                    f"save_exported: the signature's {field.name} holds a pytree node type "
                    f"that cannot be written as data ({error}). Register it with "
                    "torch.utils._pytree.register_pytree_node(..., serialized_type_name=...)."
                ) from error
        elif dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        fields[field.name] = value
    return fields


# ---------------------------------------------------------------------------------------------
# Reading


def decode(description: dict, constants: dict) -> tuple[fx.GraphModule, Optional[dict]]:
    """The graph, and the signature's fields (with specs rebuilt) or None. Raises
    ``DamagedFile`` for anything ``encode`` would not have written."""
    try:
        gm = _decode_graph(description["graph"], "", constants)
        signature = description["signature"]
        if signature is not None:
            signature = dict(signature)
            for field in ("in_spec", "out_spec"):
                signature[field] = pytree.treespec_loads(signature[field])
        return gm, signature
    except (DamagedFile, ExportError):
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as error:
        raise DamagedFile(f"{type(error).__name__}: {error}") from error


def _decode_graph(record: dict, prefix: str, constants: dict) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    attributes: dict[str, Any] = {}
    for name, submodule in record["submodules"].items():
        attributes[name] = _decode_graph(submodule, f"{prefix}{name}.", constants)
    for node_record in record["nodes"]:
        op, name, target = node_record["op"], node_record["name"], node_record["target"]
        if op not in NODE_KINDS:
            raise DamagedFile(f"node {name!r} has kind {op!r}")
        if op == "call_function":
            target = _decode_target(target)
        elif not isinstance(target, str):
            raise DamagedFile(f"node {name!r} has target {target!r}")
        if op == "get_attr" and target not in attributes:
            if prefix + target not in constants:
                raise DamagedFile(f"node {name!r} reads {target!r}, which the file does not hold")
            attributes[target] = constants[prefix + target]
        args = _decode_value(node_record["args"], env)
        kwargs = _decode_value(node_record["kwargs"], env)
        if op == "output":
            graph.output(args[0])
            continue
        node = graph.create_node(op, target, tuple(args), kwargs, name=name)
        if node.name != name:
            raise DamagedFile(f"node name {name!r} is repeated or not a valid name")
        if op == "placeholder" and node_record.get("input") is not None:
            node.meta["aotforge_input"] = _decode_input(node_record["input"])
        env[name] = node
    graph.lint()
    return fx.GraphModule(attributes, graph)


def _decode_target(record: dict):
    if not isinstance(record, dict) or len(record) != 1:
        raise DamagedFile(f"call target {record!r}")
    ((kind, name),) = record.items()
    if kind == "function":
        if name not in PYTHON_FUNCTIONS:
            raise DamagedFile(f"call of {name!r}, which is not a function export graphs use")
        return PYTHON_FUNCTIONS[name]
    if kind == "higher_order":
        operator_ = getattr(torch.ops.higher_order, _identifier(name), None)
        if not isinstance(operator_, torch._ops.HigherOrderOperator):
            raise DamagedFile(f"unknown higher-order operator {name!r}")
        return operator_
    if kind == "op":
        return _resolve_operator(name)
    raise DamagedFile(f"call target {record!r}")


def _resolve_operator(qualified: str) -> torch._ops.OpOverload:
    """``aten::add.Tensor`` -> ``torch.ops.aten.add.Tensor``, for registered operators only."""
    namespace, _, rest = qualified.partition("::")
    name, _, overload = rest.partition(".")
    overload = overload or "default"
    for part in (namespace, name, overload):
        _identifier(part)
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        result = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise ExportError(
            f"load_exported: the graph calls operator {qualified}, which is not registered in "
            "this process. If it is a custom operator, import the library that defines it "
            "before loading."
        ) from None
    if not isinstance(result, torch._ops.OpOverload):
        raise DamagedFile(f"{qualified} is not an operator overload")
    return result


def _identifier(text) -> str:
    """Names looked up on torch.ops must be plain identifiers (no dunders, no paths)."""
    if not isinstance(text, str) or not _IDENTIFIER.fullmatch(text) or text.startswith("__"):
        raise DamagedFile(f"{text!r} is not an operator name")
    return text


def _decode_dtype(name) -> torch.dtype:
    value = getattr(torch, _identifier(name), None)
    if not isinstance(value, torch.dtype):
        raise DamagedFile(f"unknown dtype {name!r}")
    return value


def _decode_attribute_of_type(kind: type):
    def decode_(name):
        value = getattr(torch, _identifier(name), None)
        if not isinstance(value, kind):
            raise DamagedFile(f"unknown {kind.__name__} {name!r}")
        return value

    return decode_


_UNTAG: dict[str, Callable] = {
    "dtype": _decode_dtype,
    "device": torch.device,
    "layout": _decode_attribute_of_type(torch.layout),
    "memory_format": _decode_attribute_of_type(torch.memory_format),
    "complex": lambda parts: complex(*parts),
}


def _decode_value(value, env: dict):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode_value(v, env) for v in value]
    if not isinstance(value, dict) or len(value) != 1:
        raise DamagedFile(f"argument {value!r}")
    ((tag, content),) = value.items()
    if tag == "node":
        if content not in env:
            raise DamagedFile(f"an argument refers to node {content!r} before it is defined")
        return env[content]
    if tag == "tuple":
        return tuple(_decode_value(v, env) for v in content)
    if tag == "dict":
        return {str(k): _decode_value(v, env) for k, v in content.items()}
    if tag == "slice":
        return slice(*(_decode_value(v, env) for v in content))
    if tag in _UNTAG:
        return _UNTAG[tag](content)
    raise DamagedFile(f"argument {value!r}")


def _decode_input(record: dict) -> InputSpec:
    shape = record["shape"]
    if shape is not None:
        if not all(s is None or (isinstance(s, int) and s >= 0) for s in shape):
            raise DamagedFile(f"input shape {shape!r}")
        shape = tuple(shape)
    dtype = None if record["dtype"] is None else _decode_dtype(record["dtype"])
    return InputSpec(str(record["kind"]), shape, dtype)
