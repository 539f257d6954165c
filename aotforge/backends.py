"""torch.compile backends: ``aotforge_eager`` (AOT autograd, graphs run as FX) and
``aotforge`` (AOT autograd + our compiler).

``torch.compile(model, backend="aotforge", mode=..., options={...})``:

- ``mode`` maps to config settings (``MODES``); ``"reduce-overhead"`` warns that CUDA graphs
  are not implemented yet and compiles as ``"default"``.
- ``options`` patches ``aotforge.config`` for this compile only, including the backward that
  compiles later and the compiled graphs' runs; unknown names raise ``config.patch``'s error.
- Graphs whose inputs all live on the CPU (without ``config.triton_on_cpu``) run un-decomposed
  as FX graphs through the AOT layer, as eager's kernels are faster than op-by-op decomposed
  ATen until the CPU code generator exists; the ``compile`` log topic says so once.
- With ``config.verify`` (``AOTFORGE_VERIFY=1``) every compiled graph is checked against plain
  ATen on its real inputs (``aotforge/verify.py``).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx import traceback as fx_traceback

from . import debug
from .aot import aot_module_simplified, boxing
from .config import config
from .inspection import dynamo_recorder

# torch.compile's modes -> aotforge.config settings.
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {},  # CUDA graphs: not implemented yet (warns)
    "max-autotune": {"autotune": True},
    "max-autotune-no-cudagraphs": {"autotune": True},
}


def config_patches(mode: Optional[str], options: Optional[dict]) -> dict[str, Any]:
    """The config changes that torch.compile's ``mode`` and ``options`` ask for."""
    if mode is not None and mode not in MODES:
        raise ValueError(
            f"aotforge: unknown torch.compile mode {mode!r}; aotforge supports {sorted(MODES)}"
        )
    if mode == "reduce-overhead":
        warnings.warn(
            "aotforge: mode='reduce-overhead' asks for CUDA graphs, which aotforge does not "
            "implement yet; compiling as mode='default' (no CUDA graphs)",
            stacklevel=2,
        )
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"aotforge: torch.compile options must be a dict, got {type(options).__name__}")
    patches = {**MODES.get(mode or "default", {}), **(options or {})}
    with config.patch(**patches):  # unknown names and unusable values fail here, at once
        pass
    return patches


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


def _runs_unfused_on_cpu(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    return not config.triton_on_cpu and _devices(gm, example_inputs) <= {"cpu"}


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


@contextlib.contextmanager
def _source_lines_kept(gm: fx.GraphModule) -> Iterator[None]:
    """While the AOT layer traces ``gm``, run it node by node with FX's node-meta
    preservation on, so that every ATen node it produces keeps the user's stack trace (the
    graphs, aotforge.inspect and the verify report then show source lines)."""
    if not isinstance(gm, fx.GraphModule) or "forward" in gm.__dict__:
        yield
        return
    gm.forward = lambda *args: fx.Interpreter(gm).run(*args)
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        del gm.forward


def _kind(kwargs: dict) -> str:
    if kwargs.get("is_backward"):
        return "backward"
    return "inference" if kwargs.get("is_inference") else "forward"


def aotforge_eager_backend(gm: fx.GraphModule, example_inputs, **kwargs):
    patches = config_patches(kwargs.get("mode"), kwargs.get("options"))
    recorder = dynamo_recorder()
    with config.patch(**patches), _compile_scope(recorder, gm), _source_lines_kept(gm):
        compiled = aot_module_simplified(
            gm, example_inputs,
            fw_compiler=_record(recorder, boxing.boxed_nop, "forward"),
            bw_compiler=_record(recorder, boxing.boxed_nop, "backward"),
            inference_compiler=_record(recorder, boxing.boxed_nop, "inference"),
        )
    return _patched(compiled, patches)


def aotforge_backend(gm: fx.GraphModule, example_inputs, **kwargs):
    """The ``aotforge`` backend (``mode=``/``options=`` come from torch.compile)."""
    patches = config_patches(kwargs.pop("mode", None), kwargs.pop("options", None))
    with config.patch(**patches):
        if _runs_unfused_on_cpu(gm, example_inputs):
            debug.log_once(
                "compile", "cpu_unfused",
                "graphs with CPU inputs run un-decomposed as FX graphs (eager's ATen kernels): "
                "aotforge generates kernels only for CUDA tensors until its CPU code generator "
                "exists, and decomposed ATen op by op is slower than eager on CPU "
                "(config.triton_on_cpu forces the Triton path, for tests)",
            )
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

    with _compile_scope(recorder, gm), _source_lines_kept(gm):
        compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, **kwargs)
    return _patched(compiled, patches)


def _copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy the compiler's in-place passes cannot change (node metadata is shared)."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


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
