"""Keep the user's source location on every traced node (``node.meta["stack_trace"]``), so
that printed graphs show ``# File: model.py:12 in forward, code: ...`` above forward AND
backward nodes, as PyTorch's own graphs do.

* Forward nodes: while tracing, each torch call made by the user's code records the user's
  frames (those between aotforge's tracing entry and torch) as the current node meta, which
  FX copies onto every node the call creates. Under Dynamo the nodes already carry Dynamo's
  stack traces (``backends._source_lines_kept``); those are kept.
* torch's own layers: a model made of them (``nn.Sequential(nn.Linear(...), nn.GELU())``) has
  no frame of the user's inside it, and Dynamo leaves such nodes without a stack trace (it
  drops torch/nn/modules frames). Those nodes get the user's line that called the model and
  the layer's ``forward`` (traced: the line that ran; under Dynamo: the module's path from
  ``nn_module_stack`` and where its forward is defined).
* Backward nodes: autograd runs them from its engine, with no user frame on the stack. Hooks
  on the autograd nodes (``tag_backward_nodes``) make each backward node record the sequence
  number of the forward op it differentiates (``seq_nr``, which forward nodes record too); a
  backward node without a stack trace then takes the one of the forward node with its number::

      mul = aten.mul(x, 2)       # File: model.py:3, code: y = x * 2   (seq_nr 7)
      mul_1 = aten.mul(tangents_1, 2)  -> gets the same "# File: model.py:3" (seq_nr 7)
"""
from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
import sysconfig
import traceback
from typing import Iterator, Optional

import torch
import torch.fx as fx
from torch.fx import traceback as fx_traceback
from torch.overrides import TorchFunctionMode

# The AOT layer calls the user's function; frames from here outward are not the model's.
_AOT_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_DIR = sysconfig.get_paths().get("stdlib", "\0")
_PACKAGE_DIR = os.path.dirname(_AOT_DIR)
# torch's built-in layers and containers (nn.Linear, nn.Sequential): their forward is the
# source of a model built only from them
_LAYERS_DIR = os.path.join(_TORCH_DIR, "nn", "modules")


def _is_users(filename: str) -> bool:
    return not filename.startswith((_TORCH_DIR, _PACKAGE_DIR, _STDLIB_DIR, "<frozen"))


def _callers_line(frame) -> Optional[tuple]:
    """(frame, line) of the first frame of the user's code from ``frame`` outward: the line
    that called the model; None when there is none (a script run by torch's tools)."""
    while frame is not None and not _is_users(frame.f_code.co_filename):
        frame = frame.f_back
    return (frame, frame.f_lineno) if frame is not None else None


def _user_stack() -> Optional[str]:
    """The frames of the user's code below aotforge's tracing entry, formatted like a
    traceback; None when there are none (autograd's engine, or not inside a trace). A model
    of torch's own layers only has no such frame: then the user's line that called it and
    the layers' forward frames."""
    frame = sys._getframe(2)
    user_frames, layer_frames = [], []
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_AOT_DIR):
            break  # aotforge called the user's function from here: outer frames are not the model
        if filename.startswith(_LAYERS_DIR):
            layer_frames.append((frame, frame.f_lineno))
        elif _is_users(filename):
            user_frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    if frame is None:
        return None
    if not user_frames and layer_frames:
        caller = _callers_line(frame)
        user_frames = layer_frames + ([caller] if caller is not None else [])
    if not user_frames:
        return None
    summary = traceback.StackSummary.extract(reversed(user_frames))
    return "".join(summary.format()).rstrip()


def _layer_stack_trace(node: fx.Node, caller: Optional[tuple]) -> Optional[str]:
    """For a node of Dynamo's graph without a stack trace that torch's layers made: the
    user's line that called the model, then the forward of each module around the node
    (``nn_module_stack``; Dynamo keeps no line inside them), formatted like a traceback."""
    modules = node.meta.get("nn_module_stack") or {}
    lines = []
    if caller is not None:
        frame, line = caller
        code = linecache.getline(frame.f_code.co_filename, line).strip()
        lines += [f'  File "{frame.f_code.co_filename}", line {line}, in {frame.f_code.co_name}', f"    {code}"]
    for entry in modules.values():
        path, cls = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, None)
        forward = getattr(getattr(cls, "forward", None), "__code__", None)
        if forward is None:  # not a (path, module class) pair, or a forward without code
            continue
        # Dynamo's names: L['fn'].0 is the compiled model's child 0, L['self'].net its .net
        name = re.sub(r"^L\['fn'\]", "model", str(path))
        name = re.sub(r"L\['([^']*)'\]", r"\1", name)
        lines += [f'  File "{forward.co_filename}", line {forward.co_firstlineno}, in forward',
                  f"    {name}: {cls.__module__}.{cls.__qualname__}.forward"]
    return "\n".join(lines) if modules and lines else None


def _dynamo_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_dynamo_compiling", None) or getattr(compiler, "is_compiling", None)
    return bool(is_compiling and is_compiling())


class _RecordUserSource(TorchFunctionMode):
    """Set the current node meta's stack trace to the user's frames for each torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _dynamo_compiling():
            # torch.cond and other higher-order ops have Dynamo trace their branches while
            # this mode is active; Dynamo records its own source lines and cannot trace
            # frame inspection, so the mode steps aside (the branch folds away for Dynamo).
            return func(*args, **kwargs)
        meta = fx_traceback.get_current_meta()
        if meta.get("stack_trace"):  # Dynamo's (or an outer call's) source: keep it
            return func(*args, **kwargs)
        stack = _user_stack()
        if stack is None:
            return func(*args, **kwargs)
        meta["stack_trace"] = stack
        try:
            return func(*args, **kwargs)
        finally:
            meta.pop("stack_trace", None)


@contextlib.contextmanager
def recording_source_lines() -> Iterator[None]:
    """Trace under this: nodes get the user's stack traces and autograd sequence numbers."""
    with fx_traceback.preserve_node_meta(), _RecordUserSource():
        yield


def grad(outputs: list, inputs: list, grad_outputs: list) -> tuple:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)`` for a trace:
    backward nodes record what they differentiate (``tag_backward_nodes``), and the engine is
    called directly, because a torch function mode is off while it handles a call, and
    ``torch.autograd.grad`` would switch the recording off for the whole backward (where a
    custom autograd.Function's Python backward runs the user's code)."""
    tag_backward_nodes(outputs)
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not fx_traceback.has_preserved_node_meta():
        return torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
    return engine.run_backward(
        tuple(outputs), tuple(grad_outputs), False, False, tuple(inputs), True, accumulate_grad=False
    )


def tag_backward_nodes(outputs) -> None:
    """Before ``torch.autograd.grad(outputs, ...)`` runs in a trace: while each autograd node
    runs, nodes traced get its sequence number as their ``seq_nr``."""
    set_seq_nr = getattr(fx_traceback, "set_grad_fn_seq_nr", None)
    reset_seq_nr = getattr(fx_traceback, "reset_grad_fn_seq_nr", None)
    if set_seq_nr is None or reset_seq_nr is None or not fx_traceback.has_preserved_node_meta():
        return
    pending = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    seen = set(pending)
    while pending:
        node = pending.pop()
        seq_nr = node._sequence_nr()
        node.register_prehook(lambda grad_outputs, seq_nr=seq_nr: set_seq_nr(seq_nr))
        node.register_hook(lambda grad_inputs, grad_outputs: reset_seq_nr())
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                pending.append(next_node)


def copy_forward_source_to_backward(gm: fx.GraphModule) -> None:
    """Give each node without a stack trace the one of the first node with its ``seq_nr``."""
    source_by_seq_nr: dict[int, str] = {}
    for node in gm.graph.nodes:
        seq_nr = node.meta.get("seq_nr")
        stack_trace = node.meta.get("stack_trace")
        if seq_nr is None or node.op != "call_function":
            continue
        if stack_trace:
            source_by_seq_nr.setdefault(seq_nr, stack_trace)
        elif seq_nr in source_by_seq_nr:
            node.meta["stack_trace"] = source_by_seq_nr[seq_nr]


@contextlib.contextmanager
def interpreted_node_by_node(gm) -> Iterator[None]:
    """While the AOT layer traces ``gm`` (Dynamo's graph, whose nodes carry the user's stack
    traces), run it node by node with FX's node-meta preservation on, so that every ATen node
    it produces keeps the user's stack trace: the graphs handed to the fw/bw compilers,
    aotforge.inspect and the verify report then show the user's source lines."""
    if not isinstance(gm, fx.GraphModule) or "forward" in gm.__dict__:
        yield
        return
    caller = _callers_line(sys._getframe(0))  # Dynamo compiles within the user's call
    filled = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and not node.meta.get("stack_trace"):
            stack_trace = _layer_stack_trace(node, caller)
            if stack_trace:
                filled[node] = node.meta.get("stack_trace")
                node.meta["stack_trace"] = stack_trace
    gm.forward = lambda *args: fx.Interpreter(gm).run(*args)
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        del gm.forward
        for node, previous in filled.items():  # Dynamo's graph as Dynamo made it
            node.meta["stack_trace"] = previous


@contextlib.contextmanager
def mutation_source_lines(functional_mode, tensors: dict) -> Iterator[dict]:
    """While tracing under ``functional_mode``: the stack trace of the last in-place op on each
    of ``tensors`` (key -> FunctionalTensor), or on a view of it, as ``{key: stack_trace}``.

    A mutation an inference graph keeps becomes one ``copy_`` into the input, emitted after
    the function returned, where no user line is current; it takes the line of the op that
    made the change (``x_view.mul_(2)``), as PyTorch's graphs show it."""
    from .functional import storage_ref

    storages = {storage_ref(t): key for key, t in tensors.items()}
    found: dict = {}
    if not storages or not fx_traceback.has_preserved_node_meta():
        yield found
        return
    handle = functional_mode.__torch_dispatch__

    def dispatch(mode, func, types, args=(), kwargs=None):
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            key = storages.get(storage_ref(args[0]))
            stack_trace = fx_traceback.get_current_meta().get("stack_trace")
            if key is not None and stack_trace:
                found[key] = stack_trace
        return handle(func, types, args, kwargs)

    # an attribute of the mode object, not a mode of its own (see metadata._StorageChanges)
    functional_mode.__torch_dispatch__ = dispatch.__get__(functional_mode)
    try:
        yield found
    finally:
        del functional_mode.__torch_dispatch__


@contextlib.contextmanager
def stack_trace_of_next_nodes(stack_trace: Optional[str]) -> Iterator[None]:
    """Nodes traced inside get ``stack_trace`` (when one is given and node meta is kept)."""
    if not stack_trace or not fx_traceback.has_preserved_node_meta():
        yield
        return
    meta = fx_traceback.get_current_meta()
    previous = meta.get("stack_trace")
    meta["stack_trace"] = stack_trace
    try:
        yield
    finally:
        if previous is None:
            meta.pop("stack_trace", None)
        else:
            meta["stack_trace"] = previous
