"""Eager's aliasing where PyTorch's Python kernels differ from its C++ ones, while we trace.

Tracing runs under the Python dispatcher, which prefers an op's Python kernels (``py_impl``) to
its C++ ones. For ``aten.dropout`` those (torch/_decomp, up to at least torch 2.13) return
``input.clone()`` when dropout does nothing (``train=False`` or ``p == 0``), where eager's
C++ kernel returns the input itself. A program that changes the result in place
(``h = self.drop(x); h += 1`` in eval mode) changes ``x`` in eager; traced with the clone it
would not, and the compiled program would silently give another value. While a trace runs,
``eager_aliasing_kernels()`` puts eager's behaviour in their place, and restores them after.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch._C import DispatchKey

aten = torch.ops.aten

_KEYS = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)
_lock = threading.RLock()
_depth = [0]
_saved: dict = {}


def _dropout_as_eager(input: torch.Tensor, p: float, train):
    """aten.dropout as eager's C++ kernel: the input itself when dropout does nothing."""
    if train and p != 0:
        return aten.native_dropout(input, p, train)[0]
    return input


_EAGER = {aten.dropout.default: _dropout_as_eager}


@contextlib.contextmanager
def eager_aliasing_kernels():
    """While inside: ops in ``_EAGER`` run eager's aliasing Python kernel under the Python
    dispatcher (re-entrant; the Python kernels found are restored on the way out)."""
    with _lock:
        if _depth[0] == 0:
            for op, kernel in _EAGER.items():
                found = {key: op.py_kernels[key] for key in _KEYS if key in op.py_kernels}
                _saved[op] = found
                for key in found:
                    op.py_kernels[key] = kernel
                op._dispatch_cache.clear()
        _depth[0] += 1
    try:
        yield
    finally:
        with _lock:
            _depth[0] -= 1
            if _depth[0] == 0:
                for op, found in _saved.items():
                    for key, kernel in found.items():
                        op.py_kernels[key] = kernel
                    op._dispatch_cache.clear()
                _saved.clear()
