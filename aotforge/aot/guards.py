"""What a compiled graph specialized on, besides its tensor arguments, and the checks that keep
a cached graph from being reused after any of it changed.

A trace bakes in everything the function read that is not a graph input: non-tensor
arguments, module modes (``train()``/``eval()``), module attributes, forward hooks, globals,
the autocast state, and which parameters exist. Each call computes a cheap snapshot of these;
a cached graph is reused only if the snapshot is equal to the one it was traced with.
"""
from __future__ import annotations

import enum
import functools
import math
import types
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .reads import forward_reads, reads_of

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
    apart from the parameter and buffer values (graph inputs): modes, hooks, which parameters,
    buffers and submodules exist, each submodule's class and forward, and every value its
    forward (with the methods, properties and same-module helpers it calls) may read: instance
    and class attributes of any kind (contents of lists, dicts and config objects included)
    and globals. ``reads`` finds those names from the code, once per class and forward."""
    parts: list = [_hooks(nn.modules.module._global_forward_hooks), _hooks(nn.modules.module._global_forward_pre_hooks)]
    # What a class (and its globals) provides is the same for every instance: read once per call.
    per_class: dict = {}
    for submodule in _submodules(module):
        attributes = submodule.__dict__
        cls = type(submodule)
        forward = attributes.get("forward")  # a forward assigned on the instance
        forward = cls.forward if forward is None else getattr(forward, "__func__", forward)
        found = per_class.get((cls, forward))
        if found is None:
            found = per_class[cls, forward] = forward_reads(cls, forward)
            reads, _, class_names = found
            parts.append((
                cls, forward,
                tuple(value_state(getattr(cls, name, None), reads.names) for name in class_names),
                tuple(value_state(scope.get(name), reads.names) for scope, names in reads.globals for name in names),
            ))
        forward_hooks, pre_hooks = attributes["_forward_hooks"], attributes["_forward_pre_hooks"]
        parts += (
            cls, forward, attributes["training"],
            _hooks(forward_hooks) if forward_hooks else (),
            _hooks(pre_hooks) if pre_hooks else (),
            tuple(attributes["_parameters"]),
            tuple(attributes["_buffers"]),
            tuple(attributes["_modules"]),
            tuple([value if value is None or value.__class__ in _SELF_KEYED else value_state(value, found[0].names)
                   for value in map(attributes.get, found[1])]),
        )
    return tuple(parts)


def _submodules(module: nn.Module) -> list:
    """``module.modules()`` (each once, in the same order) without building the dotted names."""
    out, seen = [module], {id(module)}
    _collect(module, out, seen)
    return out


def _collect(module: nn.Module, out: list, seen: set) -> None:
    for child in module.__dict__["_modules"].values():
        if child is not None and id(child) not in seen:
            seen.add(id(child))
            out.append(child)
            _collect(child, out, seen)


def _hooks(hooks: dict) -> tuple:
    return tuple((key, id(hook)) for key, hook in hooks.items()) if hooks else ()


class _Same:
    """A cache-key part equal only to a part holding the very same object (tensors and arrays
    compare elementwise, and an id alone could be reused after the object is freed)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is _Same and other.value is self.value

    def __hash__(self):
        return id(self.value)

    def __repr__(self):
        return f"<the same {type(self.value).__name__} at {id(self.value):#x}>"


# Compared by identity (their == is identity already): rebinding recompiles, and what they
# do is code, which a new identity stands for.
_IDENTITY_TYPES = (
    types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type, nn.Module,
    types.MethodType, torch._ops.OpOverload, torch._ops.OpOverloadPacket,
)
_CONTAINER_TYPES = (list, tuple, dict, set, frozenset)
# Values that are their own cache key (equal only to values of their own type, by value or
# identity): skipping value_state for them keeps the per-call check cheap.
_SELF_KEYED = frozenset({
    str, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodType, torch.dtype,
    torch.device,
})
# Containers and objects nest: their contents are read this deep, then compared by identity.
_MAX_DEPTH = 4


def value_state(value: Any, names: frozenset = frozenset(), depth: int = 0) -> Any:
    """A cache-key form of a value the traced code read: plain values by value (with their
    type: 2 and 2.0 trace differently), containers by their contents, objects (a config)
    by the fields among ``names`` (the names the code loads), code and modules by identity,
    tensors by identity and version."""
    kind = type(value)
    if kind is bool or kind is int:  # the common cases first: this runs on every call
        return (kind, value)
    if value is None or kind in _SELF_KEYED or isinstance(value, _IDENTITY_TYPES):
        return value
    if isinstance(value, _ATTRIBUTE_TYPES):
        return (kind, constant_key(value) if isinstance(value, (float, complex)) else value)
    if isinstance(value, torch.Tensor):
        return _tensor_state(value)
    if isinstance(value, weakref.ref):  # (an LSTM keeps weak references to its weights)
        return (weakref.ref, value_state(value(), names, depth + 1))
    if depth >= _MAX_DEPTH:
        return _Same(value)
    if isinstance(value, _CONTAINER_TYPES):
        if isinstance(value, dict):
            return (kind, tuple((key, value_state(item, names, depth + 1)) for key, item in value.items()))
        if isinstance(value, (set, frozenset)):
            return (kind, frozenset(value))
        return (kind, tuple(value_state(item, names, depth + 1) for item in value))
    if isinstance(value, functools.partial):
        return (kind, value_state(value.func), value_state(value.args, names, depth + 1),
                value_state(value.keywords, names, depth + 1))
    fields = getattr(value, "__dict__", None)
    if fields is None:
        slots = getattr(kind, "__slots__", ())
        fields = {name: getattr(value, name, None) for name in ((slots,) if isinstance(slots, str) else slots)}
    if not fields:
        return _Same(value)
    return (_Same(kind), tuple(
        (name, value_state(field, names, depth + 1)) for name, field in fields.items() if name in names
    ))


def _tensor_state(value: torch.Tensor) -> Any:
    """Parameters are graph inputs, so an attribute that caches them (an LSTM's
    ``_flat_weights``, which tracing leaves holding the tracer's stand-ins) adds nothing to the
    key; any other tensor is a constant of the graph, keyed by identity and version (the
    compiler may fold a constant's value into the graph, so an in-place change recompiles)."""
    if isinstance(value, (nn.Parameter, FakeTensor, FunctionalTensor)):
        return _PARAMETER
    return (_Same(value), value._version)


_PARAMETER = ("parameter",)


def only_tensors_changed(before: Any, after: Any) -> bool:
    """Whether two snapshots differ only where one tensor was replaced by another: what a
    traced function leaves when it assigns tensors it computed (spectral_norm's hook sets the
    module's ``weight`` on every call), as opposed to changing Python values it reads."""
    if before == after or (_is_tensor_state(before) and _is_tensor_state(after)):
        return True
    if type(before) is tuple and type(after) is tuple and len(before) == len(after):
        return all(map(only_tensors_changed, before, after))
    return False


def _is_tensor_state(part: Any) -> bool:
    return part is _PARAMETER or (
        type(part) is tuple and len(part) == 2 and type(part[0]) is _Same and isinstance(part[0].value, torch.Tensor)
    )


def closure_state_fn(fn: Callable) -> Callable[[], tuple]:
    """A function returning a snapshot of what ``fn`` reads from outside its arguments: the
    globals its code (and the same-module helper functions it calls) names, the values in its
    closure, and the state of every module among them. Values read elsewhere (by code in other
    modules, or through an argument's attributes) are frozen at trace time."""
    code_owner = getattr(fn, "__func__", fn)  # bound methods: the function's code and globals
    if getattr(code_owner, "__code__", None) is None:
        return tuple  # a builtin or a callable object: nothing we can read
    reads = reads_of(code_owner)
    names = reads.names
    cells = list(code_owner.__closure__ or ())
    bound_self = getattr(fn, "__self__", None)

    def state() -> tuple:
        values = [scope[name] for scope, scope_names in reads.globals for name in scope_names if name in scope]
        for cell in cells:
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell (a name assigned later)
                values.append(None)
        if bound_self is not None:
            values.append(bound_self)
        return tuple(_value_state(value, names) for value in values)

    return state


def _value_state(value: Any, names: frozenset) -> Any:
    if isinstance(value, nn.Module):
        return (value, module_state(value))
    return value_state(value, names)


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
                    raise FakeConstantError(
                        f"Unexpected fake {'param' if name == '_parameters' else 'buffer'} {where}. "
                        f"aotforge: {type(module).__name__}.{where} is a FakeTensor (a tensor "
                        "without data, from another trace); a compiled graph cannot close over "
                        "it. Replace it with a real tensor before compiling."
                    )


class FakeConstantError(ValueError, AssertionError):
    """A FakeTensor where a compiled graph needs data. A ValueError (a wrong argument), and an
    AssertionError, the type PyTorch's aot_module_simplified raises for it (callers catch that)."""


def check_graph_constants(gm, grad_enabled: bool) -> None:
    """Tensors the traced function read without receiving them as arguments became constants
    of the graph. One that requires grad would silently get no gradient: reject it."""
    from torch._subclasses.fake_tensor import FakeTensor

    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        if isinstance(value, FakeTensor):
            raise FakeConstantError(
                f"Unexpected fake buffer {node.target}. "
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
