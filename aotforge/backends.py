"""torch.compile backends: ``aotforge_eager`` (AOT autograd, graphs run as FX) and
``aotforge`` (AOT autograd + our compiler).

``torch.compile(model, backend="aotforge", mode=..., options={...})``:

- ``mode`` maps to config settings (``MODES``); ``"reduce-overhead"`` turns on CUDA graphs
  (``config.cudagraphs``; graphs on the CPU have nothing to replay and say so once).
- ``options`` patches ``aotforge.config`` for this compile only, including the backward that
  compiles later and the compiled graphs' runs. Unknown modes and options, and values of the
  wrong type or range, are rejected inside ``torch.compile()`` itself
  (``install_compile_time_validation``), with a "did you mean" for near misses.
- Graphs whose inputs all live on the CPU (without ``config.triton_on_cpu``) run un-decomposed
  as FX graphs through the AOT layer, as eager's kernels are faster than op-by-op decomposed
  ATen until the CPU code generator exists: a log line says so once per process, and options
  and log topics that do nothing there say so once each. Warnings name the user's line.
- With ``config.verify`` (``AOTFORGE_VERIFY=1``) every compiled graph is checked against plain
  ATen on its real inputs (``aotforge/verify.py``).
"""
from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx

from . import debug
from .aot import aot_module_simplified, boxing
from .config import config, config_default, did_you_mean
from .inspection import dynamo_recorder

# torch.compile's modes -> aotforge.config settings.
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {"cudagraphs": True},
    "max-autotune": {"autotune": True},
    "max-autotune-no-cudagraphs": {"autotune": True},
}

# Options that change only the generated code, with what they ask for: graphs on CPU tensors
# run as eager's ATen calls, where they do nothing (said once per option and process).
COMPILER_ONLY_OPTIONS: dict[str, str] = {
    "autotune": "no generated reductions to autotune",
    "activation_memory_budget": "no min-cut partition to budget: they save what eager saves",
    "verify": "no generated code to check against ATen",
    "persistent_reduction_limit": "no generated reductions",
    "split_reduction_threshold": "no generated reductions",
}

CPU_NOTICE = ("aotforge: graphs on CPU tensors run as plain ATen calls (eager's own kernels, "
              "about eager's speed), without aotforge's C++ kernels: {why}. "
              "Said once per process; AOTFORGE_LOG=compile says it per graph.")


def config_patches(mode: Optional[str], options: Optional[dict]) -> dict[str, Any]:
    """The config changes that torch.compile's ``mode`` and ``options`` ask for; an unknown
    mode or option, or a value of the wrong type or range, raises here."""
    if mode is not None and mode not in MODES:
        raise ValueError(
            f"aotforge: unknown torch.compile mode {mode!r}{did_you_mean([mode], MODES)}; "
            f"aotforge supports {sorted(MODES)}"
        )
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"aotforge: torch.compile options must be a dict, got {type(options).__name__}")
    patches = {**MODES.get(mode or "default", {}), **(options or {})}
    with config.patch(**patches):  # unknown names and unusable values fail here, at once
        pass
    return patches


def validate_compile_args(backend: Any) -> None:
    """Inside ``torch.compile()``: check the ``mode=``/``options=`` it will hand to an aotforge
    backend at the first call (where an error would come wrapped in Dynamo's "please report"
    footer). ``backend`` is torch.compile's wrapper of the backend with those arguments."""
    if not getattr(getattr(backend, "compiler_fn", None), "_aotforge_backend", False):
        return
    kwargs = getattr(backend, "kwargs", None) or {}
    try:
        config_patches(kwargs.get("mode"), kwargs.get("options"))
    except (AttributeError, TypeError, ValueError) as error:
        message = str(error).removeprefix("aotforge: ")
        raise type(error)(f"torch.compile(backend={backend.compiler_name!r}): {message}") from None


def install_compile_time_validation() -> None:
    """torch.compile builds a wrapper holding the backend and its ``mode``/``options``, then
    calls ``torch._dynamo.optimize`` with it; Dynamo gives the backend no hook before its first
    call, so ``torch._dynamo.optimize`` is wrapped (once) to validate aotforge's arguments
    first. Installed when this module is imported, which Dynamo's entry-point lookup does
    inside ``torch.compile(backend="aotforge")`` before it calls ``optimize``."""
    import torch._dynamo as dynamo

    optimize = dynamo.optimize
    if getattr(optimize, "_aotforge_validates", False):
        return

    @functools.wraps(optimize)
    def optimize_validated(*args: Any, **kwargs: Any) -> Any:
        validate_compile_args(kwargs["backend"] if "backend" in kwargs else (args[0] if args else None))
        return optimize(*args, **kwargs)

    optimize_validated._aotforge_validates = True  # type: ignore[attr-defined]
    dynamo.optimize = optimize_validated


_noticed: set[str] = set()


def _notice_once(key: str, emit: Callable[[], None]) -> None:
    if key not in _noticed:
        _noticed.add(key)
        emit()


def _cpu_notices(mode: Optional[str], options: Optional[dict], why: str) -> None:
    """Graphs on CPU tensors run as ATen calls: say so (and ``why``) once per process, and
    once per option that asks for compiler work there (under the compile's patches)."""
    _notice_once("cpu", lambda: debug.log.warning(CPU_NOTICE.format(why=why)))
    debug.explain_silent_topics_on_cpu()
    from_mode = MODES.get(mode or "default", {})
    for name, what in COMPILER_ONLY_OPTIONS.items():
        value = getattr(config, name)
        if value == config_default(name):
            continue
        if options and name in options:
            source = f"options={{{name!r}: {value!r}}}"
        elif name in from_mode:
            source = f"mode={mode!r}"
        else:
            source = f"aotforge.config.{name}={value!r} (or AOTFORGE_{name.upper()})"
        _notice_once(f"cpu:{name}", lambda source=source, what=what: debug.warn_user(
            f"aotforge: {source} has no effect on CPU tensors: graphs on CPU run as eager's ATen "
            f"calls ({what}); it applies to graphs on CUDA tensors"))


def _patched(fn: Callable, patches: dict[str, Any]) -> Callable:
    """``fn`` run under ``patches`` (in this thread); ``fn`` itself when there are none."""
    if not patches:
        return fn

    @functools.wraps(fn)
    def run_patched(*args: Any, **kwargs: Any) -> Any:
        with config.patch(**patches):
            return fn(*args, **kwargs)
    return run_patched


def _devices(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> set[str]:
    devices = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    for node in gm.graph.nodes:  # tensors created inside the graph (torch.ones(..., device=))
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            devices.add(value.device.type)
    return devices


def _runs_unfused_on_cpu(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Optional[str]:
    """Why this graph of CPU tensors runs as its ATen calls; None when it gets kernels."""
    if config.triton_on_cpu or not _devices(gm, example_inputs) <= {"cpu"}:
        return None
    from .compiler.pipeline import cpu_codegen_problem  # (probes the C++ compiler once)

    return cpu_codegen_problem()


def _compile_scope(recorder, gm: fx.GraphModule):
    """The debug scope of one Dynamo graph: named after the user's function or module and
    Dynamo's compile id (the dump folder's name), keeping the id for TORCH_TRACE."""
    compile_id = gm.meta.get("dynamo_compile_id") if hasattr(gm, "meta") else None
    name = recorder.name if recorder is not None else "graph"
    if compile_id is None:
        return debug.compile_scope(name)
    name = f"{name}_dynamo{str(compile_id).replace('/', '-')}"
    return debug.compile_scope(name, str(compile_id), dynamo_compile_id=compile_id)


def _record(recorder, compiler: Callable, kind: str) -> Callable:
    return recorder.wrap_compiler(compiler, kind) if recorder is not None else compiler


def _record_hit(recorder, example_inputs: Sequence[Any]) -> Optional[Callable]:
    """An AOT cache hit compiles nothing: tell the recorder what was loaded instead."""
    return None if recorder is None else functools.partial(recorder.loaded, list(example_inputs))


def _source_lines_kept(gm: fx.GraphModule):
    """aot_module_simplified keeps Dynamo's source lines itself; the backends' compile scopes
    (recorder, patches) enter the same context around it."""
    from .aot.source_lines import interpreted_node_by_node

    return interpreted_node_by_node(gm)


def _kind(kwargs: dict) -> str:
    if kwargs.get("is_backward"):
        return "backward"
    return "inference" if kwargs.get("is_inference") else "forward"


def aotforge_eager_backend(gm: fx.GraphModule, example_inputs, **kwargs):
    from .compiler.aot_cache import compile_fx_graphs  # the compiler loads on first use

    patches = config_patches(kwargs.get("mode"), kwargs.get("options"))
    recorder = dynamo_recorder()

    def compile(keep: Callable) -> Callable:  # ``keep``: the AOT cache keeps the graphs that run
        return aot_module_simplified(
            gm, example_inputs,
            fw_compiler=keep("forward", _record(recorder, boxing.boxed_nop, "forward")),
            bw_compiler=keep("backward", _record(recorder, boxing.boxed_nop, "backward")),
            inference_compiler=keep("inference", _record(recorder, boxing.boxed_nop, "inference")),
        )

    with config.patch(**patches), _compile_scope(recorder, gm), _source_lines_kept(gm):
        compiled = compile_fx_graphs(gm, example_inputs, compile,  # through the AOT cache
                                     on_hit=_record_hit(recorder, example_inputs))
    return _patched(compiled, patches)


def aotforge_backend(gm: fx.GraphModule, example_inputs, **kwargs):
    """The ``aotforge`` backend (``mode=``/``options=`` come from torch.compile)."""
    mode, options = kwargs.pop("mode", None), kwargs.pop("options", None)
    patches = config_patches(mode, options)
    with config.patch(**patches):
        why = _runs_unfused_on_cpu(gm, example_inputs)
        if why is not None:
            _cpu_notices(mode, options, why)
            debug.log_once(
                "compile", "cpu_unfused",
                f"graphs with CPU inputs run un-decomposed as FX graphs (eager's ATen kernels): {why}; "
                "decomposed ATen op by op is slower than eager on CPU",
            )
            if config.cudagraphs:
                from .compiler.runtime.cudagraphs import nothing_to_do_on_cpu

                nothing_to_do_on_cpu()
            return aotforge_eager_backend(gm, example_inputs, options=patches or None)
        return _compile(gm, example_inputs, patches, kwargs)


def _compile(gm: fx.GraphModule, example_inputs, patches: dict, kwargs: dict) -> Callable:
    from .compiler import compile_fx, compile_fx_inner  # loaded at first use: ``import aotforge`` stays light

    recorder = dynamo_recorder()

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **inner_kwargs: Any) -> Callable:
        kind = _kind(inner_kwargs)
        # Patched here too: the backward compiles later, at the first backward call.
        with config.patch(**patches):
            reference = _copy_graph(graph) if config.verify else None
            compiled = _record(recorder, functools.partial(compile_fx_inner, **inner_kwargs), kind)(graph, inputs)
            if reference is not None:
                from .verify import verified

                compiled = verified(reference, compiled, kind=kind, patches=patches)
        return compiled
    inner_compile.aot_cacheable = True  # type: ignore[attr-defined]  (compile_fx_inner's graphs)
    inner_compile.on_aot_cache_hit = _record_hit(recorder, example_inputs)  # type: ignore[attr-defined]

    with _compile_scope(recorder, gm), _source_lines_kept(gm):
        compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, **kwargs)
    return _patched(compiled, patches)


def _copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy the compiler's in-place passes cannot change (node metadata is shared)."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


aotforge_backend._aotforge_backend = True  # type: ignore[attr-defined]
aotforge_eager_backend._aotforge_backend = True  # type: ignore[attr-defined]


def register_backends() -> None:
    """Register both backends with Dynamo, unless Dynamo is loading them from the package's
    entry points right now (``torch.compile(backend="aotforge")`` without ``import aotforge``:
    Dynamo imports this module, then registers the name itself, and a name registered twice
    is an error)."""
    from torch._dynamo.backends import registry

    compiler_fns = getattr(registry, "_COMPILER_FNS", {})
    known = getattr(registry, "_BACKENDS", {})
    for name, fn in (("aotforge_eager", aotforge_eager_backend), ("aotforge", aotforge_backend)):
        if name in compiler_fns:
            continue  # registered already (by an earlier import or by the entry point)
        if known.get(name) is not None:
            continue  # an entry point Dynamo discovered: it registers the name when it loads it
        registry.register_backend(compiler_fn=fn, name=name)


install_compile_time_validation()
