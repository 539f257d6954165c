"""The AOT cache: under torch.compile, a new process that is handed a Dynamo graph it compiled
before skips AOT autograd entirely (no tracing, no partitioning) and the compiler too: it
rebuilds the runtime wrappers (aot/cache.py) around compiled graphs loaded from the
compiled-graph cache (runtime/graph_cache.py).

The key, as for inductor's FX graph cache, is the Dynamo graph's code and constants, the
example inputs' metadata (parameters and buffers included, with their names), the global state
tracing reads (grad mode, autocast, default dtype, deterministic algorithms), aotforge's config
and the versions. An entry names the compiled-graph entries of its forward and backward (or
inference) graph; a compile whose graphs are not all in that cache, whose runtime is not plain
data (aot/cache.py says which), with symbolic sizes, with inputs that share memory, or under
``config.verify`` is not stored, and is compiled as usual next time.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from .. import debug
from ..aot import cache as aot_plan
from ..aot.api import bind_parameters, lifted_state
from ..aot.guards import autocast_state
from ..config import config
from .runtime import disk_cache, graph_cache, keys

FORMAT = 1


@dataclasses.dataclass
class Lookup:
    name: str
    key: str
    parts: dict


def lookup(model: Any, example_inputs: Sequence[Any], inner_compile: Callable,
           boxed: Callable) -> tuple[Optional[Lookup], Optional[Callable]]:
    """The compile's key, and its rebuilt callable when the cache holds a usable entry.
    ``boxed``: makes the callable of a loaded compiled graph (the pipeline's)."""
    if not config.cache:
        return None, None
    name = f"{debug.compile_name() or 'graph'}:aot"
    if config.verify or not getattr(inner_compile, "aot_cacheable", False):
        debug.note("cache", f"{name}: AOT compile not cached (config.verify, or a compiler of the caller's own)")
        return None, None
    started = time.perf_counter()
    try:
        found = _key(name, model, example_inputs)
    except graph_cache.Uncacheable as reason:
        debug.note("cache", f"{name}: AOT compile not cached ({reason})")
        return None, None
    except Exception as error:  # noqa: BLE001  a cache costs time, never the compile
        debug.log_once("cache", f"aot key:{type(error).__name__}:{error}",
                       f"{name}: AOT compile not cached (computing its key failed: {type(error).__name__}: {error})")
        return None, None
    path = keys.entry_path("compile", found.key)
    entry = keys.read_entry(path, found.key, FORMAT)
    if entry is None:
        debug.note("cache", f"{name}: AOT miss ({keys.explain_miss('compile', name, found.parts)})")
        return found, None
    try:
        compiled = {}
        for kind, key in entry["graphs"].items():
            graph = graph_cache.load(kind, key, {}, None, f"{name}:{kind}")
            if graph is None:
                debug.note("cache", f"{name}: AOT miss (its {kind} graph is not in the compiled-graph cache)")
                return found, None
            compiled[kind] = boxed(graph)
        run = aot_plan.rebuild(entry["plan"], compiled)
    except Exception as error:  # noqa: BLE001  an entry we cannot rebuild from: compile instead
        disk_cache.warn_bad_entry(path, f"it cannot be loaded: {type(error).__name__}: {error}")
        debug.note("cache", f"{name}: AOT miss (the entry cannot be loaded)")
        return found, None
    params, _ = lifted_state(model)
    debug.note("cache", f"{name}: AOT hit ({found.key[:16]}, {time.perf_counter() - started:.3f}s)")
    return found, bind_parameters(run, params, model)


def store(found: Optional[Lookup], compiled: Callable, graph_keys: dict) -> None:
    """Write the entry for a compile made after a miss (``graph_keys``: the compiled-graph
    cache keys of its graphs, by kind)."""
    if found is None:
        return
    plan = getattr(compiled, "aot_plan", None)
    if plan is None:
        why = getattr(compiled, "aot_plan_missing", None) or "its runtime is not plain data"
        debug.note("cache", f"{found.name}: AOT compile not stored ({why})")
        return
    needed = ("forward", "backward") if plan["training"] else ("inference",)
    missing = [kind for kind in needed if kind not in graph_keys]
    if missing:
        debug.note("cache", f"{found.name}: AOT compile not stored (its {', '.join(missing)} graph is not in the "
                            "compiled-graph cache)")
        return
    body = dict(plan=plan, graphs={kind: graph_keys[kind] for kind in needed})
    keys.write_entry(keys.entry_path("compile", found.key), found.key, FORMAT, body)
    keys.remember_parts("compile", found.name, found.parts)


def _key(name: str, model: Any, example_inputs: Sequence[Any]) -> Lookup:
    if not isinstance(model, fx.GraphModule):
        raise graph_cache.Uncacheable(f"the model is a {type(model).__name__}, not an FX graph")
    params, names = lifted_state(model)
    inputs = [*params, *example_inputs]
    if any(isinstance(s, torch.SymInt) for x in inputs if isinstance(x, torch.Tensor)
           for s in (*x.shape, *x.stride(), x.storage_offset())) or any(
            isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) for x in inputs):
        raise graph_cache.Uncacheable("it has symbolic sizes")
    _check_no_shared_memory(inputs)
    parts = {
        **graph_cache.graph_digests(model, frozenset(names)),
        "inputs": disk_cache.digest(json.dumps([names, [graph_cache.input_description(x) for x in inputs]])),
        "mode": disk_cache.digest(json.dumps(_global_state(), default=str)),
        "config": keys.config_digest(),
        "versions": keys.versions_digest(graph_cache.devices(inputs, model)),
    }
    return Lookup(name, disk_cache.digest(json.dumps(parts, sort_keys=True)), parts)


def _check_no_shared_memory(inputs: Sequence[Any]) -> None:
    """Inputs that share memory are traced through synthetic bases, which an entry cannot
    describe; whether two inputs share memory is not in their metadata, so it is checked."""
    seen: set = set()
    for value in inputs:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()._cdata
            if storage in seen:
                raise graph_cache.Uncacheable("two inputs share memory")
            seen.add(storage)


def _global_state() -> dict:
    """What AOT tracing reads from outside the graph and its inputs."""
    return dict(grad=torch.is_grad_enabled(), autocast=autocast_state(), default_dtype=str(torch.get_default_dtype()),
                deterministic=torch.are_deterministic_algorithms_enabled())
