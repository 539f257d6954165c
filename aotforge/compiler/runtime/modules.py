"""Generated modules: importing a kernel module's source (backed by a file in the cache
directory, which Triton's JIT and the compile workers read back) and remembering what this
process loaded, so that a compile worker can check it imports the same text."""
from __future__ import annotations

import linecache
import os
import sys
import threading
import types
import weakref
from typing import Any, Optional

from . import disk_cache


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --- loading generated modules ----------------------------------------------------------

# One lock for all loads: two threads compiling at once must never see a module another
# thread is still executing, and a module whose execution failed must not stay registered.
_load_lock = threading.RLock()  # reentrant: a module's finalizer may run inside a load
# Generated modules are not put in sys.modules: they live as long as a kernel uses them (each
# Kernel holds its module), so a process that compiles for days keeps only the live ones.
# name -> module, while some kernel holds it (identical sources share one module)
_modules: "weakref.WeakValueDictionary[str, types.ModuleType]" = weakref.WeakValueDictionary()
# file -> (module name, digest of its source) for every live module this process loaded
_loaded_paths: dict[str, tuple[str, str]] = {}


def module_name(stem: str, source_digest: str) -> str:
    return f"aotforge_generated_{stem}_{source_digest[:16]}"


def load_module(source: str, stem: str) -> Any:
    """Import ``source`` as a module, backed by a file in the cache directory (Triton's JIT
    reads a kernel's source back through ``inspect``; compile workers import the file).

    The module is executed from ``source`` itself, never from the file's current content: the
    file is checked (and rewritten when it does not hold ``source``), and ``linecache`` is
    pinned to ``source`` so that Triton reads the text we meant even if the file changes.
    What the load registered (the pinned lines, Triton's registry entries) goes with the
    module once no kernel holds it."""
    with _load_lock:
        path, source_digest = disk_cache.store_module(source, stem)
        name = module_name(stem, source_digest)
        module = _modules.get(name)
        if module is not None and getattr(module, "__aotforge_digest__", None) == source_digest:
            _loaded_paths[path] = (name, source_digest)
            return module
        module = execute_module(name, path, source)
        module.__aotforge_digest__ = source_digest
        _modules[name] = module  # only now: a failed execution leaves nothing behind
        _loaded_paths[path] = (name, source_digest)
        weakref.finalize(module, _forget_module, name, path, linecache.cache.get(path))
        return module


def _forget_module(name: str, path: str, lines: Any) -> None:
    """Drop what loading a module registered, unless a newer load of the same file owns it."""
    with _load_lock:
        if name in _modules:
            return
        if _loaded_paths.get(path, (None,))[0] == name:
            del _loaded_paths[path]
        if linecache.cache.get(path) is lines:
            del linecache.cache[path]
        # Triton keeps every JITFunction by "module:name" (to deserialize preloaded kernels),
        # the interpreter one per launch
        registry = getattr(sys.modules.get("triton.runtime.jit"), "_triton_jit_function_registry", None)
        for key in [key for key in registry or () if key.startswith(name + ":")]:
            registry.pop(key, None)


def loaded_module(path: str) -> Optional[tuple[str, str]]:
    """(module name, source digest) of a module this process loaded from ``path``."""
    return _loaded_paths.get(path)


def execute_module(name: str, path: str, source: str) -> types.ModuleType:
    """A new module ``name`` made by executing ``source``, with ``path`` as its file name."""
    module = types.ModuleType(name)
    module.__file__ = path
    # mtime None: linecache.checkcache keeps the entry instead of re-reading the file
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def module_file(fn: Any) -> Optional[str]:
    """The file of the generated module that defines the jitted function ``fn``."""
    namespace = getattr(getattr(fn, "fn", fn), "__globals__", None)
    if namespace is not None:
        return namespace.get("__file__")
    module = sys.modules.get(getattr(fn, "module", None) or getattr(fn, "__module__", ""))
    return getattr(module, "__file__", None)
