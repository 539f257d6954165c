"""The AOT cache behind ``aot_function`` / ``aot_module`` with aotforge's compilers
(``compile_fx_inner``): a new process that compiles a function it compiled before skips AOT
tracing, partitioning and the compiler, and rebuilds the runtime around compiled graphs from
the compiled-graph cache, as under torch.compile (compiler/aot_cache.py).

There is no Dynamo graph to key on, so the key is a cheap trace of its own: the function traced
once above autograd (``make_fx(pre_dispatch=True)``, fake inputs, no functionalization, no
joint graph), whose ATen code records what it computes, its grad-mode regions, its random ops,
its in-place updates and the tensors it reads from outside (as constants, by their bytes). With
the inputs' metadata (symbolic sizes under ``dynamic=True``), the AOT options, the global state
tracing reads, aotforge's config and the versions, that is the key. Code whose meaning for
autograd is not in that trace is not cached: custom ``autograd.Function``s (their backward is
Python code), hooks, ``retain_grad``, ``requires_grad_`` and calls of ``torch.autograd``. So
are compiles with decompositions or a partitioner of the caller's own, with compilers that are
not aotforge's, and with inputs that share memory.

On a miss the compile traces the same fake inputs the key was made from (one ShapeEnv: the
entry's shape guards are the compile's, in the key's symbols); on a hit those guards are
re-asserted in that ShapeEnv, so the caller's own guard (aot_function's, for a later call's
sizes) is what it would be after a cold compile.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from .. import debug
from ..config import config
from ..aot import cache as aot_plan
from . import aot_cache
from .pipeline import _boxed
from .runtime import disk_cache, graph_cache, keys

# torch-level calls whose effect on autograd a pre-dispatch trace does not record
_AUTOGRAD_CALLS = {
    torch.Tensor.register_hook: "a tensor hook (register_hook)",
    torch.Tensor.register_post_accumulate_grad_hook: "a tensor hook (register_post_accumulate_grad_hook)",
    torch.Tensor.retain_grad: "retain_grad()",
    torch.Tensor.requires_grad_: "requires_grad_()",
    torch.Tensor.backward: "Tensor.backward()",
    torch.autograd.grad: "torch.autograd.grad",
    torch.autograd.backward: "torch.autograd.backward",
}


class _RefuseAutogradCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.refused: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _AUTOGRAD_CALLS.get(func)
        if what is None and getattr(func, "__name__", None) == "__set__" and "requires_grad" in repr(func):
            what = "setting requires_grad"
        if what is not None:
            self.refused.append(what)
        return func(*args, **(kwargs or {}))


def compile_function(flat_fn: Callable, flat_args: Sequence, aot_config: Any, is_training: bool,
                     compile: Callable) -> tuple:
    """``compile(flat_fn, args, aot_config, is_training=...)`` (aot/compile.py's
    ``_compile_flat``: ``(run, meta, fake_args)``) through the AOT cache. A hit returns
    ``(run, None, fake_args)``."""

    if not config.cache or not _cacheable_config(aot_config):
        return compile(flat_fn, flat_args, aot_config, is_training=is_training)
    name = aot_cache._name()
    at_sizes = None
    if aot_config.dynamic:  # first at these sizes: no symbolic shapes to set up (seconds of sympy)
        at_sizes = keys.safe_key(name, "AOT compile", lambda: _key(name, flat_fn, flat_args, aot_config, is_training,
                                                                   static=True))
        hit = _load_at_sizes(at_sizes) if at_sizes is not None else None
        if hit is not None:
            return hit, None, at_sizes.fakes
    found = keys.safe_key(name, "AOT compile", lambda: _key(name, flat_fn, flat_args, aot_config, is_training))
    if found is None:
        return compile(flat_fn, flat_args, aot_config, is_training=is_training)
    lookup = found.lookup
    run = aot_cache.load_entry(lookup, "function", _load_graph, None)
    if run is not None:
        _store_at_sizes(at_sizes, lookup)
        return run, None, found.fakes
    graphs: dict = {}
    aten: dict = {}
    state: dict = {}

    def store_when_complete() -> None:
        compiled = state.get("compiled")
        if compiled is None or state.get("done") or not aot_cache.graphs_complete(compiled, graphs):
            return
        state["done"] = True
        if aot_cache.store(lookup, compiled, graphs, aten):
            _store_at_sizes(at_sizes, lookup)

    def keeping(kind: str, compiler: Callable) -> Callable:
        def compile_graph(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable:
            if lookup.symbols:  # before the compile: its passes may change the graph in place
                aten[kind] = aot_cache._fx_graph_entry_or_none(lookup, kind, gm)
            with graph_cache.capture() as captured:
                compiled = compiler(gm, example_inputs, **kwargs)
            # the graph's own kind names its compiled-graph entry (compile_fx_inner called
            # without is_backward stores a backward graph as "forward")
            graphs[kind] = dict(key=captured[next(iter(captured))], kind=next(iter(captured))) \
                if len(captured) == 1 else None
            store_when_complete()
            return compiled
        for attribute in ("aot_cacheable", "__name__", "__qualname__", "__module__"):
            if hasattr(compiler, attribute):
                setattr(compile_graph, attribute, getattr(compiler, attribute))
        return compile_graph

    kept = dataclasses.replace(aot_config, fw_compiler=keeping("forward", aot_config.fw_compiler),
                               bw_compiler=keeping("backward", aot_config.bw_compiler),
                               inference_compiler=keeping("inference", aot_config.inference_compiler))
    for field, value in vars(aot_config).items():  # attributes set after construction (compile_backward_now)
        if not hasattr(kept, field):
            setattr(kept, field, value)
    run, meta, fake_args = compile(flat_fn, found.fakes, kept, is_training=is_training)
    state["compiled"] = run
    store_when_complete()
    return run, meta, fake_args


def _load_graph(name: str, kind: str, described: Any, symbols: dict) -> Optional[Callable]:

    if not isinstance(described, dict) or not isinstance(described.get("key"), str):
        raise ValueError(f"its {kind} graph is described as {type(described).__name__}")
    code = described.get("fx")
    aten = aot_cache._unboxed(aot_cache.fx_graph_from_entry(code)) if code is not None else None
    graph = graph_cache.load(str(described.get("kind", kind)), described["key"], symbols, aten, f"{name}:{kind}",
                             symbols_superset=True)
    if graph is not None and aten is None and "run_aten_graph(args)" in graph.wrapper_source:
        return None  # (stored without the graph's ATen code: a call past 32-bit indexing needs it)
    return None if graph is None else _boxed(graph)


def _cacheable_config(aot_config: Any) -> bool:
    from ..partition import default_partition, min_cut_rematerialization_partition

    name = f"{debug.compile_name() or getattr(aot_config, 'name', 'function')}:aot"
    compilers = (aot_config.fw_compiler, aot_config.bw_compiler, aot_config.inference_compiler)
    why = None
    if config.verify or getattr(config, "cudagraphs", False):
        why = "config.verify or cudagraphs"
    elif not all(getattr(_unwrapped(c), "aot_cacheable", False) for c in compilers):
        why = "a compiler of the caller's own"
    elif aot_config.decompositions:
        why = "decompositions of the caller's own"
    elif _unwrapped(aot_config.partition_fn, (default_partition, min_cut_rematerialization_partition)) \
            not in (default_partition, min_cut_rematerialization_partition):
        why = "a partitioner of the caller's own"
    if why is not None:
        debug.note("cache", f"{name}: AOT compile not cached ({why})")
    return why is None


def _unwrapped(compiler: Callable, known: tuple = ()) -> Callable:
    """The compiler (or partitioner) under wrappers that only watch it (aotforge.inspect's,
    which name it ``__wrapped__``)."""
    for _ in range(8):
        if getattr(compiler, "aot_cacheable", False) or compiler in known or not hasattr(compiler, "__wrapped__"):
            break
        compiler = compiler.__wrapped__
    return compiler


@dataclasses.dataclass
class _Found:
    lookup: Any  # aot_cache.Lookup
    fakes: list  # the inputs the compile traces (their ShapeEnv holds the entry's guards)


def _key(name: str, flat_fn: Callable, flat_args: Sequence, aot_config: Any, is_training: bool,
         static: bool = False) -> _Found:
    """The key of the compile; ``static``: of a dynamic compile at these sizes only (its entry
    names the symbolic compile's entry, see ``_load_at_sizes``)."""
    from ..aot.compile import fake_inputs

    if any(isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) for x in flat_args):
        raise graph_cache.Uncacheable("it has a symbolic input")
    if any(isinstance(x, torch.Tensor) and (x.is_nested or x.layout != torch.strided) for x in flat_args):
        raise graph_cache.Uncacheable("it has a nested or non-strided tensor input")
    aot_cache._check_no_shared_memory(flat_args)
    fake_mode, fakes = _static_fakes(flat_args) if static else fake_inputs(flat_args, aot_config.dynamic)
    gm = _pre_trace(flat_fn, fakes, fake_mode)
    symbols, _ = graph_cache.shape_guards(fakes)
    compilers = [f"{getattr(c, '__module__', '?')}.{getattr(c, '__qualname__', '?')}" for c in
                 map(_unwrapped, (aot_config.fw_compiler, aot_config.bw_compiler, aot_config.inference_compiler))]
    options = dict(training=bool(is_training), dynamic=bool(aot_config.dynamic),
                   keep_inference_input_mutations=bool(aot_config.keep_inference_input_mutations),
                   disable_functionalization=bool(getattr(aot_config, "disable_functionalization", False)),
                   static_inputs=list(aot_config.static_input_indices),
                   num_params_buffers=int(aot_config.num_params_buffers),
                   partition=getattr(_unwrapped(aot_config.partition_fn), "__qualname__", "?"), compilers=compilers)
    parts = {
        **graph_cache.graph_digests(gm),
        "inputs": disk_cache.digest(json.dumps([graph_cache.input_description(x) for x in fakes])),
        "options": disk_cache.digest(json.dumps(options, sort_keys=True)),
        "mode": disk_cache.digest(json.dumps(aot_cache._global_state(), default=str)),
        "config": keys.config_digest(),
        "versions": keys.versions_digest(graph_cache.devices(fakes, gm)),
        "path": "function at these sizes" if static else "function",
    }
    key = disk_cache.digest(json.dumps(parts, sort_keys=True))
    return _Found(aot_cache.Lookup(name, key, parts, fakes, symbols), fakes)


def _pre_trace(flat_fn: Callable, fakes: list, fake_mode: Any) -> fx.GraphModule:
    """The function's graph above autograd, traced on copies of the fake inputs (an in-place
    update in the function must not reach the fakes the compile traces)."""
    import torch.autograd.function as autograd_function
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode:
        copies = [_fresh_copy(x) if isinstance(x, torch.Tensor) else x for x in fakes]
    custom: list = []
    is_setup_context_defined = autograd_function._is_setup_context_defined

    def spy(fn: Any) -> Any:  # Function.apply calls it first: a custom autograd.Function ran
        custom.append(fn)
        return is_setup_context_defined(fn)

    refuse = _RefuseAutogradCalls()
    autograd_function._is_setup_context_defined = spy
    try:
        with fake_mode, refuse:
            gm = make_fx(flat_fn, pre_dispatch=True)(*copies)
    finally:
        autograd_function._is_setup_context_defined = is_setup_context_defined
    if custom:
        raise graph_cache.Uncacheable("it calls a custom autograd.Function (its backward is code outside the graph)")
    if refuse.refused:
        raise graph_cache.Uncacheable(f"it calls {refuse.refused[0]}, which its graph does not record")
    return gm


def _fresh_copy(fake: torch.Tensor) -> torch.Tensor:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass, transform_subclass

    if type(fake) is not torch.Tensor and not graph_cache._is_fake(fake) and is_traceable_wrapper_subclass(fake):
        copy = transform_subclass(fake, lambda name, inner: _fresh_copy(inner).detach())
        return copy.requires_grad_(fake.requires_grad) if fake.requires_grad else copy
    copy = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device)
    if fake.storage_offset() != 0:
        base = torch.empty_strided((graph_cache._span(fake) + fake.storage_offset(),), (1,), dtype=fake.dtype,
                                   device=fake.device)
        copy = base.as_strided(fake.shape, fake.stride(), fake.storage_offset())
    return copy.requires_grad_(fake.requires_grad) if fake.requires_grad and copy.is_floating_point() or \
        fake.requires_grad and copy.is_complex() else copy


# --- a dynamic compile, first at the sizes it was called with -------------------------------------
# Setting up symbolic sizes costs seconds in a new process (sympy's first use, torch's frame
# filters), most of a warm start. So a dynamic compile's entry is also named by a key made at
# the call's sizes without symbols: the static trace of the function at those sizes. Under it,
# the sizes entry holds the symbolic entry's key and the symbols' values at those sizes; a hit
# through it serves only those sizes (the fakes handed back make the caller's guard check them
# exactly), and another size goes through the symbolic key as before.

SIZES_FORMAT = 1


def _static_fakes(flat_args: Sequence) -> tuple:
    """Fakes with static sizes in a fake mode with a ShapeEnv: the guard the caller makes from
    them (aot_function's ``_shape_guard``) holds for exactly these sizes."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ..torch_versions import new_fake_mode

    fake_mode = new_fake_mode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    return fake_mode, [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                       for x in flat_args]


def _load_at_sizes(at_sizes: _Found) -> Optional[Callable]:

    lookup = at_sizes.lookup
    path = keys.entry_path("sizes", lookup.key)
    if disk_cache.read_bytes(path) is None:
        return None
    entry = keys.read_entry(path, lookup.key, SIZES_FORMAT)
    target, symbols = (entry or {}).get("target"), (entry or {}).get("symbols")
    if not isinstance(target, str) or not isinstance(symbols, dict):
        return None
    symbols = {name: tuple(value) for name, value in symbols.items() if isinstance(value, list)}
    return aot_cache.load_entry(aot_cache.Lookup(lookup.name, target, lookup.parts, at_sizes.fakes, symbols),
                                "function", _load_graph, None)


def _store_at_sizes(at_sizes: Optional[_Found], lookup: Any) -> None:
    if at_sizes is None or not lookup.symbols:
        return
    keys.write_entry(keys.entry_path("sizes", at_sizes.lookup.key), at_sizes.lookup.key, SIZES_FORMAT,
                     dict(target=lookup.key, symbols={name: list(value) for name, value in lookup.symbols.items()}))


# aot_function's compiles go through this cache: aot/compile.py calls it when aotforge's compiler
# (which imports this module) is loaded
aot_plan.function_cache = compile_function
