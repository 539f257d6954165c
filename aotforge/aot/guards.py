"""What a compiled graph specialized on, besides its tensor arguments, and the checks that keep
a cached graph from being reused after any of it changed.

A trace bakes in everything the function read that is not a graph input: non-tensor
arguments, module modes (``train()``/``eval()``), module attributes, forward hooks, globals,
the autocast state, and which parameters exist. Each call computes a cheap snapshot of these;
a cached graph is reused only if the snapshot is equal to the one it was traced with.
"""
from __future__ import annotations

import enum
import math
import types
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

# Non-tensor argument types a graph can be specialized on: compared by value.
_VALUE_TYPES = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
    torch.memory_format, torch.Size, slice, type(Ellipsis), enum.Enum,
)
# Plain attribute values a module's forward may branch on: compared by value.
_ATTRIBUTE_TYPES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, enum.Enum)


class _NaN:
    """float('nan') as a cache key: equal to itself (NaN != NaN would recompile every call)."""

    def __eq__(self, other):
        return isinstance(other, _NaN)

    def __hash__(self):
        return 0

    def __repr__(self):
        return "nan"


NAN = _NaN()


def constant_key(value: Any) -> Any:
    """The cache-key form of a non-tensor argument; unsupported types are a clear error."""
    if isinstance(value, float):
        return NAN if math.isnan(value) else value
    if isinstance(value, complex) and (math.isnan(value.real) or math.isnan(value.imag)):
        return ("complex", constant_key(value.real), constant_key(value.imag))
    if isinstance(value, _VALUE_TYPES):
        return value
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type, torch._ops.OpOverload)):
        return ("object", id(value))  # called, not read: its identity is what was traced
    raise TypeError(
        f"aotforge: an argument of type {type(value).__module__}.{type(value).__qualname__} "
        "cannot be passed to a compiled function: only tensors, SymInts and plain constants "
        "(None, bool, int, float, complex, str, dtype, device, ...) in tuples, lists and dicts "
        "are supported. Convert it to a tensor first (for a numpy array: torch.from_numpy)."
    )


def autocast_state() -> tuple:
    """Autocast on/off and its dtype, per device type (the dtype changes the traced casts)."""
    state = []
    for device in ("cpu", "cuda"):
        enabled = torch.is_autocast_enabled(device)
        state.append(enabled)
        if enabled:
            state.append(torch.get_autocast_dtype(device))
    return tuple(state)


def module_state(module: nn.Module) -> tuple:
    """Everything about ``module`` and its submodules that a trace of its forward bakes in,
    apart from the parameter and buffer values (graph inputs): modes, hooks, plain attributes,
    and which parameters, buffers and submodules exist."""
    parts: list = [_hooks(nn.modules.module._global_forward_hooks), _hooks(nn.modules.module._global_forward_pre_hooks)]
    for submodule in module.modules():
        attributes = submodule.__dict__
        parts.append(submodule.training)
        parts.append(_hooks(submodule._forward_hooks))
        parts.append(_hooks(submodule._forward_pre_hooks))
        parts.append(tuple(attributes["_parameters"]))
        parts.append(tuple(attributes["_buffers"]))
        parts.append(tuple(attributes["_modules"]))
        parts.append(
            tuple((name, value) for name, value in attributes.items() if isinstance(value, _ATTRIBUTE_TYPES))
        )
    return tuple(parts)


def _hooks(hooks: dict) -> tuple:
    return tuple((key, id(hook)) for key, hook in hooks.items()) if hooks else ()


def closure_state_fn(fn: Callable) -> Callable[[], tuple]:
    """A function returning a snapshot of what ``fn`` reads from outside its arguments: the
    globals its code names, the values in its closure, and the state of every module among
    them."""
    code_owner = getattr(fn, "__func__", fn)  # bound methods: the function's code and globals
    code = getattr(code_owner, "__code__", None)
    if code is None:
        return tuple  # a builtin or a callable object: nothing we can read
    global_names = sorted(set(_names(code)) & set(code_owner.__globals__))
    module_globals = code_owner.__globals__
    cells = list(code_owner.__closure__ or ())
    bound_self = getattr(fn, "__self__", None)

    def state() -> tuple:
        values = [module_globals[name] for name in global_names if name in module_globals]
        for cell in cells:
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell (a name assigned later)
                values.append(None)
        if bound_self is not None:
            values.append(bound_self)
        return tuple(_value_state(value) for value in values)

    return state


def _names(code: types.CodeType) -> Iterable[str]:
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names(constant)


def _value_state(value: Any) -> Any:
    if isinstance(value, nn.Module):
        return (id(value), module_state(value))
    if isinstance(value, float):
        return constant_key(value)
    if isinstance(value, _ATTRIBUTE_TYPES):
        return value
    return ("object", id(value))  # functions, modules, tensors: rebinding recompiles


def check_no_fake_constants(module: nn.Module) -> None:
    """A module holding a FakeTensor (left over from some other trace) has no data to run on:
    reject it now, by name, instead of failing somewhere inside tracing."""
    from torch._subclasses.fake_tensor import FakeTensor

    for prefix, submodule in module.named_modules(remove_duplicate=False):
        for name, value in submodule.__dict__.items():
            tensors = {**value} if name in ("_parameters", "_buffers") else {name: value}
            for attribute, tensor in tensors.items():
                if isinstance(tensor, FakeTensor):
                    where = f"{prefix}.{attribute}" if prefix else attribute
                    raise ValueError(
                        f"aotforge: {type(module).__name__}.{where} is a FakeTensor (a tensor "
                        "without data, from another trace); a compiled graph cannot close over "
                        "it. Replace it with a real tensor before compiling."
                    )


def check_graph_constants(gm, grad_enabled: bool) -> None:
    """Tensors the traced function read without receiving them as arguments became constants
    of the graph. One that requires grad would silently get no gradient: reject it."""
    from torch._subclasses.fake_tensor import FakeTensor

    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        if isinstance(value, FakeTensor):
            raise ValueError(
                f"aotforge: the traced function closes over a FakeTensor constant ({node.target}); "
                "a compiled graph needs real data. Pass it as an argument or use a real tensor."
            )
        if grad_enabled and isinstance(value, torch.Tensor) and value.requires_grad:
            raise RuntimeError(
                "aotforge: the function reads a tensor that requires grad but is not one of its "
                f"arguments (a {tuple(value.shape)} {'parameter' if isinstance(value, nn.Parameter) else 'tensor'} "
                "it closes over, e.g. a module's weight); its gradient would be lost. Compile the "
                "module with aotforge.aot_module, or pass the tensor as an argument."
            )
