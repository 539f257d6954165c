"""The public entry points, compatible with ``functorch.compile``'s signatures.

``aot_function`` flattens pytree arguments, specializes on non-tensor arguments, caches one
compiled callable per input signature, and dispatches each call to the right one.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..config import config as global_config
from ..partition import default_partition
from .compile import CompileConfig, compile_flat, is_training_call
from .guards import (
    autocast_state, check_no_fake_constants, closure_state_fn, constant_key, module_state, only_tensors_changed,
)
from .schemas import AOTConfig
from .source_lines import interpreted_node_by_node
from .subclasses import dispatches_itself, subclass_signature
from .trace import TRACE_LOCK


def _make_config(
    fw_compiler, bw_compiler, partition_fn, decompositions, num_params_buffers,
    keep_inference_input_mutations, inference_compiler, dynamic, name,
    disable_functionalization: bool = False,
) -> AOTConfig:
    """Validate the caller's choices now, so that a mistake is reported where it was made
    (not as "'int' object is not callable" when the backward first runs)."""
    for what, value in (
        ("fw_compiler", fw_compiler), ("bw_compiler", bw_compiler),
        ("inference_compiler", inference_compiler), ("partition_fn", partition_fn),
    ):
        if not callable(value) and (value is not None or what == "fw_compiler"):
            raise TypeError(f"aotforge: {what} must be callable, got {value!r}")
    decompositions = _check_decompositions(decompositions)
    if not isinstance(num_params_buffers, int) or isinstance(num_params_buffers, bool) or num_params_buffers < 0:
        raise TypeError(f"aotforge: num_params_buffers must be a non-negative int, got {num_params_buffers!r}")
    return CompileConfig(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler if bw_compiler is not None else fw_compiler,
        inference_compiler=inference_compiler if inference_compiler is not None else fw_compiler,
        partition_fn=partition_fn if partition_fn is not None else default_partition,
        decompositions=decompositions,
        num_params_buffers=num_params_buffers,
        keep_inference_input_mutations=bool(keep_inference_input_mutations),
        dynamic=bool(dynamic),
        static_input_indices=tuple(range(num_params_buffers)),
        name=name,
        disable_functionalization=bool(disable_functionalization),
    )


_CONFIG_DEFAULTS = dict(
    bw_compiler=None, partition_fn=default_partition, decompositions=None, num_params_buffers=0,
    keep_inference_input_mutations=False, inference_compiler=None,
)


def _check_decompositions(decompositions) -> dict:
    if decompositions is None:
        return {}
    if not hasattr(decompositions, "items"):
        raise TypeError(
            "aotforge: decompositions must be a dict from ATen ops to functions (as made by "
            f"torch._decomp.get_decompositions), got {type(decompositions).__name__}"
        )
    for op, implementation in decompositions.items():
        # Higher-order ops (torch.ops.higher_order.*, as in inductor's table) are kept:
        # make_fx uses their entry if the op runs, as it does for PyTorch's AOTAutograd.
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
            raise TypeError(
                f"aotforge: decompositions has the key {op!r}, which is not an ATen op "
                "(torch.ops.aten.*) or a higher-order op (torch.ops.higher_order.*)"
            )
        if not callable(implementation):
            raise TypeError(f"aotforge: the decomposition of {op} must be callable, got {implementation!r}")
    return dict(decompositions)


def _is_traced(value) -> bool:
    """Tensors (and SymInts, under Dynamo) become graph inputs; other values are constants."""
    return isinstance(value, (torch.Tensor, torch.SymInt))


class _CacheEntry:
    def __init__(self, key, run, guard: Optional[Callable], out_spec_cell):
        self.key = key
        self.run = run
        self.guard = guard
        self.out_spec_cell = out_spec_cell
        self._unflatten: Optional[Callable] = None

    def unflatten(self, flat_outputs: list):
        if self._unflatten is None:
            self._unflatten = _fast_unflatten(self.out_spec_cell[0])
        return self._unflatten(flat_outputs)


def _fast_unflatten(spec) -> Callable:
    """tree_unflatten for ``spec``, skipping pytree machinery for the common shapes
    (a single tensor, a flat tuple or list), which matters for per-call overhead."""
    if spec.is_leaf():
        return lambda flat: flat[0]
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    if spec.type in (tuple, list) and all(child.is_leaf() for child in children):
        return tuple if spec.type is tuple else list
    return lambda flat: pytree.tree_unflatten(flat, spec)


def _signature(flat_args: Sequence, spec_key, dynamic: bool) -> tuple:
    """Everything a compiled graph specialized on: shapes and strides (only the rank if
    dynamic), dtypes, devices, requires_grad, non-tensor values, the pytree structure, grad
    mode, autocast, and which inputs are the same tensor or share storage.

    Runs on every call, so it is one flat tuple built in one pass.
    """
    parts: list[Any] = [spec_key, autocast_state()]
    any_requires_grad = False
    storages: dict[int, int] = {}
    objects: dict[int, int] = {}
    for arg in flat_args:
        if isinstance(arg, torch.Tensor):
            requires_grad = arg.requires_grad
            any_requires_grad = any_requires_grad or requires_grad
            if arg.layout is not torch.strided or arg.is_nested or (
                type(arg) is not torch.Tensor and (hasattr(arg, "__tensor_flatten__") or dispatches_itself(type(arg)))
            ):
                # Subclasses, sparse and nested tensors have no data pointer; unsupported
                # ones are rejected here with a clear error.
                parts += (subclass_signature(arg, dynamic), objects.setdefault(id(arg), len(objects)))
                continue
            ptr = arg.untyped_storage().data_ptr()
            parts += (
                type(arg), arg.dtype, arg.device, arg.layout, requires_grad,
                arg.dim() if dynamic else arg.shape,
                None if dynamic else arg.stride(),
                None if dynamic else arg.storage_offset(),
                # aliasing changes the trace: the same object (dedupe), or the same storage
                objects.setdefault(id(arg), len(objects)),
                storages.setdefault(ptr, len(storages)) if ptr else -1,
            )
        else:
            parts += (type(arg), constant_key(arg))
    parts.append(any_requires_grad and torch.is_grad_enabled())
    return tuple(parts)


def aot_function(
    fn: Callable,
    fw_compiler: Callable,
    bw_compiler: Optional[Callable] = None,
    partition_fn: Callable = default_partition,
    decompositions: Optional[dict] = None,
    num_params_buffers: int = 0,
    keep_inference_input_mutations: bool = False,
    inference_compiler: Optional[Callable] = None,
    *,
    dynamic: bool = False,
    enable_log: bool = True,
    disable_functionalization: bool = False,
) -> Callable:
    """Trace ``fn``'s forward and backward ahead of time and compile them.

    Compilation happens on the first call with a new input signature (shapes, dtypes,
    devices, requires_grad, non-tensor values, grad mode, autocast) or a change in the state
    the function itself reads: the globals its code names (and the code of same-module helper
    functions it calls), its closure values (lists, dicts and config objects by their
    contents), and the modes and attributes of modules among them. Later calls with the same
    signature and state reuse the compiled graphs.

    State read elsewhere is frozen at trace time (functorch's contract): globals read by
    functions of other modules, attributes reached through an argument, values read through
    ``getattr`` with a computed name. Use ``torch.compile(fn, backend="aotforge")`` for full
    guards on everything the function reads (Dynamo's), or ``aot_module`` for a module.

    The keywords are functorch.compile's: ``enable_log`` is accepted for compatibility
    (aotforge logs through AOTFORGE_LOG); ``disable_functionalization=True`` traces the graphs
    without functionalization, so in-place ops stay in them.
    """
    if isinstance(fn, nn.Module):
        raise TypeError(
            f"aotforge: aot_function got the module {type(fn).__name__}; its parameters would "
            "be baked into the graph as constants and get no gradients. Use "
            "aotforge.aot_module(module, ...) instead."
        )
    if not callable(fn):
        raise TypeError(
            f"aotforge: aot_function needs a callable to compile, got {type(fn).__name__} "
            f"({fn!r:.80}); pass the function itself (aot_function(f, ...), not aot_function(f(x), ...))."
        )
    config = _make_config(
        fw_compiler, bw_compiler, partition_fn, decompositions, num_params_buffers,
        keep_inference_input_mutations, inference_compiler, dynamic,
        getattr(fn, "__name__", "function"), disable_functionalization,
    )
    # Globals, closure values and module state the trace may have read: part of every key.
    return _compiled_function(fn, config, closure_state_fn(fn))


def _compiled_function(fn: Callable, config: CompileConfig, outside_state: Callable[[], tuple]) -> Callable:
    """``fn`` compiled once per input signature and ``outside_state()`` (what it read
    besides its arguments)."""
    cache: list[_CacheEntry] = []

    def compile_for(flat_args: list, in_spec, key) -> _CacheEntry:
        if len(cache) >= global_config.cache_size_limit:
            raise RuntimeError(
                f"aotforge: {config.name} was compiled {len(cache)} times (cache_size_limit). "
                "Its inputs keep changing shape, dtype, device or requires_grad; pass "
                "dynamic=True for changing shapes, or raise aotforge.config.cache_size_limit. "
                "AOTFORGE_LOG=recompiles prints what changed at each compile; "
                "aotforge.inspect(compiled) lists them."
            )
        traced_positions = [i for i, a in enumerate(flat_args) if _is_traced(a)]
        constants = list(flat_args)
        out_spec_cell: list = [None]

        def flat_fn(*traced):
            full = list(constants)
            for position, value in zip(traced_positions, traced):
                full[position] = value
            args, kwargs = pytree.tree_unflatten(full, in_spec)
            outputs = fn(*args, **kwargs)
            flat_outputs, out_spec_cell[0] = pytree.tree_flatten(outputs)
            return flat_outputs

        traced_args = [flat_args[i] for i in traced_positions]
        run, _, fake_args = compile_flat(
            flat_fn, traced_args, config, is_training=is_training_call(flat_args)
        )
        state_after = outside_state()
        if state_after != key[1] and only_tensors_changed(key[1], state_after):
            # It assigned tensors it computed (a hook setting a weight): the graph computes
            # them, and later calls find the state the trace left.
            key = (key[0], state_after)
        elif state_after != key[1]:
            raise RuntimeError(
                f"aotforge: {config.name} changed Python state that it reads (a module attribute, "
                "a list, dict or object it reads, or a global) while it was traced. A compiled call "
                "runs the graph only, never the Python code again, so that change would not repeat "
                "and later calls would disagree with eager. Keep such state in tensors (module "
                "buffers) or outside the compiled function, or compile with torch.compile(..., "
                "backend=\"aotforge\"), whose Dynamo frontend replays Python side effects."
            )
        guard = _shape_guard(fake_args) if config.dynamic else None

        def run_flat(all_args: list) -> list:
            return run([all_args[i] for i in traced_positions])

        if len(traced_positions) == len(flat_args):
            run_flat = run  # every argument is a graph input: nothing to drop per call

        entry = _CacheEntry(key, run_flat, guard, out_spec_cell)
        cache.append(entry)
        return entry

    @functools.wraps(fn)
    def compiled(*args, **kwargs):
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            # Fast path: positional tensors need no pytree flattening; the arity is the spec.
            flat_args, spec_key = args, len(args)
        else:
            flat_args, spec_key = pytree.tree_flatten((args, kwargs))
        key = (_signature(flat_args, spec_key, config.dynamic), outside_state())
        entry = _lookup(cache, key, flat_args)
        if entry is None:
            # One thread compiles; another that missed at the same time finds its entry.
            with TRACE_LOCK:
                entry = _lookup(cache, key, flat_args)
                if entry is None:
                    entry = compile_for(list(flat_args), pytree.tree_flatten((args, kwargs))[1], key)
        return entry.unflatten(entry.run(flat_args))

    compiled._aotforge_cache = cache  # type: ignore[attr-defined]
    return compiled


def _lookup(cache: list, key, flat_args) -> Optional[_CacheEntry]:
    for entry in cache:
        if entry.key == key and (entry.guard is None or entry.guard(flat_args)):
            return entry
    return None


def _shape_guard(fake_args: Sequence) -> Optional[Callable]:
    """A check that a call's shapes satisfy the guards recorded while tracing."""
    fakes = [a for a in fake_args if isinstance(a, torch.Tensor)]
    shape_env = next((a.fake_mode.shape_env for a in fakes if a.fake_mode.shape_env), None)
    if shape_env is None:
        return None
    code = shape_env.produce_guards_expression(fakes, ignore_static=False)
    if code is None:
        return None

    def guard(flat_args: Sequence) -> bool:
        tensors = [a for a in flat_args if isinstance(a, torch.Tensor)]
        return shape_env.evaluate_guards_expression(code, tensors)

    return guard


def aot_module(mod: nn.Module, *args, **kwargs) -> nn.Module:
    """``aot_function`` for an nn.Module: parameters and buffers are lifted as the first flat
    inputs, so the compiled graphs are functions of them and gradients reach them.

    A graph is reused only while what its trace read is unchanged: each submodule's class,
    forward (also one assigned on the instance), mode and hooks, the instance and class
    attributes its forward and the methods it calls name (lists, dicts and config objects by
    their contents, tensors by identity and version), and the globals they read. A change
    compiles a new graph."""
    if not isinstance(mod, nn.Module):
        raise TypeError(f"aotforge: aot_module expects an nn.Module, got {type(mod).__name__}; use aot_function")
    check_no_fake_constants(mod)
    # Validate the compile arguments now; the functions are made on the first call.
    bound = inspect.signature(aot_function).bind(mod, *args, **kwargs).arguments
    bound.pop("fn")
    bound.pop("enable_log", None)
    dynamic = bound.pop("dynamic", False)
    config = _make_config(**{**_CONFIG_DEFAULTS, **bound}, dynamic=dynamic, name=type(mod).__name__)
    # One compiled function per set of parameter and buffer names: adding or removing one
    # changes the graph's inputs, so it must never reuse a graph traced without it.
    compiled_calls: dict[tuple, Callable] = {}

    def compiled_call_for(names: tuple) -> Callable:
        num_params_buffers = len(names)

        def functional_call(*flat_params_and_args, **call_kwargs):
            state = dict(zip(names, flat_params_and_args[:num_params_buffers]))
            user_args = flat_params_and_args[num_params_buffers:]
            return torch.func.functional_call(mod, state, user_args, call_kwargs, tie_weights=False)

        functional_call.__name__ = type(mod).__name__
        call_config = dataclasses.replace(
            config, num_params_buffers=num_params_buffers, static_input_indices=tuple(range(num_params_buffers)))
        # The module's state (every submodule's modes, hooks, attributes, class attributes,
        # forward and the globals it reads) keys the cache.
        return _compiled_function(functional_call, call_config, lambda: module_state(mod))

    class AOTModule(nn.Module):
        """The original module, run through aotforge."""

        def __init__(self):
            super().__init__()
            self.orig_module = mod
            self._aotforge_calls = compiled_calls  # the compiled functions, per parameter names

        def forward(self, *call_args, **call_kwargs):
            named = [
                *mod.named_parameters(remove_duplicate=False),
                *mod.named_buffers(remove_duplicate=False),
            ]
            names = tuple(name for name, _ in named)
            compiled_call = compiled_calls.get(names)
            if compiled_call is None:
                compiled_call = compiled_calls[names] = compiled_call_for(names)
            return compiled_call(*(value for _, value in named), *call_args, **call_kwargs)

    return AOTModule()


def aot_module_simplified(
    mod: nn.Module,
    args: Sequence,
    fw_compiler: Callable,
    bw_compiler: Optional[Callable] = None,
    partition_fn: Callable = default_partition,
    decompositions: Optional[dict] = None,
    keep_inference_input_mutations: bool = False,
    inference_compiler: Optional[Callable] = None,
    compile_backward_now: bool = False,
    **unused,
) -> Callable:
    """The low-overhead entry used under Dynamo: ``mod`` is called with flat ``args`` (fake
    tensors and SymInts), compiled now, and the returned callable takes the real flat
    arguments. Dynamo's guards decide when to recompile, so there is no cache here.
    ``compile_backward_now``: compile the backward graph with the forward, not lazily."""
    check_no_fake_constants(mod)
    params, names = lifted_state(mod)
    num_params = len(params)

    def flat_fn(*flat):
        state = dict(zip(names, flat[:num_params]))
        outputs = torch.func.functional_call(mod, state, tuple(flat[num_params:]), tie_weights=False)
        if isinstance(outputs, (list, tuple)):
            return list(outputs)
        return [outputs]

    config = _make_config(
        fw_compiler, bw_compiler, partition_fn, decompositions, num_params,
        keep_inference_input_mutations, inference_compiler, False, "dynamo_graph",
    )
    config.compile_backward_now = compile_backward_now
    # Dynamo lifts parameters and buffers as graph inputs and marks them: they live as long
    # as the module (the partitioner saves them for free).
    config.static_input_indices = (
        *range(num_params),
        *(num_params + i for i in _dynamo_static_inputs(mod)),
    )
    flat_args = [*params, *args]
    with interpreted_node_by_node(mod):  # Dynamo's graph: its nodes' source lines carry over
        run, _, _ = compile_flat(flat_fn, flat_args, config, is_training=is_training_call(flat_args))
    return bind_parameters(run, params, mod)


def lifted_state(mod: nn.Module) -> tuple[list, list[str]]:
    """The parameters and buffers that become the first graph inputs, and their names."""
    named = [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]
    return [value for _, value in named], [name for name, _ in named]


def bind_parameters(run: Callable, params: list, mod: nn.Module) -> Callable:
    """``forward(*args)``: ``run`` called with the module's parameters and buffers before the
    arguments; with the module's methods Dynamo calls on it, and the AOT plan of ``run``
    (aot/cache.py)."""
    def forward(*runtime_args):
        return run([*params, *runtime_args])

    forward.zero_grad = mod.zero_grad  # type: ignore[attr-defined]
    forward.named_parameters = mod.named_parameters  # type: ignore[attr-defined]
    forward.named_buffers = mod.named_buffers  # type: ignore[attr-defined]
    forward.aot_plan = getattr(run, "aot_plan", None)  # type: ignore[attr-defined]
    forward.aot_plan_missing = getattr(run, "aot_plan_missing", None)  # type: ignore[attr-defined]
    return forward


def _dynamo_static_inputs(mod: nn.Module) -> list[int]:
    graph = getattr(mod, "graph", None)
    if graph is None:
        return []
    placeholders = graph.find_nodes(op="placeholder")
    return [
        i
        for i, node in enumerate(placeholders)
        if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
    ]


compiled_function = aot_function
compiled_module = aot_module
