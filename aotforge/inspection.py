"""``aotforge.inspect(compiled)``: everything aotforge did for a compiled object, per compiled
graph and per recompile (Thunder's ``last_traces``, for a compiler).

    compiled = aotforge.aot_function(f, nop)          # or aot_module(...), or
    compiled(x)                                       # torch.compile(model, backend="aotforge")
    report = aotforge.inspect(compiled)
    print(report)                                     # every part, readably
    report.records[0].graphs["forward"]               # the FX graphs themselves

Each ``CompileRecord`` holds: the FX graphs (joint, forward, backward, inference) with their
source lines, the partition (what the forward saves, what the backward recomputes, bytes), the
compiler's output per graph (lowered IR, kernel plan, memory plan, each kernel's source and
launch configuration, the wrapper), the signature the compile specialized on (and, under
torch.compile, Dynamo's guards) and the compile-time breakdown.

Records are collected here, not by the AOT layer or the compiler: the public ``aot_function`` /
``aot_module`` and the torch.compile backend wrap the partitioner and the graph compilers they
pass down, and read the compiler's result through ``compiled_graph`` attributes with getattr
fallbacks (so that records from a newer compiler show up without a change here).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import inspect as _pyinspect
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from . import aot as _aot, debug
from .partition import default_partition

# The compiler's result parts, read from the boxed callable's ``compiled_graph``, in print order.
COMPILED_PARTS = ("lowered", "kernel_plan", "memory_plan", "wrapper_source", "kernel_source")
GRAPH_KINDS = ("joint", "forward", "backward", "inference")


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        grad = ", requires_grad" if value.requires_grad else ""
        return f"{value.dtype} {tuple(value.shape)} on {value.device}{grad}"
    if isinstance(value, torch.SymInt):
        return f"SymInt {value}"
    return f"{type(value).__name__} {value!r}"


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        count = value.numel()
        if isinstance(count, torch.SymInt):
            # its hint, never int(): converting a symbolic size adds a guard (and a recompile)
            count = getattr(count.node, "hint", None) or 0
        return int(count) * value.element_size()
    return 0


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def source_lines(gm: fx.GraphModule) -> list[str]:
    """``node: file:line code`` for every node that kept the user's stack trace."""
    lines = []
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            lines.append(f"{node.name}: {debug.user_frame(trace)}")
    return lines


@dataclasses.dataclass
class Partition:
    """What the forward saves for the backward and what the backward recomputes."""

    saved: list[tuple[str, str, int]]  # (name, description, bytes)
    recomputed: list[str]

    @classmethod
    def from_graphs(cls, forward: fx.GraphModule, backward: fx.GraphModule) -> "Partition":
        saved = [
            (node.name, _describe_value(node.meta.get("val")), _nbytes(node.meta.get("val")))
            for node in _placeholders(backward)
            if not node.name.startswith("tangents")
        ]
        forward_names = {n.name for n in forward.graph.nodes if n.op == "call_function"}
        # The partitioner keeps the joint's node names, so a backward node named like a
        # forward node is a recomputed copy of it.
        recomputed = [
            n.name for n in backward.graph.nodes if n.op == "call_function" and n.name in forward_names
        ]
        return cls(saved, recomputed)

    def __str__(self) -> str:
        total = sum(size for _, _, size in self.saved)
        lines = [f"saved for backward: {len(self.saved)} values, {total} bytes"]
        lines += [f"  {name}: {text} ({size} bytes)" for name, text, size in self.saved]
        lines.append(f"recomputed in backward: {len(self.recomputed)} nodes"
                     + (f": {', '.join(self.recomputed)}" if self.recomputed else ""))
        return "\n".join(lines)


@dataclasses.dataclass
class CompiledPart:
    """The compiler's output for one graph, held weakly: a record describes a compile, it does
    not keep the compiled graph (and its loaded C++ libraries) alive after Dynamo dropped it
    (``del`` and ``torch._dynamo.reset()``; the records of a plain function live on)."""

    kind: str
    callable: Any
    seconds: float

    def __post_init__(self) -> None:
        if _weakable(self.callable):
            self.callable = weakref.ref(self.callable)
            self.weak = True
        else:
            self.weak = False

    @property
    def released(self) -> bool:
        return self.weak and self.callable() is None

    @property
    def compiled_graph(self) -> Any:
        return getattr(self.callable() if self.weak else self.callable, "compiled_graph", None)

    def kernels(self) -> list[str]:
        described = []
        for kernel in getattr(self.compiled_graph, "kernels", None) or []:
            launch = getattr(kernel, "best", None) or (getattr(kernel, "configs", None) or [None])[0]
            described.append(
                f"kernel {getattr(kernel, 'name', '?')} ({getattr(kernel, 'kind', '?')}, "
                f"numel={getattr(kernel, 'numel', '?')}, rnumel={getattr(kernel, 'rnumel', '?')}, "
                f"launch={launch})\n{getattr(kernel, 'source', '')}"
            )
        return described

    def __str__(self) -> str:
        graph = self.compiled_graph
        if self.released:
            return f"{self.kind}: compiled in {self.seconds:.3f}s (since released: nothing runs it any more)"
        if graph is None:
            return (f"{self.kind}: runs as the FX graph's ATen calls (no kernels generated); "
                    f"compiled in {self.seconds:.3f}s")
        lines = [f"{self.kind}: compiled in {self.seconds:.3f}s"]
        timings = getattr(graph, "timings", None)
        if timings:
            lines.append("  stages: " + ", ".join(f"{k} {v:.3f}s" for k, v in timings.items()))
        for part in COMPILED_PARTS:
            value = getattr(graph, part, None)
            if value:
                if part == "kernel_source" and getattr(graph, "kernels", None):
                    continue  # shown per kernel below, with launch configurations
                lines.append(f"--- {self.kind} {part} ---\n{value}")
        for text in self.kernels():
            lines.append(f"--- {self.kind} {text}")
        return "\n".join(lines)


@dataclasses.dataclass
class CompileRecord:
    """One compile of one graph (one Dynamo graph, or one input signature of aot_function)."""

    name: str
    number: int  # 0 for the first compile of this object, 1 for its first recompile, ...
    signature: list[str] = dataclasses.field(default_factory=list)
    # per input: {"dtype", "shape", "device", "requires_grad"} or {"value"}; plus the graph kind
    signature_parts: list[dict] = dataclasses.field(default_factory=list)
    kind: str = ""
    recompile_reason: str = ""
    graphs: dict[str, fx.GraphModule] = dataclasses.field(default_factory=dict)
    partition: Optional[Partition] = None
    compiled: dict[str, CompiledPart] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    guards: str = ""
    scope: Optional[debug.CompileScope] = None
    # loaded whole from the AOT cache (an earlier process compiled it): no graphs were traced;
    # ``graph_code`` has the code of the graphs that run as FX, by kind
    cached: bool = False
    graph_code: dict[str, str] = dataclasses.field(default_factory=dict)

    def artifacts(self) -> list[tuple[str, str, Any]]:
        return list(self.scope.artifacts) if self.scope else []

    def fill_from_scope(self) -> None:
        """Graphs the AOT layer logged in this compile's scope that no wrapper saw (under
        torch.compile the partitioner is the compiler's own)."""
        for topic, name, value in self.artifacts():
            if topic == "graphs" and isinstance(value, fx.GraphModule):
                kind = name.rsplit("_", 1)[-1]
                if kind in GRAPH_KINDS:
                    self.graphs.setdefault(kind, value)
        forward, backward = self.graphs.get("forward"), self.graphs.get("backward")
        if self.partition is None and forward is not None and backward is not None:
            self.partition = Partition.from_graphs(forward, backward)

    def __str__(self) -> str:
        title = f"===== {self.name}: compile {self.number}"
        out = [title + (f" (recompile: {self.recompile_reason})" if self.recompile_reason else "") + " ====="]
        if self.cached:
            out.append("loaded from the AOT cache: an earlier process traced and compiled it")
        if self.signature:
            out.append("signature:\n" + "\n".join(f"  {line}" for line in self.signature))
        if self.guards:
            out.append(f"guards:\n{self.guards}")
        for kind in GRAPH_KINDS:
            gm = self.graphs.get(kind)
            if gm is not None:
                out.append(f"--- {kind} graph ---\n{debug.graph_text(gm).rstrip()}")
                lines = source_lines(gm)
                if lines:
                    out.append(f"--- {kind} graph source lines ---\n" + "\n".join(lines))
            elif kind in self.graph_code:
                out.append(f"--- {kind} graph (its code, from the AOT cache) ---\n{self.graph_code[kind].strip()}")
        if self.partition is not None:
            out.append(f"--- partition ---\n{self.partition}")
        for part in self.compiled.values():
            out.append(str(part))
        if self.timings:
            out.append("compile time: " + ", ".join(f"{k} {v:.3f}s" for k, v in self.timings.items()))
        return "\n".join(out)


@dataclasses.dataclass
class Inspection:
    """Every compile of one compiled object, oldest first."""

    target: str
    records: list[CompileRecord]

    def __str__(self) -> str:
        if not self.records:
            return f"{self.target}: not compiled yet (call it once, then inspect)"
        return "\n\n".join(str(record) for record in self.records)


class Recorder:
    """Collects ``CompileRecord``s for one compiled object by wrapping what it hands down to
    the AOT layer: the partitioner and the forward, backward and inference compilers."""

    def __init__(self, name: str, dynamo: bool = False):
        self.name = name
        self.dynamo = dynamo  # under torch.compile: Dynamo decides (and logs) recompiles
        self.records: list[CompileRecord] = []
        self._current = threading.local()

    # A compile starts at the partitioner (training) or the inference compiler.
    def start(self, example_inputs: list, kind: str) -> CompileRecord:
        record = CompileRecord(self.name, len(self.records), kind=kind)
        record.signature = [f"input {i}: {_describe_value(v)}" for i, v in enumerate(example_inputs)]
        record.signature_parts = [signature_parts(v) for v in example_inputs]
        record.scope = debug.current_scope()
        if self.records and self.dynamo:
            self._dynamo_recompile(record)
        elif self.records:
            record.recompile_reason = signature_change(self.records[-1], record)
            debug.artifact("recompiles", f"{self.name}_recompile_{record.number}",
                           f"{self.name} compiled again ({record.number + 1} compiles): "
                           f"{record.recompile_reason}", suffix=".txt")
        self.records.append(record)
        self._current.record = record
        return record

    def _dynamo_recompile(self, record: CompileRecord) -> None:
        """Under torch.compile a later compile is another graph of the frame (a graph
        break) or Dynamo compiling the same frame again (its compile id ``frame/n``, n > 0):
        the second is a recompile, logged with Dynamo's guard failure and what changed in
        the graph's inputs since that frame's previous compile."""
        compile_id = record.scope.dynamo_compile_id if record.scope else None
        frame_id = getattr(compile_id, "frame_id", None)
        if not getattr(compile_id, "frame_compile_id", 0):
            record.recompile_reason = (f"Dynamo graph {compile_id}: another graph of "
                                       f"{self.name} (a graph break)")
            return
        previous = [r for r in self.records if r.scope is not None
                    and getattr(r.scope.dynamo_compile_id, "frame_id", None) == frame_id]
        changed = signature_change(previous[-1], record) if previous else ""
        reason = _dynamo_recompile_reason() or "a guard failed (TORCH_LOGS=recompiles says which)"
        record.recompile_reason = f"Dynamo recompiled {self.name} ({compile_id}): {reason}" + (
            f"\n  graph inputs: {changed}" if previous else "")
        debug.artifact("recompiles", f"{self.name}_recompile_{record.number}",
                       record.recompile_reason, suffix=".txt")

    def current(self) -> Optional[CompileRecord]:
        return getattr(self._current, "record", None)

    def loaded(self, example_inputs: list, hit: Any) -> None:
        """A compile loaded whole from the AOT cache (``hit``: its ``aot_cache.Hit``)."""
        record = self.start(list(example_inputs), "training" if hit.training else "inference")
        record.cached = True
        record.timings["AOT cache load"] = hit.seconds
        for kind, part in hit.parts.items():
            record.compiled[kind] = CompiledPart(kind, part, 0.0)
        record.graph_code.update(hit.codes)

    def wrap_partition(self, partition_fn: Callable) -> Callable:
        @functools.wraps(partition_fn)
        def partition(joint: fx.GraphModule, joint_inputs, *args, **kwargs):
            num_primals = sum(1 for n in _placeholders(joint) if not n.name.startswith("tangents"))
            record = self.start(list(joint_inputs)[:num_primals], "training")
            record.graphs["joint"] = joint
            started = time.perf_counter()
            forward, backward = partition_fn(joint, joint_inputs, *args, **kwargs)
            record.timings["partition"] = time.perf_counter() - started
            record.graphs["forward"], record.graphs["backward"] = forward, backward
            try:
                record.partition = Partition.from_graphs(forward, backward)
            except Exception as error:  # a record must never break a compile
                debug.log.info("aotforge.inspect: no partition summary: %s", error)
            return forward, backward
        return partition

    def wrap_compiler(self, compiler: Callable, kind: str) -> Callable:
        def compile_graph(gm: fx.GraphModule, example_inputs, *args, **kwargs):
            record = self._record_for(gm, kind, example_inputs)
            record.graphs.setdefault(kind, gm)
            scope = record.scope if kind == "backward" and record.scope else None
            started = time.perf_counter()
            previous = getattr(_compiling, "value", None)
            _compiling.value = ([kind], self.name, record.number)
            try:
                if scope is not None:  # the backward compiles later, in its own call: rejoin the scope
                    with debug.compile_scope(record.name, scope=scope):
                        result = compiler(gm, example_inputs, *args, **kwargs)
                else:
                    result = compiler(gm, example_inputs, *args, **kwargs)
            finally:
                _compiling.value = previous
            seconds = time.perf_counter() - started
            record.timings[f"{kind} compile"] = seconds
            record.compiled[kind] = CompiledPart(kind, result, seconds)
            return result

        compile_graph.__name__ = getattr(compiler, "__name__", "compiler")
        compile_graph.__wrapped__ = compiler  # type: ignore[attr-defined]
        return compile_graph

    def _record_for(self, gm: fx.GraphModule, kind: str, example_inputs) -> CompileRecord:
        if kind == "inference":
            record = self.start(list(example_inputs), "inference")
            return record
        if kind == "backward":
            for record in reversed(self.records):
                if record.graphs.get("backward") is gm:
                    return record
        record = self.current()
        if record is None or kind in record.compiled:
            # The partitioner was not wrapped (a custom one under torch.compile): start here.
            record = self.start(list(example_inputs), "training" if kind != "inference" else kind)
        return record


def _dynamo_recompile_reason() -> str:
    """The guard failure that made Dynamo compile the current frame again (Dynamo keeps it
    in its metrics for the compile in progress; "" where this torch does not)."""
    try:
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
    except Exception:  # a torch without this (private) record
        return ""
    return str(reason).strip() if reason else ""


def _value(node: fx.Node) -> Any:
    return node.meta.get("val")


def signature_parts(value: Any) -> dict:
    """The parts of one input a compile specializes on."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype), "shape": str(tuple(value.shape)),
                "device": str(value.device), "requires_grad": value.requires_grad}
    return {"value": _describe_value(value)}


def signature_change(old: CompileRecord, new: CompileRecord) -> str:
    """Which part of the input signature changed between two compiles, in words::

        input 0 shape (3,) -> (4,); input 1 requires_grad False -> True
    """
    changes = []
    if old.kind != new.kind:
        changes.append(f"{old.kind} -> {new.kind} graph (grad mode or requires_grad changed)")
    if len(old.signature_parts) != len(new.signature_parts):
        changes.append(f"number of graph inputs {len(old.signature_parts)} -> {len(new.signature_parts)}")
    else:
        for index, (a, b) in enumerate(zip(old.signature_parts, new.signature_parts)):
            for part in b:
                if a.get(part) != b[part]:
                    changes.append(f"input {index} {part} {a.get(part)} -> {b[part]}")
    return "; ".join(changes) or (
        "same tensor signature: a non-tensor argument, the grad mode, autocast, a module's "
        "mode or attributes, or a global or closure value the function reads changed")


# --- torch.compile: records per Dynamo frame ------------------------------------------------

# (file, function name) of the frame Dynamo compiled -> its records (graph breaks and
# recompiles add more). Keyed by name so that resume functions after a graph break count.
_DYNAMO_RECORDS: dict[tuple[str, str], Recorder] = {}
_RECORDS_BY_OBJECT: "weakref.WeakKeyDictionary[Any, Recorder]" = weakref.WeakKeyDictionary()
_RECORDS_BY_MODULE: "weakref.WeakKeyDictionary[torch.nn.Module, Recorder]" = weakref.WeakKeyDictionary()
_RESUME_PREFIX = "torch_dynamo_resume_in_"
# Frames Dynamo enters through on the way to the user's code (its wrappers, Module.__call__).
_HELPER_DIRS = (os.path.join("torch", "_dynamo", ""), os.path.join("torch", "nn", "modules", "module.py"))


def _frame_key(code) -> tuple[str, str]:
    name = code.co_name
    if name.startswith(_RESUME_PREFIX):
        name = name[len(_RESUME_PREFIX):].rsplit("_at_", 1)[0]
    return code.co_filename, name


def _is_helper(code) -> bool:
    return any(part in code.co_filename for part in _HELPER_DIRS)


def root_code(codes: list) -> Any:
    """The user's frame among the codes Dynamo traced for one graph.

    ``codes[0]`` is the frame Dynamo compiled; the functions it inlined follow, each added
    when its inlining finished (innermost first). When the compiled frame is one of Dynamo's
    own wrappers (``torch.compile(module)`` enters through one), the user's frame is the
    outermost inlined function: the last one added, preferring a module's ``forward`` over a
    hook that ran after it."""
    if not _is_helper(codes[0]):
        return codes[0]
    users = [code for code in codes if not _is_helper(code)]
    forwards = [code for code in users if code.co_name == "forward"]
    return (forwards or users or codes)[-1]


def dynamo_recorder() -> Optional[Recorder]:
    """The recorder for the frame Dynamo is compiling now (None outside Dynamo)."""
    try:
        from torch._guards import TracingContext
    except ImportError:
        return None
    context = TracingContext.try_get()
    codes = getattr(context, "traced_code", None) if context is not None else None
    if not codes:
        return None
    root = root_code(list(codes))
    module = _module_being_compiled()
    if module is not None:
        # Records per module instance: two models of one class are inspected apart.
        recorder = _RECORDS_BY_MODULE.get(module)
        if recorder is None:
            recorder = _RECORDS_BY_MODULE[module] = Recorder(type(module).__name__, dynamo=True)
        return recorder
    key = _frame_key(root)
    if key not in _DYNAMO_RECORDS:
        _DYNAMO_RECORDS[key] = Recorder(getattr(root, "co_qualname", key[1]), dynamo=True)
    return _DYNAMO_RECORDS[key]


def _module_being_compiled() -> Optional[torch.nn.Module]:
    """The nn.Module whose forward Dynamo is compiling: the module torch.compile wrapped
    (Dynamo's wrapper frame holds it as ``fn``), or ``self`` of a forward (or of a forward's
    resume function after a graph break); None for a plain function."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        frame_locals = InstructionTranslator.current_tx().f_locals
    except Exception:  # not inside Dynamo, or a torch without this hook
        return None
    for name in ("fn", "self"):
        value = frame_locals.get(name)
        if isinstance(value, torch.nn.Module):
            return value
    return None


def attach(obj: Any, recorder: Recorder) -> None:
    try:
        _RECORDS_BY_OBJECT[obj] = recorder
    except TypeError:  # not weak-referenceable: keep it on the object
        setattr(obj, "_aotforge_recorder", recorder)


def _dynamo_target(obj: Any) -> Optional[tuple[Any, Any]]:
    """(original callable, code object) of a torch.compile'd module or function."""
    original = getattr(obj, "_orig_mod", None) or getattr(obj, "_torchdynamo_orig_callable", None)
    if original is None:
        return None
    if isinstance(original, torch.nn.Module):
        code = getattr(type(original).forward, "__code__", None)
    else:
        code = getattr(getattr(original, "__func__", original), "__code__", None)
    return original, code


def _dynamo_guards(code) -> str:
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return ""
    try:
        entries = _debug_get_cache_entry_list(code)
    except Exception:
        return ""
    texts = [str(getattr(entry, "guard_manager", "")) for entry in entries]
    return "\n".join(text for text in texts if text)


def inspect(compiled: Any) -> Inspection:
    """Every compile aotforge did for ``compiled``: an ``aotforge.aot_function`` /
    ``aot_module`` result, or a ``torch.compile``'d module or function (aotforge backends)."""
    recorder = _RECORDS_BY_OBJECT.get(compiled) if _weakable(compiled) else None
    recorder = recorder or getattr(compiled, "_aotforge_recorder", None)
    if recorder is not None:
        return _inspection(recorder.name, recorder.records)
    target = _dynamo_target(compiled)
    if target is not None:
        original, code = target
        recorder = _RECORDS_BY_MODULE.get(original) if isinstance(original, torch.nn.Module) else None
        if recorder is not None:
            for record in recorder.records:
                record.guards = record.guards or _dynamo_guards(code)
            return _inspection(recorder.name, recorder.records)
        if code is None:
            raise TypeError(f"aotforge.inspect: cannot find the code of {original!r}")
        recorder = _DYNAMO_RECORDS.get(_frame_key(code))
        records = list(recorder.records) if recorder else []
        guards = _dynamo_guards(code)
        for record in records:
            record.guards = record.guards or guards
        name = type(original).__name__ if isinstance(original, torch.nn.Module) else getattr(original, "__name__", "?")
        return _inspection(name, records)
    raise TypeError(
        f"aotforge.inspect: {type(compiled).__name__} was not compiled by aotforge; pass the "
        "result of aotforge.aot_function / aot_module or of torch.compile(..., "
        "backend='aotforge' or 'aotforge_eager')"
    )


def _inspection(name: str, records: list[CompileRecord]) -> Inspection:
    for record in records:
        record.fill_from_scope()
    return Inspection(name, list(records))


def _weakable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


# --- the public aot_function / aot_module, recording ----------------------------------------

def _recording(entry: Callable) -> Callable:
    """``entry`` (aot.aot_function or aot.aot_module) with its compilers and partitioner
    wrapped by a Recorder attached to the result. Both take aot_function's arguments after
    the function or module."""
    signature = _pyinspect.signature(_aot.aot_function)

    @functools.wraps(entry)
    def recording_entry(first, *args, **kwargs):
        try:
            arguments = signature.bind_partial(first, *args, **kwargs).arguments
        except TypeError:
            return entry(first, *args, **kwargs)  # let the AOT layer report the bad call
        forward = arguments.get("fw_compiler")
        if not callable(forward):
            return entry(first, *args, **kwargs)
        del arguments["fn"]
        recorder = Recorder(_name_of(first))
        arguments["fw_compiler"] = recorder.wrap_compiler(forward, "forward")
        # what is not callable stays as given, for the AOT layer's clear error at creation
        backward, inference = arguments.get("bw_compiler") or forward, arguments.get("inference_compiler") or forward
        partition = arguments.get("partition_fn") or default_partition
        if callable(backward):
            arguments["bw_compiler"] = recorder.wrap_compiler(backward, "backward")
        if callable(inference):
            arguments["inference_compiler"] = recorder.wrap_compiler(inference, "inference")
        if callable(partition):
            arguments["partition_fn"] = recorder.wrap_partition(partition)
        result = entry(first, **arguments)
        attach(result, recorder)
        return result

    return recording_entry


def _name_of(obj: Any) -> str:
    if isinstance(obj, torch.nn.Module):
        return type(obj).__name__
    return getattr(obj, "__name__", type(obj).__name__)


# The public entry points record every compile for aotforge.inspect (aotforge.aot's own do not).
aot_function = _recording(_aot.aot_function)
aot_module = _recording(_aot.aot_module)

# the graph whose compiler runs now, in this thread: ([graph kind], model name, n-th graph of
# that model), for torch's compatibility names (``compat.get_aot_graph_name``)
_compiling = threading.local()


def graph_being_compiled() -> Optional[tuple]:
    return getattr(_compiling, "value", None)
