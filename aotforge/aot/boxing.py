"""The boxed calling convention: a compiled callable takes ONE list of arguments, which it
may clear so that inputs die as early as possible."""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.fx as fx


def make_boxed_func(fn: Callable) -> Callable:
    """Turn ``fn(*args)`` into ``boxed(args_list)``; the list is cleared before the call."""
    if getattr(fn, "_boxed_call", False):
        return fn

    def boxed(args: list):
        flat = list(args)
        args.clear()
        return fn(*flat)

    boxed._boxed_call = True  # type: ignore[attr-defined]
    return boxed


def make_boxed_compiler(compiler: Callable) -> Callable:
    """Wrap a compiler so that the callable it returns is boxed."""

    @functools.wraps(compiler)
    def boxed_compiler(gm: fx.GraphModule, example_inputs):
        return make_boxed_func(compiler(gm, example_inputs))

    return boxed_compiler


def nop(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """A compiler that compiles nothing: the graph runs as FX."""
    return gm


boxed_nop = make_boxed_compiler(nop)


def call_compiled(fn: Callable, args: list):
    """Call a compiled graph boxed or not, as it declares; the result is always a list.

    Autocast is off inside: a graph traced under autocast already holds its casts, and its
    regions that autocast was disabled in (a rotary embedding's float32 matmul) must not be
    cast again when the graph's ATen calls run under the caller's autocast."""
    if torch._C._is_any_autocast_enabled():
        with torch._C._DisableAutocast():
            out = fn(args) if getattr(fn, "_boxed_call", False) else fn(*args)
    elif getattr(fn, "_boxed_call", False):
        out = fn(args)
    else:
        out = fn(*args)
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]
