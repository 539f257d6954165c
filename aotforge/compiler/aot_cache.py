"""The AOT cache: under torch.compile, a new process that is handed a Dynamo graph it compiled
before skips AOT autograd entirely (no tracing, no partitioning) and the compiler too: it
rebuilds the runtime wrappers (aot/cache.py) around compiled graphs loaded from the
compiled-graph cache (runtime/graph_cache.py).

The key, as for inductor's FX graph cache, is the Dynamo graph's code and constants, the
example inputs' metadata (parameters and buffers included, with their names), the global state
tracing reads (grad mode, autocast, default dtype, deterministic algorithms), aotforge's config
and the versions. An entry names the compiled-graph entries of its forward and backward (or
inference) graph; a compile whose graphs are not all in that cache, whose runtime is not plain
data (aot/cache.py says which), with inputs that share memory, or under ``config.verify`` or
CUDA graphs is not stored, and is compiled as usual next time.

Symbolic sizes: the key holds the inputs' symbolic shapes (their symbols' names, not their
values), so that one entry serves every size. Tracing adds shape guards to Dynamo's ShapeEnv
(a broadcast, a specialization); an entry keeps one variant per set of guards it was compiled
under, a hit needs the current sizes to satisfy them, and re-asserts them in the ShapeEnv, so
that Dynamo's guards for the compiled frame are what they would be after a cold compile. Such
an entry also keeps each graph's ATen code (FX text), which a compiled graph runs for a call
whose sizes are past its kernels' 32-bit indexing.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import types
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import debug
from ..aot import cache as aot_plan
from ..aot.api import bind_parameters, lifted_state
from ..aot.boxing import make_boxed_func
from ..aot.guards import autocast_state
from ..config import config
from .runtime import disk_cache, graph_cache, keys

FORMAT = 2  # 2: variants per set of shape guards
MAX_VARIANTS = graph_cache.MAX_VARIANTS


@dataclasses.dataclass
class Lookup:
    name: str
    key: str
    parts: dict
    inputs: list  # the flat inputs (parameters first): their ShapeEnv holds the guards
    symbols: dict  # size symbol -> (hint, lower, upper) at lookup time


@dataclasses.dataclass
class Hit:
    """What a hit loaded, for ``aotforge.inspect`` (the backends' ``on_hit``): the compiled
    graphs by kind, the code of those that run as FX, and the seconds the load took."""
    training: bool
    parts: dict
    codes: dict
    seconds: float


def lookup(model: Any, example_inputs: Sequence[Any], inner_compile: Callable,
           boxed: Callable) -> tuple[Optional[Lookup], Optional[Callable]]:
    """The compile's key, and its rebuilt callable when the cache holds a usable entry.
    ``boxed``: makes the callable of a loaded compiled graph (the pipeline's). A hit is told
    to ``inner_compile.on_aot_cache_hit(Hit)`` when the caller set one."""
    # verify and CUDA graphs (main's config.cudagraphs) wrap each compiled graph with its FX graph
    if config.verify or getattr(config, "cudagraphs", False) or not getattr(inner_compile, "aot_cacheable", False):
        if config.cache:
            debug.note("cache", f"{_name()}: AOT compile not cached (config.verify or cudagraphs, or a compiler of "
                                "the caller's own)")
        return None, None

    def load_graph(name: str, kind: str, described: Any, symbols: dict) -> Optional[Callable]:
        key, code = (described, None) if isinstance(described, str) else (described["key"], described.get("fx"))
        aten = _unboxed(fx_graph_from_entry(code)) if code is not None else None
        graph = graph_cache.load(kind, key, symbols, aten, f"{name}:{kind}", symbols_superset=True)
        if graph is not None and aten is None and "run_aten_graph(args)" in graph.wrapper_source:
            # (an entry stored without the graph's ATen code: a call past 32-bit indexing needs it)
            return None
        return None if graph is None else boxed(graph)
    return _lookup("kernels", model, example_inputs, load_graph, getattr(inner_compile, "on_aot_cache_hit", None))


def _unboxed(boxed_call: Callable) -> Callable[[list], Any]:
    return lambda args: boxed_call(args)


def _name() -> str:
    return f"{debug.compile_name() or 'graph'}:aot"


def _lookup(path_kind: str, model: Any, example_inputs: Sequence[Any],
            load_graph: Callable[[str, str, Any], Optional[Callable]],
            on_hit: Optional[Callable[[Hit], None]]) -> tuple[Optional[Lookup], Optional[Callable]]:
    """``path_kind``: what the compiled graphs are ("kernels": compiled-graph cache keys;
    "fx": the FX graphs themselves). ``load_graph(name, kind, stored)``: a compiled graph."""
    if not config.cache:
        return None, None
    name = _name()
    started = time.perf_counter()
    found = keys.safe_key(name, "AOT compile", lambda: _key(name, model, example_inputs, path_kind))
    if found is None:
        return None, None
    run = load_entry(found, path_kind, load_graph, on_hit, started)
    if run is None:
        return found, None
    params, _ = lifted_state(model)
    return found, bind_parameters(run, params, model)


def load_entry(found: Lookup, path_kind: str, load_graph: Callable[[str, str, Any, dict], Optional[Callable]],
               on_hit: Optional[Callable[[Hit], None]], started: Optional[float] = None) -> Optional[Callable]:
    """The runtime (``run(flat_args) -> outputs``) rebuilt from the entry under ``found``'s key
    around its compiled graphs, or None (the reason under AOTFORGE_LOG=cache)."""
    name = found.name
    started = time.perf_counter() if started is None else started
    path = keys.entry_path("compile", found.key)
    entry = keys.read_entry(path, found.key, FORMAT)
    if entry is None:
        debug.note("cache", f"{name}: AOT miss ({keys.explain_miss('compile', name, found.parts)})")
        return None
    variants = entry.get("variants")
    if not isinstance(variants, list) or not variants:
        disk_cache.warn_bad_entry(path, "it holds no compiles")
        debug.note("cache", f"{name}: AOT miss (the entry holds no compiles)")
        return None
    failures = [graph_cache.failed_guard(v, found.symbols) for v in variants]
    if None not in failures:
        debug.note("cache", f"{name}: AOT miss (the sizes are outside the entry's guards: {failures[-1]})")
        return None
    entry = variants[len(failures) - 1 - failures[::-1].index(None)]  # the newest that holds
    try:
        compiled = {}
        order = ("forward", "backward", "inference")  # (as a cold compile makes them; the JSON is sorted)
        for kind, stored in sorted(entry["graphs"].items(), key=lambda item: order.index(item[0])
                                   if item[0] in order else len(order)):
            graph = load_graph(name, kind, stored, found.symbols)
            if graph is None:
                debug.note("cache", f"{name}: AOT miss (its {kind} graph is not in the compiled-graph cache)")
                return None
            compiled[kind] = graph
        run = aot_plan.rebuild(entry["plan"], compiled)
        _assert_guards(found.inputs, entry.get("guards", []))
    except Exception as error:  # noqa: BLE001  an entry we cannot rebuild from: compile instead
        disk_cache.warn_bad_entry(path, f"it cannot be loaded: {type(error).__name__}: {error}")
        debug.note("cache", f"{name}: AOT miss (the entry cannot be loaded)")
        return None
    seconds = time.perf_counter() - started
    debug.note("cache", f"{name}: AOT hit ({found.key[:16]}, {seconds:.3f}s)")
    if on_hit is not None:
        codes = {kind: stored["code"] for kind, stored in entry["graphs"].items()} if path_kind == "fx" else {}
        on_hit(Hit(bool(entry["plan"]["training"]), compiled, codes, seconds))
    return run


def store(found: Optional[Lookup], compiled: Callable, graphs: dict, aten: Optional[dict] = None) -> bool:
    """Write the entry for a compile made after a miss (``graphs``: by kind, the
    compiled-graph cache keys of its graphs, or its FX graphs as ``fx_graph_entry`` describes
    them; ``aten``: by kind, the FX graphs handed to the compiler, kept for symbolic sizes).
    True when it was written."""
    if found is None:
        return False
    plan = getattr(compiled, "aot_plan", None)
    if plan is None:
        why = getattr(compiled, "aot_plan_missing", None) or "its runtime is not plain data"
        debug.note("cache", f"{found.name}: AOT compile not stored ({why})")
        return False
    needed = ("forward", "backward") if plan["training"] else ("inference",)
    missing = [kind for kind in needed if graphs.get(kind) is None]
    if missing:
        debug.note("cache", f"{found.name}: AOT compile not stored (its {', '.join(missing)} graph is not in the "
                            "compiled-graph cache)")
        return False
    try:
        symbols, guards = graph_cache.shape_guards(found.inputs)  # with the guards tracing added
    except graph_cache.Uncacheable as reason:
        debug.note("cache", f"{found.name}: AOT compile not stored ({reason})")
        return False
    stored = {kind: graphs[kind] for kind in needed}
    # compiled-graph keys (a key, or {key, kind} for aot_function's graphs), not FX graphs
    by_key = isinstance(stored[needed[0]], str) or "kind" in stored[needed[0]]
    if symbols and by_key:
        if any((aten or {}).get(kind) is None for kind in needed):
            debug.note("cache", f"{found.name}: AOT compile not stored (a graph's ATen code, which runs sizes past "
                                "32-bit indexing, cannot be stored)")
            return False
        stored = {kind: dict(key=described, fx=aten[kind]) if isinstance(described, str) else dict(described, fx=aten[kind])
                  for kind, described in stored.items()}
    variant = dict(plan=plan, graphs=stored, symbols=symbols, guards=guards)
    path = keys.entry_path("compile", found.key)
    # one variant per set of guards, the newest last (as the compiled-graph cache keeps them)
    existing = keys.read_entry(path, found.key, FORMAT) if symbols else None
    variants = [v for v in (existing or {}).get("variants", []) if isinstance(v, dict)
                and (v.get("symbols"), v.get("guards")) != (symbols, guards)]
    keys.write_entry(path, found.key, FORMAT, {"variants": variants[-(MAX_VARIANTS - 1):] + [variant]})
    keys.remember_parts("compile", found.name, found.parts)
    return True


def _assert_guards(inputs: Sequence[Any], guards: list) -> None:
    """Record a hit's shape guards in the inputs' ShapeEnv, as tracing would have: Dynamo
    turns that ShapeEnv's guards into the checks that pick this compiled frame."""
    env = graph_cache.shape_env(inputs)
    if env is None or not guards:
        return
    symbols = {s.name: s for s in graph_cache.backed_hints(env)}
    for text in guards:
        expr = graph_cache.parse_guard(text, symbols)
        env.evaluate_expr(expr)


# --- graphs that run as FX (CPU tensors: no code generation) -------------------------------------------

def compile_fx_graphs(model: Any, example_inputs: Sequence[Any], compile: Callable[[Callable], Callable],
                      on_hit: Optional[Callable[[Hit], None]] = None) -> Callable:
    """An AOT compile whose graphs run as their own FX code, through the AOT cache:
    ``compile(keep)`` runs AOT autograd with each compiler wrapped by ``keep(kind, compiler)``,
    which keeps the graph the compiler is handed (the graph that runs); ``on_hit(Hit)`` is
    told what a hit loaded."""
    found, hit = _lookup("fx", model, example_inputs, lambda name, kind, stored, symbols: fx_graph_from_entry(stored),
                         on_hit)
    if hit is not None:
        return hit
    graphs: dict = {}
    state: dict = {}  # the compiled callable, once AOT returned it; "done" once stored (or refused)

    def store_when_complete() -> None:
        compiled = state.get("compiled")
        if compiled is None or state.get("done") or not graphs_complete(compiled, graphs):
            return
        state["done"] = True
        store(found, compiled, graphs)

    def keep(kind: str, compiler: Callable) -> Callable:
        def keeping(gm: fx.GraphModule, example_inputs: Any) -> Callable:
            compiled = compiler(gm, example_inputs)
            graphs[kind] = _fx_graph_entry_or_none(found, kind, gm)
            store_when_complete()
            return compiled
        return keeping

    state["compiled"] = compile(keep)
    store_when_complete()
    return state["compiled"]


# the names FX's generated code refers to (torch.fx.graph's builtins for ATen graphs)
_FX_GLOBALS = {"torch": torch, "inf": math.inf, "nan": math.nan, "NoneType": type(None), "device": torch.device,
               "fx_pytree": torch.fx._pytree, "pytree": pytree}


def _fx_graph_entry_or_none(found: Optional[Lookup], kind: str, gm: fx.GraphModule) -> Optional[dict]:
    if found is None or not config.cache:
        return None
    try:
        return fx_graph_entry(gm)
    except graph_cache.Uncacheable as reason:
        debug.note("cache", f"{found.name}: the {kind} graph is not stored ({reason})")
        return None


def fx_graph_entry(gm: fx.GraphModule) -> dict:
    """An FX graph as plain data: its generated code, and its constants' bytes."""
    graph_cache.graph_text(gm)  # refuses targets whose meaning is not in the text
    code = gm.graph.python_code(root_module="self")
    for name, value in code.globals.items():
        if _FX_GLOBALS.get(name, object()) is not value:
            raise graph_cache.Uncacheable(f"its code refers to {name}")
    blobs: list = []
    constants = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target)
        if "." in node.target or not isinstance(value, torch.Tensor):
            raise graph_cache.Uncacheable(f"it reads the attribute {node.target}")
        constants[node.target] = graph_cache.describe_object(value, blobs)
    return dict(code=code.src, constants=constants, blobs=blobs)


def graphs_complete(compiled: Any, graphs: dict) -> bool:
    """Whether every graph of an AOT compile has been compiled: a training compile's backward
    graph compiles at its first backward call, after AOT returned."""
    plan = getattr(compiled, "aot_plan", None)
    return plan is None or not plan["training"] or "backward" in graphs


def fx_graph_from_entry(entry: dict) -> Callable:
    """The boxed callable running an FX graph's code (text from our own sealed entry)."""
    namespace = dict(_FX_GLOBALS)
    exec(compile(entry["code"], "<aotforge cached FX graph>", "exec"), namespace)
    owner = types.SimpleNamespace(**{name: graph_cache.rebuild_object(described, entry["blobs"])
                                     for name, described in entry["constants"].items()})
    return make_boxed_func(functools.partial(namespace["forward"], owner))


def _key(name: str, model: Any, example_inputs: Sequence[Any], path_kind: str) -> Lookup:
    if not isinstance(model, fx.GraphModule):
        raise graph_cache.Uncacheable(f"the model is a {type(model).__name__}, not an FX graph")
    params, names = lifted_state(model)
    inputs = [*params, *example_inputs]
    if any(isinstance(x, (torch.SymFloat, torch.SymBool)) for x in inputs):
        raise graph_cache.Uncacheable("it has a symbolic float or bool input")
    _check_no_shared_memory(inputs)
    inputs = _as_traced(inputs)
    symbols, _ = graph_cache.shape_guards(inputs)
    parts = {
        **graph_cache.graph_digests(model, frozenset(names)),
        "inputs": disk_cache.digest(json.dumps([names, [graph_cache.input_description(x) for x in inputs]])),
        "mode": disk_cache.digest(json.dumps(_global_state(), default=str)),
        "config": keys.config_digest(),
        "versions": keys.versions_digest(graph_cache.devices(inputs, model)),
        "path": path_kind,
    }
    return Lookup(name, disk_cache.digest(json.dumps(parts, sort_keys=True)), parts, inputs, symbols)


def _as_traced(inputs: list) -> list:
    """The inputs as AOT tracing sees them. Dynamo hands over real tensors, and AOT traces
    their fakes from Dynamo's fake mode, which gives dynamic dimensions their symbols: the key
    holds those symbols (one entry for every size), not this call's sizes."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    fake_mode = detect_fake_mode(inputs)
    if fake_mode is None or fake_mode.shape_env is None:
        return inputs
    return [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
            for x in inputs]


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


def keep_aten_code(found: Optional[Lookup], aten: dict) -> Callable[[str, Callable], Callable]:
    """``keep(kind, compiler)``: ``compiler``, which also puts the FX code of the graph it is
    handed into ``aten[kind]`` when the compile has symbolic sizes (its AOT entry keeps it)."""
    def keep(kind: str, compiler: Callable) -> Callable:
        if found is None or not found.symbols:
            return compiler

        def keeping(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable:
            # before the compile: its passes may change the graph in place
            aten[kind] = _fx_graph_entry_or_none(found, kind, gm)
            return compiler(gm, example_inputs, **kwargs)
        return keeping
    return keep
