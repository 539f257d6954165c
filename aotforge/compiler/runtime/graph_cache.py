"""The compiled-graph cache: a restarted process loads a graph's compiled program instead of
compiling it again (no post-grad passes, no lowering, no scheduling, no code generation).

An entry holds what ``runtime.load`` needs, as plain data: the wrapper's source, each
kernel's source and launch metadata, the objects the wrapper refers to by name (devices,
ops by name, constant tensors as raw bytes), the records' counts, and a CPU graph's C++
library (its bytes, checked against their digest when loaded). A GPU graph's Triton binaries
are kept in a sealed entry of their own once its kernels compiled, and written back into
Triton's cache folder (inside ours by default, disk_cache.point_triton_here) on a hit
(triton_binaries.py); autotune choices come from their own entries (disk_cache.py). So a hit
runs no Triton front end and no LLVM/ptxas.

The key is everything that changes the result: the graph as handed to the compiler (its
code, every subgraph's code, the bytes of its constants), each input's metadata (shape or
symbolic shape, stride, storage offset, dtype, device, requires_grad), the graph's kind,
aotforge's config, and versions (a hash of aotforge's own source, torch, Triton, CUDA, the
GPU). The compiler never guards on a symbolic size (sizes.py), so an entry with symbolic
sizes serves any size; the shape guards the graph was compiled under are stored anyway and
checked against the new sizes, so that an entry is never used outside them.

Entries follow disk_cache.py's rules: sealed by a content hash checked on load, named by
their key and checked to hold that key (a swapped file misses), written atomically, never
unpickled (JSON; tensors as raw bytes; the wrapper and kernels are Python text we wrote, as
the kernel modules already are). A bad entry is ignored with one warning and rebuilt.
``AOTFORGE_LOG=cache`` says hit or miss, and for a miss which part of the key changed.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import sys
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import sympy
import torch
import torch.fx as fx

from ... import debug
from ...torch_versions import backed_size_hints
from ..codegen.kernel import KernelSource
from ..codegen.wrapper import Program
from ..expr import FloorDiv, ModularIndexing
from . import compiled as runtime, disk_cache, keys, triton_binaries
from .compiled import CompiledGraph

FORMAT = 3  # 2: kernels name their language; 3: the C++ library's bytes
# Constants above this many bytes in all are not stored (the entry would be a copy of weights).
MAX_CONSTANT_BYTES = 64 << 20
# Variants kept per key (one per set of shape guards the graph was compiled under).
MAX_VARIANTS = 4


Uncacheable = keys.Uncacheable


@dataclasses.dataclass
class Lookup:
    """One graph's key, and what the store after a miss needs."""

    kind: str
    name: str  # for explaining misses: the compile's name and the graph's kind
    key: str
    parts: dict  # key part -> its digest
    symbols: dict  # size symbol name -> (hint, lower bound, upper bound) in this compile
    guards: list  # the shape guards in force, as text


def lookup(kind: str, gm: fx.GraphModule, example_inputs: Sequence[Any],
           run_aten_graph: Callable[[list], Any]) -> tuple[Optional[Lookup], Optional[CompiledGraph]]:
    """The graph's key, and its compiled graph when the cache holds a usable entry.
    (None, None) when caching is off or the graph cannot be keyed."""
    from ...config import config

    if not config.cache:
        return None, None
    triton_binaries.sweep()  # the Triton binaries of graphs stored earlier whose kernels have run since
    started = time.perf_counter()
    name = f"{debug.compile_name() or 'graph'}:{kind}"
    found = keys.safe_key(name, "graph", lambda: _key(kind, name, gm, example_inputs))
    if found is None:
        return None, None
    compiled = load(kind, found.key, found.symbols, run_aten_graph, name, found.parts,
                    {"cache_key": time.perf_counter() - started})
    if compiled is not None:
        _captured(kind, found.key)
    return found, compiled


def load(kind: str, key: str, symbols: dict, run_aten_graph: Optional[Callable[[list], Any]], name: str,
         parts: Optional[dict] = None, timings: Optional[dict] = None,
         symbols_superset: bool = False) -> Optional[CompiledGraph]:
    """The compiled graph stored under ``key`` whose guards hold for ``symbols``; None (with
    the reason under AOTFORGE_LOG=cache, and a warning for a bad entry) when there is none.
    ``symbols_superset``: ``symbols`` holds every symbol of the compile (the AOT cache's, which
    has no graph to read its own from); each variant reads those it was compiled with."""
    started = time.perf_counter()
    path = _path(key)
    entry = keys.read_entry(path, key, FORMAT)
    if entry is None:
        why = keys.explain_miss("graph", name, parts) if parts is not None else "no entry"
        debug.note("cache", f"{name}: compiled-graph miss ({why})")
        return None
    variants = entry.get("variants")
    if not isinstance(variants, list):
        disk_cache.warn_bad_entry(path, "it holds no compiled graphs")
        debug.note("cache", f"{name}: compiled-graph miss (the entry holds no compiled graphs)")
        return None
    failures = [_failed_guard(v, _symbols_of(v, symbols) if symbols_superset else symbols) for v in variants]
    if None not in failures:
        debug.note("cache", f"{name}: compiled-graph miss (the sizes are outside the entry's guards: {failures[0]})")
        return None
    try:
        compiled = _load(variants[failures.index(None)], kind, run_aten_graph, dict(timings or {}))
    except Exception as error:  # noqa: BLE001  any entry we cannot rebuild from: compile instead
        disk_cache.warn_bad_entry(path, f"it cannot be loaded: {type(error).__name__}: {error}")
        debug.note("cache", f"{name}: compiled-graph miss (the entry cannot be loaded)")
        return None
    triton_binaries.restore(key, name)  # before the first launch: Triton finds its kernels compiled
    compiled.timings["cache_load"] = time.perf_counter() - started - compiled.timings.get("load", 0.0)
    debug.note("cache", f"{name}: compiled-graph hit ({key[:16]})")
    return compiled


def store(found: Optional[Lookup], compiled: CompiledGraph) -> None:
    """Write the entry for a graph compiled after a miss. What cannot be stored is logged,
    never raised."""
    if found is None or compiled.program is None:
        return
    try:
        body = _entry(found, compiled)
    except Uncacheable as reason:
        debug.note("cache", f"{found.name}: not stored ({reason})")
        return
    except Exception as error:  # noqa: BLE001  a cache costs time, never the compile
        debug.log_once("cache", f"store:{type(error).__name__}:{error}",
                       f"{found.name}: not stored (describing it failed: {type(error).__name__}: {error})")
        return
    # One entry per key holds a variant per set of shape guards (the same graph compiled under
    # other guards); the last few are kept. Processes storing at once may drop one another's
    # variant: that costs a later miss, never a wrong answer.
    existing = keys.read_entry(_path(found.key), found.key, FORMAT) or {}
    variants = [v for v in existing.get("variants", []) if isinstance(v, dict)
                and (v.get("symbols"), v.get("guards")) != (body["symbols"], body["guards"])]
    keys.write_entry(_path(found.key), found.key, FORMAT, {"variants": variants[-(MAX_VARIANTS - 1):] + [body]})
    keys.remember_parts("graph", found.name, found.parts)
    _captured(found.kind, found.key)
    triton_binaries.watch(found.key, compiled)  # its Triton kernels compile at their first launch


# --- which entries an AOT compile used (the AOT cache refers to them) ---------------------------------

_capture = threading.local()


@contextlib.contextmanager
def capture() -> Iterator[dict]:
    """Collect, per graph kind, the key of every graph compiled in this thread inside the block
    that the cache holds (loaded from it, or stored in it)."""
    keys_by_kind: dict = {}
    previous, _capture.current = getattr(_capture, "current", None), keys_by_kind
    try:
        yield keys_by_kind
    finally:
        _capture.current = previous


def _captured(kind: str, key: str) -> None:
    current = getattr(_capture, "current", None)
    if current is not None:
        current[kind] = key


def _path(key: str) -> str:
    return keys.entry_path("graph", key)


# --- the key ---------------------------------------------------------------------------------

def graph_digests(gm: fx.GraphModule, lifted: frozenset = frozenset()) -> dict:
    """Digests of the graph's code and of its constants' bytes (``lifted``: get_attr targets
    that are inputs at run time, as a module's parameters are under AOT)."""
    constants = {k: v for k, v in _constants(gm).items() if k not in lifted}
    return {
        "graph": disk_cache.digest(graph_text(gm)),
        "constants": disk_cache.digest(b"".join(_constant_digest(t).encode() for t in constants.values())
                                       + json.dumps(sorted(constants)).encode()),
    }


def _key(kind: str, name: str, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Lookup:
    symbols, guards = _shape_guards(example_inputs)
    parts = {
        **graph_digests(gm),
        "inputs": disk_cache.digest(json.dumps([input_description(x) for x in example_inputs])),
        "kind": kind,
        "config": keys.config_digest(),
        "versions": keys.versions_digest(devices(example_inputs, gm)),
    }
    key = disk_cache.digest(json.dumps(parts, sort_keys=True))
    return Lookup(kind, name, key, parts, symbols, guards)


def graph_text(gm: fx.GraphModule) -> str:
    """The code of the graph and of every subgraph (a higher-order op's body is a submodule,
    not part of the parent's code). Targets that are not ops or builtins are refused: their
    meaning lives outside the text."""
    texts = []
    for path, module in gm.named_modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and not _known_target(node.target):
                raise Uncacheable(f"it calls {node.target!r}, whose meaning is not in the graph's text")
            if node.op == "call_module" and not isinstance(module.get_submodule(node.target), fx.GraphModule):
                raise Uncacheable(f"it calls the module {node.target}")
        texts.append(f"# {path or 'root'}\n{module.code}")
    return "\n".join(texts)


def _known_target(target: Any) -> bool:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return True
    module = getattr(target, "__module__", None) or ""
    return module in ("_operator", "operator", "builtins", "math") or module == "torch" or module.startswith("torch.")


def _constants(gm: fx.GraphModule) -> dict:
    """Every tensor a get_attr node of the graph or a subgraph reads, by target (prefixed by
    the subgraph's path)."""
    out = {}
    for path, module in gm.named_modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.find_nodes(op="get_attr"):
            try:
                value = functools.reduce(getattr, node.target.split("."), module)
            except AttributeError:
                raise Uncacheable(f"its attribute {node.target} cannot be read") from None
            if isinstance(value, torch.Tensor):
                out[f"{path}/{node.target}" if path else node.target] = value
            elif not isinstance(value, fx.GraphModule):  # (a subgraph: its code is in the text)
                raise Uncacheable(f"it reads a {type(value).__name__} attribute ({node.target})")
    return out


def _constant_digest(tensor: torch.Tensor) -> str:
    described = json.dumps([list(tensor.shape), list(tensor.stride()), tensor.storage_offset(), str(tensor.dtype),
                            str(tensor.device)])
    return disk_cache.digest(described.encode() + _raw_bytes(tensor))


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)
    if not plain or tensor.is_meta or tensor.layout != torch.strided:
        raise Uncacheable("a constant is not a plain tensor with data")
    span = _span(tensor)
    flat = torch.as_strided(tensor.detach(), (span,), (1,), tensor.storage_offset()).cpu()
    return flat.view(torch.uint8).numpy().tobytes() if span else b""


def _span(tensor: torch.Tensor) -> int:
    """Elements of storage the tensor covers, from its offset."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def _expr_text(value: Any) -> Any:
    if isinstance(value, torch.SymInt):
        return str(value.node.expr)
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        return f"{type(value).__name__}:{value.node.expr}"
    return value


def input_description(value: Any) -> Any:
    """An input as plain data: what the compiled program may depend on. A tensor subclass
    (``__tensor_flatten__``): its class, a digest of the module defining it (its
    ``__torch_dispatch__`` is what the graphs were traced through), its flatten context, its
    outer layout and each inner attribute."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(value, torch.Tensor) and not _is_fake(value) and type(value) not in (torch.Tensor, torch.nn.Parameter) \
            and is_traceable_wrapper_subclass(value):
        names, context = value.__tensor_flatten__()
        cls = type(value)
        return ["subclass", f"{cls.__module__}:{cls.__qualname__}", _module_digest(cls.__module__), repr(context),
                str(value.dtype), str(value.device), [_expr_text(n) for n in value.shape],
                [_expr_text(s) for s in value.stride()], bool(value.requires_grad),
                [[name, input_description(getattr(value, name))] for name in names]]
    if isinstance(value, torch.Tensor):
        return ["tensor", type(value).__name__ if not _is_fake(value) else "Tensor", str(value.dtype),
                str(value.device), [_expr_text(n) for n in value.shape], [_expr_text(s) for s in value.stride()],
                _expr_text(value.storage_offset()), bool(value.requires_grad), str(value.layout)]
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ["symbol", _expr_text(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return [type(value).__name__, value]
    if isinstance(value, (torch.device, torch.dtype)):
        return [type(value).__name__, str(value)]
    if isinstance(value, torch.Generator):
        return ["generator", str(value.device)]
    raise Uncacheable(f"an input of type {type(value).__name__}")


_module_digests: dict = {}


def _module_digest(name: str) -> str:
    """A digest of a module's source file (the code of a tensor subclass defined there)."""
    if name not in _module_digests:
        path = getattr(sys.modules.get(name), "__file__", None)
        try:
            with open(path, "rb") as file:  # type: ignore[arg-type]
                _module_digests[name] = disk_cache.digest(file.read())
        except (OSError, TypeError):
            raise Uncacheable(f"the source of the module {name} cannot be read") from None
    return _module_digests[name]


def devices(example_inputs: Sequence[Any], gm: fx.GraphModule) -> list[str]:
    """The devices of the inputs and of the graph's values (the versions key names their GPUs)."""
    found = {str(x.device) for x in example_inputs if isinstance(x, torch.Tensor)}
    for node in gm.graph.nodes:
        value = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(value, torch.Tensor):
            found.add(str(value.device))
    return sorted(found)


# --- symbolic sizes: the guards an entry was compiled under ------------------------------------

def _symbols_of(variant: Any, symbols: dict) -> dict:
    stored = variant.get("symbols") if isinstance(variant, dict) else None
    return {name: value for name, value in symbols.items() if name in stored} if isinstance(stored, dict) else symbols


def backed_hints(env: Any) -> dict:
    """The ShapeEnv's size symbols with their values in this compile (a copy)."""
    return dict(backed_size_hints(env))


def parse_guard(text: str, symbols: dict) -> Any:
    """A stored guard as a sympy expression over ``symbols`` (name -> the ShapeEnv's Symbol)."""
    expr = sympy.sympify(text, locals=_sympy_names())
    return expr.xreplace({s: symbols[s.name] for s in expr.free_symbols})


def _shape_env(example_inputs: Sequence[Any]) -> Any:
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return value.node.shape_env
        if isinstance(value, torch.Tensor):
            for size in (*value.shape, *value.stride(), value.storage_offset()):
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


def _shape_guards(example_inputs: Sequence[Any]) -> tuple[dict, list]:
    """The size symbols of the inputs with their hints and value ranges, and the guards on
    them (as text); empty for static shapes."""
    env = _shape_env(example_inputs)
    if env is None:
        return {}, []
    names: set[str] = set()
    for value in example_inputs:
        sizes = [value] if isinstance(value, torch.SymInt) else \
            [*value.shape, *value.stride(), value.storage_offset()] if isinstance(value, torch.Tensor) else []
        for size in sizes:
            if isinstance(size, torch.SymInt):
                names |= {s.name for s in size.node.expr.free_symbols}
    symbols = {}
    for symbol, hint in backed_size_hints(env).items():
        if symbol.name in names:
            bounds = env.var_to_range.get(symbol)
            symbols[symbol.name] = (int(hint), _bound(bounds.lower) if bounds else None,
                                    _bound(bounds.upper) if bounds else None)
    guards = []
    for guard in env.guards:
        expr = guard.expr
        if {s.name for s in expr.free_symbols} <= set(symbols):
            text = str(expr)
            if _evaluate(text, {n: v[0] for n, v in symbols.items()}) is not True:
                raise Uncacheable(f"the shape guard {text} cannot be checked from its text")
            guards.append(text)
    return symbols, sorted(set(guards))


def _bound(value: Any) -> Optional[int]:
    """A range's end as an int; None for an unbounded end (torch's int_oo, sympy's oo)."""
    return int(value) if isinstance(value, (int, sympy.Integer)) else None


_SYMPY_NAMES: Optional[dict] = None


def _sympy_names() -> dict:
    global _SYMPY_NAMES
    if _SYMPY_NAMES is None:
        names = {"FloorDiv": FloorDiv, "ModularIndexing": ModularIndexing}
        try:
            import torch.utils._sympy.functions as functions

            names.update({k: v for k, v in vars(functions).items()
                          if isinstance(v, type) and issubclass(v, sympy.Basic)})
        except ImportError:
            pass
        _SYMPY_NAMES = names
    return _SYMPY_NAMES


def _evaluate(text: str, hints: dict) -> Optional[bool]:
    """A guard's truth for the hints; None when it cannot be decided from its text."""
    try:
        expr = sympy.sympify(text, locals=_sympy_names())
        value = expr.subs({s: hints[s.name] for s in expr.free_symbols})
    except Exception:  # noqa: BLE001  text sympy cannot read back
        return None
    if value in (sympy.true, True):
        return True
    if value in (sympy.false, False):
        return False
    return None


def _failed_guard(entry: dict, symbols: dict) -> Optional[str]:
    """Why the current sizes fall outside the entry's guards, or None when they do not."""
    try:
        return _check_guards(entry, symbols)
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        return f"its guards cannot be read ({type(error).__name__}: {error})"


def _check_guards(entry: dict, symbols: dict) -> Optional[str]:
    stored = entry.get("symbols", {})
    if set(stored) != set(symbols):
        return f"its size symbols are {sorted(stored)}, these are {sorted(symbols)}"
    hints = {name: value[0] for name, value in symbols.items()}
    for name, (_, lower, upper) in stored.items():
        if (lower is not None and hints[name] < lower) or (upper is not None and hints[name] > upper):
            return f"{name} = {hints[name]} is outside [{lower}, {upper}]"
    for text in entry.get("guards", []):
        if _evaluate(text, hints) is not True:
            return f"{text} does not hold for {hints}"
    return None


# --- the entry ---------------------------------------------------------------------------------

def _entry(found: Lookup, compiled: CompiledGraph) -> dict:
    blobs: list[str] = []
    namespace = {name: describe_object(value, blobs) for name, value in compiled.program.namespace.items()}
    if sum(len(b) for b in blobs) * 3 // 4 > MAX_CONSTANT_BYTES:
        raise Uncacheable(f"its constants are larger than {MAX_CONSTANT_BYTES >> 20} MiB")
    return {
        "kind": found.kind,
        "wrapper": compiled.program.source,
        "language": compiled.language,
        "namespace": namespace,
        "blobs": blobs,
        "kernels": [_describe_kernel(k) for k in compiled.kernels],
        "symbols": {name: value for name, value in found.symbols.items()},
        "guards": found.guards,
        "stats": _stats(compiled),
        "library": _describe_library(compiled),
    }


def describe_object(value: Any, blobs: list) -> dict:
    """A wrapper namespace entry as plain data."""
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch._ops.OpOverload):
        return {"op": [value.namespace, value._schema.name.split("::")[1], value._overloadname]}
    if isinstance(value, torch._ops.OpOverloadPacket):
        return {"packet": [value._qualified_op_name.split("::")[0], value._qualified_op_name.split("::")[1]]}
    if isinstance(value, torch.Tensor):
        if value.storage_offset() != 0:
            raise Uncacheable("a constant is a view with a storage offset")
        blobs.append(base64.b64encode(_raw_bytes(value)).decode())
        return {"tensor": [len(blobs) - 1, str(value.dtype).removeprefix("torch."), list(value.shape),
                           list(value.stride()), str(value.device), bool(value.requires_grad)]}
    if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and value == value):
        return {"value": value}
    raise Uncacheable(f"the wrapper refers to a {type(value).__name__}")


def rebuild_object(described: dict, blobs: list) -> Any:
    (kind, value), = described.items()
    if kind == "device":
        return torch.device(value)
    if kind == "dtype":
        return _dtype(value)
    if kind == "op":
        return getattr(getattr(getattr(torch.ops, value[0]), value[1]), value[2])
    if kind == "packet":
        return getattr(getattr(torch.ops, value[0]), value[1])
    if kind == "tensor":
        index, dtype, shape, stride, device, requires_grad = value
        raw = bytearray(base64.b64decode(blobs[index], validate=True))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        flat = flat.view(_dtype(dtype)).to(device)  # the storage span, laid out below as it was
        return torch.as_strided(flat, shape, stride, 0).requires_grad_(requires_grad)
    if kind == "value":
        return value
    raise ValueError(f"unknown namespace entry {kind!r}")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _describe_kernel(kernel: KernelSource) -> dict:
    return {
        "group": kernel.group, "name": kernel.name, "source": kernel.source, "arguments": list(kernel.arguments),
        "dtypes": [None if d is None else str(d).removeprefix("torch.") for d in kernel.dtypes],
        "numel": str(kernel.numel), "rnumel": str(kernel.rnumel), "kind": kernel.kind, "mutates": kernel.mutates,
        "reduction_contiguous": kernel.reduction_contiguous, "size_symbols": [s.name for s in kernel.size_symbols],
        "hints": list(kernel.hints), "int64": kernel.int64, "language": kernel.language,
    }


def _kernel(data: dict) -> KernelSource:
    def size(text: str) -> Any:
        expr = sympy.sympify(text, locals={**_sympy_names(), **{s: sympy.Symbol(s, integer=True, positive=True)
                                                                 for s in data["size_symbols"]}})
        return int(expr) if expr.is_Integer else expr

    return KernelSource(
        data["group"], data["name"], data["source"], tuple(data["arguments"]),
        tuple(None if d is None else _dtype(d) for d in data["dtypes"]), size(data["numel"]), size(data["rnumel"]),
        data["kind"], bool(data["mutates"]), bool(data["reduction_contiguous"]),
        tuple(sympy.Symbol(s, integer=True, positive=True) for s in data["size_symbols"]),
        tuple(int(h) for h in data["hints"]), bool(data["int64"]), str(data["language"]))


# --- the C++ library inside the entry -------------------------------------------------------------
# A hit loads the graph's shared library from the bytes its entry keeps (sealed with the rest),
# written once to a file named by its digest, so that it neither compiles nor needs the C++
# compiler, nor the C++ library cache. A file at that name whose bytes do not hash to it (cut
# short, flipped, swapped) is refused with a warning and rewritten from the entry. The CPU's
# model and flags are kept too: -march=native code from another CPU is not loaded (it would
# crash, not raise), and the graph's kernels are built again instead.

def _describe_library(compiled: CompiledGraph) -> Optional[dict]:
    if not compiled.kernels or compiled.kernels[0].language != "cpp":
        return None
    from . import cpp_build

    library = getattr(next(iter(compiled.launchers.values())), "library", None)
    if library is None:
        return None
    with open(library.path, "rb") as file:
        data = file.read()
    return dict(sha256=disk_cache.digest(data), cpu=cpp_build.cpu_identity(), data=base64.b64encode(data).decode())


def _adopt_library(stored: dict, kernels: tuple) -> Any:
    from ..codegen.cpp_entry import graph_translation_unit
    from . import cpp_build

    if stored["cpu"] != cpp_build.cpu_identity():
        return None  # another CPU's code: the loader builds the kernels for this one
    source = graph_translation_unit(kernels)  # (as cpp_launch.load_kernels makes the translation unit)
    expected = str(stored["sha256"])
    path = os.path.join(disk_cache.cache_directory(), f"cpp_graph_{expected[:48]}.so")
    if path not in cpp_build.loaded_paths():
        existing = disk_cache.read_bytes(path)
        if existing is None or disk_cache.digest(existing) != expected:
            if existing is not None:
                disk_cache.warn_bad_entry(path, "its content does not match the digest its compiled-graph entry holds")
            data = base64.b64decode(stored["data"], validate=True)
            if disk_cache.digest(data) != expected:
                raise ValueError("the library's bytes do not match their digest")
            disk_cache.atomic_write(path, data)
    return cpp_build.adopt(source, path)


def _stats(compiled: CompiledGraph) -> dict:
    return dict(externs=len(compiled.kernel_plan.steps) - len(compiled.kernels),
                lowered=dict(compiled.lowered.lowered_ops), fallbacks=dict(compiled.lowered.fallback_ops),
                lowering_errors=[str(e) for e in compiled.lowered.lowering_errors])


def _load(entry: dict, kind: str, run_aten_graph: Callable[[list], Any], timings: dict) -> CompiledGraph:
    if entry.get("kind") != kind:
        raise ValueError(f"it holds a {entry.get('kind')} graph, not a {kind} graph")
    blobs = entry["blobs"]
    namespace = {name: rebuild_object(described, blobs) for name, described in entry["namespace"].items()}
    kernels = tuple(_kernel(k) for k in entry["kernels"])
    # (held until the kernels are loaded: they keep it alive, the adoption table does not)
    adopted = _adopt_library(entry["library"], kernels) if entry.get("library") is not None else None
    compiled = runtime.load(kind, None, None, None, kernels, Program(entry["wrapper"], namespace), timings,
                            run_aten_graph=run_aten_graph, precompile=False, language=entry.get("language", "triton"))
    compiled.cached_stats = dict(entry["stats"])
    del adopted
    return compiled


# what the AOT cache (compiler/aot_cache.py) shares with this one
shape_env, shape_guards, failed_guard = _shape_env, _shape_guards, _failed_guard


# what the AOT cache (compiler/aot_cache.py) shares with this one
shape_env, shape_guards, failed_guard = _shape_env, _shape_guards, _failed_guard
