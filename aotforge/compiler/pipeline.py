"""The compiler's entry points, each a flat list of named stages between printable records.

``compile_fx_inner(gm, example_inputs)`` compiles one functional ATen graph::

    post-grad FX graph -> LoweredGraph -> BufferReads -> KernelPlan -> MemoryPlan
      -> KernelSource per kernel + the wrapper's Program -> CompiledGraph

(CUDA tensors, or CPU tensors with ``config.triton_on_cpu``; other graphs run as the graph's
own ATen calls). ``compile_fx(model, example_inputs)`` is the torch.compile backend: it
normalizes the graph (tuple outputs, flat inputs, pytree codegen), runs pre-grad passes, then
AOT autograd with ``compile_fx_inner`` as forward, backward and inference compiler.

Every compiled callable carries its ``CompiledGraph`` (``fn.compiled_graph``): the records,
the sources and the compile-time breakdown; ``observe()`` collects those of a block of code.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import debug
from ..aot import aot_module_simplified
from ..config import config
from ..partition import min_cut_rematerialization_partition
from . import aot_cache, passes
from .codegen.kernel import emit_kernels
from .codegen.cpp import CppPrinter
from .codegen.triton import TritonPrinter
from .codegen.wrapper import emit_wrapper
from .kernel_report import report_of
from .decompositions import select_decomposition_table
from .lowering import lower
from .runtime import compile_pool, compiled as runtime, cudagraphs, graph_cache
from .runtime.compiled import CompiledGraph
from .schedule import analyze_reads, fuse, plan_memory
from .sizes import SizeVars, UnsupportedSize, size_vars

log = logging.getLogger("aotforge")

# every open observe() block's list; process-wide, because the backward graph compiles at the
# first backward call, in autograd's device thread
_observers: list[list[CompiledGraph]] = []
_observers_lock = threading.Lock()


@contextlib.contextmanager
def observe() -> Iterator[list[CompiledGraph]]:
    """Collect the ``CompiledGraph`` of every graph compiled (in any thread) inside the block
    (tests and tools: ``with observe() as graphs: model(x); print(graphs[-1])``)."""
    graphs: list[CompiledGraph] = []
    with _observers_lock:
        _observers.append(graphs)
    try:
        yield graphs
    finally:
        with _observers_lock:
            _observers.remove(graphs)


def _announce(compiled: CompiledGraph) -> None:
    with _observers_lock:
        for graphs in _observers:
            graphs.append(compiled)


class _Stopwatch:
    """Seconds per named stage, in the order the stages ran."""

    def __init__(self, timings: Optional[dict] = None) -> None:
        self.timings: dict[str, float] = dict(timings or {})
        self.current = "post_grad_passes"  # the stage last entered: what a failure names

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        self.current = stage
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - started


def compile_fx_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                     static_input_idxs: Sequence[int] = (), is_backward: bool = False,
                     is_inference: bool = False, graph_id: Optional[int] = None,
                     aot_timings: Optional[dict] = None, **unused: Any) -> Callable:
    """Compile one functional ATen graph; returns a boxed callable (``fn(args_list)``).
    ``aot_timings`` (from ``compile_fx``) holds the AOT stages' seconds, reported with the
    first graph compiled after them."""
    kind = "backward" if is_backward else "inference" if is_inference else "forward"
    if not _has_calls(gm):
        return _boxed(_aten_graph(kind, gm, {}))
    clock = _Stopwatch(_take_aot_timings(kind, aot_timings))
    # keyed on the graph as handed over (before any pass); a hit skips every stage below
    cache, hit = graph_cache.lookup(kind, gm, example_inputs, _run_fx(gm)) if _wants_kernels(gm) else (None, None)
    if hit is not None:
        hit.timings = {**clock.timings, **hit.timings}
        _log_output_code(hit)
        return _boxed(hit, gm)
    compile_pool.start_if_useful()  # workers boot while this graph is lowered
    handed_over = gm
    try:
        with clock("post_grad_passes"):
            _ensure_fake_values(gm, example_inputs)
            gm = passes.post_grad_passes(gm)
    except Exception as error:  # noqa: BLE001
        return _compiler_failed(kind, graph_id, clock, error, handed_over)
    debug.graph_artifact("graphs", f"{kind}_post_grad", gm)
    sizes = _size_vars(gm)                                 # SizeVars: symbols, where each is read
    if not (_wants_kernels(gm) and sizes is not None and _is_functional(gm)):
        # FX's generated code: one ATen call per node, frees at last use
        return _boxed(_aten_graph(kind, gm, clock.timings), gm)
    try:
        compiled = _compile_to_kernels(kind, gm, sizes, clock)
    except Exception as error:  # noqa: BLE001
        if _is_cpp_failure(error):
            # the system compiler refused our C++ (or went away): the graph keeps eager's
            # kernels, and the kept source makes the bug report
            debug.warn_user(f"aotforge: a {kind} graph runs as ATen calls (eager's kernels): building its C++ "
                            f"kernels failed: {error}")
            return _boxed(_aten_graph(kind, gm, clock.timings), gm)
        if sizes.dynamic and not config.strict:
            # symbolic sizes reach corners static ones never do: such a failure costs the graph
            # its kernels, never the user's compile
            log.warning("aotforge: a %s graph with symbolic sizes runs as ATen calls: compiling it failed "
                        "(%s: %s)", kind, type(error).__name__, error)
            return _boxed(_aten_graph(kind, gm, clock.timings), gm)
        return _compiler_failed(kind, graph_id, clock, error, gm)
    graph_cache.store(cache, compiled)
    return _boxed(compiled, gm)


def _compiler_failed(kind: str, graph_id: Optional[int], clock: "_Stopwatch", error: Exception,
                     gm: fx.GraphModule) -> Callable:
    """A failure inside the compiler (a pass, the lowering, code generation, loading): under
    ``config.strict`` it raises; otherwise the graph runs as its own ATen calls, which are
    eager's kernels, and one warning names the graph, the stage and the error."""
    if config.strict:
        raise error
    debug.warn_user(_fallback_message(kind, graph_id, clock.current, error))
    return _boxed(_aten_graph(kind, gm, clock.timings))


def _fallback_message(kind: str, graph_id: Optional[int], stage: str, error: BaseException) -> str:
    graph = f"{kind} graph" + (f" {graph_id}" if graph_id is not None else "")
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    return (f"aotforge: the {graph} runs as ATen calls (eager's kernels, correct but unfused): its {stage} "
            f"stage failed with {type(error).__name__}: {first_line}. This is an aotforge bug; please report "
            "it with AOTFORGE_DUMP_DIR set. AOTFORGE_STRICT=1 raises instead.")


# its compiled graphs are what the compiled-graph cache holds: an AOT compile through it can
# be cached whole (compiler/aot_cache.py); a compiler of the caller's own cannot
compile_fx_inner.aot_cacheable = True  # type: ignore[attr-defined]


# The code generator of each device: the printer that spells its kernels (codegen); the
# kernels' language picks the loader that makes them callable (runtime.LOADERS). Triton
# serves CUDA, C++ the CPU (Triton too under ``config.triton_on_cpu``, for tests).
TARGETS: dict[str, Callable[[], Any]] = {"cuda": TritonPrinter, "cpu": CppPrinter}


def _printer(gm: fx.GraphModule) -> Any:
    devices = _devices(gm)
    if "cuda" in devices or config.triton_on_cpu:
        return TARGETS["cuda"]()
    return TARGETS["cpu"]()


def _compile_to_kernels(kind: str, gm: fx.GraphModule, sizes: SizeVars, clock: "_Stopwatch") -> CompiledGraph:
    """The stages from the post-grad graph to the loaded program."""
    with clock("post_grad_passes"):
        gm = passes.library_call_passes(gm, kind)              # padded matmuls, scatter-add accumulation
    printer = _printer(gm)
    with clock("lower"), config.patch(**printer.lowering_config):
        lowered = lower(gm, sizes, eager_rounding=printer.keeps_eager_rounding)  # LoweredGraph
    debug.artifact("ir", f"{kind}_lowered", lambda: str(lowered), ".txt")
    with clock("schedule"):
        reads = analyze_reads(lowered)                     # BufferReads: who reads what, once
        plan = fuse(lowered, reads)                        # KernelPlan: kernels and extern calls
        memory = plan_memory(lowered, plan, reads)         # MemoryPlan: allocations, reuse, frees
    debug.artifact("ir", f"{kind}_kernel_plan", lambda: str(plan), ".txt")
    if plan.refusals:
        debug.artifact("ir", f"{kind}_fusion_refusals", plan.describe_refusals, ".txt")
    debug.artifact("ir", f"{kind}_memory_plan", lambda: str(memory), ".txt")
    with clock("codegen"):
        kernels = emit_kernels(lowered, plan, reads, printer)  # KernelSource per kernel group
        program = emit_wrapper(lowered, plan, memory, kernels)  # the wrapper's Python source
    if debug.dump_dir() or debug.enabled("ir"):  # bytes, coalescing, pointers of each kernel
        _dump_kernel_report(kind, lowered, plan, kernels, reads)
    compiled = runtime.load(kind, lowered, plan, memory, kernels, program, clock.timings,  # CompiledGraph
                            run_aten_graph=_run_fx(gm), language=printer.language)
    _log_output_code(compiled)
    return compiled


def _dump_kernel_report(kind: str, lowered, plan, kernels, reads) -> None:
    """The kernel report, a record for reading: a failure to make it is logged and never
    changes what is compiled (a dump folder must not change the program)."""
    try:
        text = str(report_of(kind, lowered, plan, kernels, reads=reads))
    except Exception as error:  # noqa: BLE001
        log.warning("aotforge: no kernel report for the %s graph (%s: %s)", kind, type(error).__name__, error)
        return
    debug.artifact("ir", f"{kind}_kernel_report", text, ".txt")


def _log_output_code(compiled: CompiledGraph) -> None:
    debug.artifact("output_code", f"{compiled.kind}_kernels", compiled.kernel_source)
    debug.artifact("output_code", f"{compiled.kind}_wrapper", compiled.wrapper_source)


def _boxed(compiled: CompiledGraph, gm: Optional[fx.GraphModule] = None) -> Callable:
    """The boxed callable handed back to AOT autograd. Its first call also times what happens
    only then (Triton compiles each kernel at its first launch, then autotunes it) and logs
    the compile-time breakdown. With ``config.cudagraphs`` the graph ``gm`` replays as CUDA
    graphs (``compiled.cudagraphs`` is their record)."""
    if gm is not None:
        compiled = cudagraphs.wrap_compiled(compiled, gm)
    state: list[Callable] = []
    scope = debug.current_scope()  # the compile's: the timings below join its artifacts

    def first_call(args: list) -> Any:
        # launchers shared with an earlier graph were compiled (and counted) there
        fresh = [k for k in {id(k): k for k in compiled.launchers.values()}.values() if k.best is None]
        started = time.perf_counter()
        retry = list(args) if _may_retry_as_aten(compiled, gm) else None
        try:
            out = compiled.call(args)
        except Exception as error:  # noqa: BLE001  (Triton compiles each kernel at its first launch)
            if retry is None:
                raise
            # eager's kernels: the user's own mistake raises there as it would eagerly
            out = _run_fx(gm)(retry)
            debug.warn_user(_fallback_message(compiled.kind, None, "kernel compile (first launch)", error))
            state[0] = _run_fx(gm)
            return out
        if compiled.program is not None:
            total = time.perf_counter() - started
            for stage in ("pool_wait", "triton_compile", "autotune"):
                compiled.timings[stage] = sum(k.seconds[stage] for k in fresh)
            compiled.pool_seconds = sum(k.pool_seconds for k in fresh)
            compiled.timings["first_run"] = total - sum(sum(k.seconds.values()) for k in fresh)
        state[0] = compiled.call
        with debug.rejoin(scope):
            debug.artifact("compile_time", f"{compiled.kind}_compile_time", compiled.describe_timings(), ".txt")
        return out

    state.append(first_call)

    def call(args: list) -> Any:
        return state[0](args)

    call._boxed_call = True  # type: ignore[attr-defined]
    call.compiled_graph = compiled  # type: ignore[attr-defined]
    _announce(compiled)
    return call


def _may_retry_as_aten(compiled: CompiledGraph, gm: Optional[fx.GraphModule]) -> bool:
    """Whether a failed first call of generated kernels may run again as ATen calls: not
    under ``config.strict``, and only for a graph that writes none of its inputs (a kernel
    that ran before the failure may have written one already)."""
    return (not config.strict and gm is not None and compiled.program is not None
            and not any(node.op == "call_function" and getattr(node.target, "_schema", None) is not None
                        and node.target._schema.is_mutable for node in gm.graph.nodes))


def _aten_graph(kind: str, gm: fx.GraphModule, timings: dict) -> CompiledGraph:
    """A graph run as its own ATen calls (no lowering records)."""
    return CompiledGraph(kind, _run_fx(gm), None, None, None, (), None, {}, timings)


def _run_fx(gm: fx.GraphModule) -> Callable[[list], Any]:
    """The graph's own ATen calls, boxed."""
    def run(args: list) -> Any:
        values = list(args)
        args.clear()
        return gm(*values)
    return run


def _has_calls(gm: fx.GraphModule) -> bool:
    return any(node.op == "call_function" for node in gm.graph.nodes)


def _ensure_fake_values(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Every node needs ``meta['val']``; graphs built by hand may lack it."""
    if all("val" in n.meta for n in gm.graph.nodes if n.op not in ("output",)):
        return
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from ..torch_versions import new_fake_mode

    fake_mode = detect_fake_mode(example_inputs) or new_fake_mode(allow_non_fake_inputs=True)
    inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not _is_fake(x) else x for x in example_inputs]
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)


def _is_fake(x: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def _devices(gm: fx.GraphModule) -> set[str]:
    return {n.meta["val"].device.type for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}


def _wants_kernels(gm: fx.GraphModule) -> bool:
    """Whether the graph gets generated kernels: on CUDA always; on the CPU with Triton's
    interpreter (tests) or with C++ (``cpu_codegen_problem`` says when not)."""
    devices = _devices(gm)
    if "cuda" in devices or config.triton_on_cpu:
        return True
    return cpu_codegen_problem() is None


def _is_cpp_failure(error: BaseException) -> bool:
    from .runtime import cpp_build

    return isinstance(error, (cpp_build.CppCompileError, cpp_build.CppUnavailable))


def cpu_codegen_problem() -> Optional[str]:
    """None when CPU graphs get C++ kernels; else why they run as ATen calls."""
    if not config.cpu_codegen:
        return "config.cpu_codegen is off"
    from .runtime import cpp_build  # probes the C++ compiler once per process

    problem = cpp_build.compiler_problem()
    return None if problem is None else f"no usable C++ compiler: {problem}"


def _size_vars(gm: fx.GraphModule) -> Optional[SizeVars]:
    """The graph's symbolic sizes, or None when one cannot be compiled (a size that depends
    on data, or that the wrapper cannot read from the inputs): such graphs run as ATen calls."""
    try:
        return size_vars(gm)
    except UnsupportedSize as reason:
        debug.log_once("compile", f"unsupported_size:{reason}",
                       f"a graph runs as ATen calls, without generated kernels: {reason}")
        return None


def _is_functional(gm: fx.GraphModule) -> bool:
    """In-place ops other than ``copy_`` into a graph input would need alias tracking the
    loop IR does not do; such graphs run as ATen calls."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target._schema.is_mutable:
                if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder":
                    continue
                return False
    return True


# --- the torch.compile backend -------------------------------------------------------------

def _take_aot_timings(kind: str, aot: Optional[dict]) -> dict[str, float]:
    """The AOT stages' seconds (trace, partition) for the first graph compiled after them."""
    if not aot or kind == "backward" or "started" not in aot:
        return {}
    timings = {"trace": time.perf_counter() - aot.pop("started") - aot.get("partition", 0.0)}
    if "partition" in aot:
        timings["partition"] = aot["partition"]
    return timings


def partitioner(aot_timings: Optional[dict] = None) -> Callable:
    """The backend's partitioner: the joint-graph passes, then min-cut rematerialization.
    ``aot_timings`` (when given) adds up the seconds spent, under ``"partition"``."""
    timings = {} if aot_timings is None else aot_timings

    def partition_with_joint_passes(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        started = time.perf_counter()
        try:
            joint = passes.joint_graph_passes(joint)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        finally:
            timings["partition"] = timings.get("partition", 0.0) + time.perf_counter() - started
    return partition_with_joint_passes


def _patched(fn: Callable, config_patches: dict) -> Callable:
    """``fn`` run under ``config_patches``: the backward graph compiles lazily, long after
    ``compile_fx`` returned, and the compiled graphs run later still; both must see the
    options the compile was asked for."""
    if not config_patches:
        return fn

    @functools.wraps(fn)  # keeps what the AOT cache reads (aot_cacheable, on_aot_cache_hit)
    def run_patched(*args: Any, **kwargs: Any) -> Any:
        with config.patch(**config_patches):
            return fn(*args, **kwargs)
    return run_patched


def compile_fx(model: fx.GraphModule, example_inputs: Sequence[Any],
               inner_compile: Callable = compile_fx_inner, config_patches: Optional[dict] = None,
               decompositions: Optional[dict] = None) -> Callable:
    """Compile a Dynamo FX graph (torch-level) end to end; the torch.compile backend. The
    input is normalized first (``_normalize``: each step gives a simpler model and how to call
    what compiling it returns), then traced by AOT autograd with ``inner_compile`` per graph.
    ``config_patches`` apply to all of it, in one place: the compile, the lazily compiled
    backward and every call."""
    config_patches = dict(config_patches or {})
    with config.patch(**config_patches):  # unknown options fail here, at once
        model, example_inputs, adapt = _normalize(model, list(example_inputs))
        compiled = _compile_aot(model, example_inputs, _patched(inner_compile, config_patches), decompositions)
    return _patched(adapt(compiled), config_patches)


def _compile_aot(model: Any, example_inputs: list, inner_compile: Callable, decompositions: Optional[dict]) -> Callable:
    # the whole AOT compile from disk, when this Dynamo graph was compiled by an earlier process
    cache, hit = aot_cache.lookup(model, example_inputs, inner_compile, _boxed) if decompositions is None \
        else (None, None)
    if hit is not None:
        return hit
    compile_pool.start_if_useful()  # workers boot while the graph is traced and partitioned
    table = select_decomposition_table(decompositions)
    aot_timings = {"started": time.perf_counter()}  # trace and partition seconds, for the breakdown
    aten: dict = {}  # symbolic sizes: each graph's ATen code, which the AOT entry keeps
    keep = aot_cache.keep_aten_code(cache, aten)
    forward = keep("forward", functools.partial(inner_compile, is_backward=False, aot_timings=aot_timings))
    backward = keep("backward", functools.partial(inner_compile, is_backward=True))
    inference = keep("inference", functools.partial(inner_compile, is_inference=True, aot_timings=aot_timings))
    with graph_cache.capture() as graph_keys:  # the compiled-graph entries the AOT entry refers to
        compiled = aot_module_simplified(model, list(example_inputs), fw_compiler=forward, bw_compiler=backward,
                                         inference_compiler=inference, decompositions=table,
                                         partition_fn=partitioner(aot_timings), keep_inference_input_mutations=True,
                                         # both graphs' kernels go to the compile pool at once
                                         compile_backward_now=True)
    aot_cache.store(cache, compiled, graph_keys, aten)
    return compiled


# --- input normalization: steps from what Dynamo hands us to a flat graph of tuple outputs ----

def _normalize(model: Any, example_inputs: list) -> tuple[Any, list, Callable[[Callable], Callable]]:
    """Apply the normalization steps in order. Each step returns the new model and inputs and
    how to adapt the compiled new model to the old one's calling convention; ``adapt`` applies
    them all, innermost first."""
    adapters: list[Callable] = []
    if isinstance(model, fx.GraphModule) and isinstance(model.graph._codegen, fx.graph._PyTreeCodeGen):
        model, example_inputs, adapter = _flat_pytree_codegen(model, example_inputs)
        adapters.append(adapter)
    if any(isinstance(x, (list, tuple)) for x in example_inputs):
        model, example_inputs, adapter = _flattened_inputs(model, example_inputs)
        adapters.append(adapter)
    if isinstance(model, fx.GraphModule) and not _returns_tuple(model):
        model = _make_output_tuple(model)
        adapters.append(lambda compiled: lambda *args: compiled(*args)[0])
    if isinstance(model, fx.GraphModule):
        model = passes.pre_grad_passes(model)

    def adapt(compiled: Callable) -> Callable:
        for adapter in reversed(adapters):
            compiled = adapter(compiled)
        return compiled
    return model, example_inputs, adapt


def _returns_tuple(gm: fx.GraphModule) -> bool:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


def _make_output_tuple(gm: fx.GraphModule) -> fx.GraphModule:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((output.args[0],),)
    gm.recompile()
    return gm


def _flat_pytree_codegen(model: fx.GraphModule, example_inputs: list) -> tuple:
    """Graphs from ``torch._dynamo.export`` take and return pytrees: the flat graph inside,
    (un)flattened around it."""
    codegen = model.graph._codegen
    in_spec, out_spec = codegen.pytree_info.in_spec, codegen.pytree_info.out_spec
    model.graph._codegen = fx.graph.CodeGen()
    model.recompile()
    flat_inputs = pytree.arg_tree_leaves(*example_inputs) if in_spec is not None else list(example_inputs)

    def adapt(compiled: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            flat = pytree.arg_tree_leaves(*args, **kwargs) if in_spec is not None else list(args)
            out = compiled(*flat)
            return pytree.tree_unflatten(list(out) if isinstance(out, (list, tuple)) else [out], out_spec) \
                if out_spec is not None else out
        return run
    return model, list(flat_inputs), adapt


class _FlatInputs(torch.nn.Module):
    def __init__(self, model: Callable, spec: Any):
        super().__init__()
        self.model, self.spec = model, spec

    def forward(self, *flat: Any) -> Any:
        return self.model(*pytree.tree_unflatten(list(flat), self.spec))


def _flattened_inputs(model: Any, example_inputs: list) -> tuple:
    """Inputs that are lists or tuples of tensors: a module over their leaves."""
    flat, spec = pytree.tree_flatten(list(example_inputs))

    def adapt(compiled: Callable) -> Callable:
        return lambda *args: compiled(*pytree.tree_flatten(list(args))[0])
    return _FlatInputs(model, spec), flat, adapt
