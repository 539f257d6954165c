"""What a function or a module's forward may read from outside its arguments, found from its
code (no tracing): the names its bytecode loads, the globals among them, and, followed
transitively, the code of the methods, properties and same-module helper functions it calls.

A compiled graph bakes in every such value it read; ``guards`` snapshots them on each call so
that a cached graph is never reused after one of them changed. The analysis is a superset of
what one trace reads (both branches of an ``if``), which only costs a few more reads per call.
"""
from __future__ import annotations

import builtins
import dataclasses
import dis
import functools
import types
from typing import Callable, Optional

import torch.nn as nn

# Helper functions in torch are not followed: what they read is torch's state, not the user's.
_LIBRARY_PREFIXES = ("torch.", "torch")


@dataclasses.dataclass(frozen=True, eq=False)
class Reads:
    """The names some code loads (attribute names, globals and identifier-like string
    constants such as ``getattr(self, "scale")``), and the globals it reads, per globals dict."""

    names: frozenset
    globals: tuple  # ((globals dict, (name, ...)), ...)


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


def _code_names(code: types.CodeType) -> tuple[set, set]:
    """The names ``code`` (and the code nested in it) loads, and which of them it loads as
    globals (also those not defined yet: a global assigned after compiling is still read)."""
    names = set(code.co_names)
    global_names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            nested, nested_globals = _code_names(constant)
            names |= nested
            global_names |= nested_globals
        elif isinstance(constant, str) and constant.isidentifier():
            names.add(constant)
    return names, global_names


def _function_of(value) -> Optional[types.FunctionType]:
    """The Python function behind a method, property getter, static/class method, partial or
    ``functools.wraps`` decorator, or None."""
    seen = 0
    while seen < 8:
        seen += 1
        if isinstance(value, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        elif isinstance(value, functools.partial):
            value = value.func
        elif isinstance(value, types.FunctionType):
            wrapped = getattr(value, "__wrapped__", None)
            if wrapped is None:
                return value
            value = wrapped
        else:
            return None
    return None


def _is_user_helper(function: types.FunctionType, root: types.FunctionType) -> bool:
    """A function defined in the same module as ``root``, outside torch: its reads count as
    ``root``'s. (A method of the module's class is followed even for torch's own modules.)"""
    module = function.__globals__.get("__name__", "") or ""
    return function.__globals__ is root.__globals__ and not module.startswith(_LIBRARY_PREFIXES)


def _class_attribute(cls: type, name: str):
    """``name`` as found on ``cls``'s MRO below nn.Module (nn.Module's own methods are torch's,
    not the user's), or None."""
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            return None
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def reads_of(function: Callable, cls: Optional[type] = None) -> Reads:
    """What ``function`` (and, if ``cls`` is given, ``self``'s methods and properties it calls)
    may read. Helper functions are followed when they live in the same module as ``function``
    (outside torch)."""
    root = _function_of(function)
    if root is None:
        return Reads(frozenset(), ())
    names: set = set()
    globals_read: dict[int, tuple[dict, set]] = {}
    pending = [root]
    visited: set = set()
    while pending:
        current = pending.pop()
        if id(current.__code__) in visited:
            continue
        visited.add(id(current.__code__))
        code_names, global_names = _code_names(current.__code__)
        names |= code_names
        scope = current.__globals__
        used = globals_read.setdefault(id(scope), (scope, set()))[1]
        for cell in current.__closure__ or ():
            try:
                helper = _function_of(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
            if helper is not None and _is_user_helper(helper, root):
                pending.append(helper)
        used |= {name for name in global_names if name in scope or not hasattr(builtins, name)}
        for name in code_names:
            if name in scope:
                helper = _function_of(scope[name]) if isinstance(scope[name], types.FunctionType) else None
                if helper is not None and _is_user_helper(helper, root):
                    pending.append(helper)
            if cls is not None:
                helper = _function_of(_class_attribute(cls, name))
                if helper is not None:
                    pending.append(helper)
    return Reads(
        frozenset(names),
        tuple((scope, tuple(sorted(used))) for scope, used in globals_read.values() if used),
    )


@functools.lru_cache(maxsize=4096)
def forward_reads(cls: type, forward: Callable) -> tuple[Reads, tuple, tuple]:
    """For a module class and its forward (the function, never a bound method, which would keep
    its module alive in this cache): the reads, the names to look up in an instance's
    ``__dict__`` and the names to look up on the class (class attributes, methods, properties
    defined below nn.Module)."""
    reads = reads_of(forward, cls)
    module_names = set(nn.Module.__dict__) - {"forward", "training"}
    instance_names = tuple(sorted(n for n in reads.names if n not in module_names))
    class_names = tuple(sorted(n for n in reads.names if _class_attribute(cls, n) is not None))
    return reads, instance_names, class_names
