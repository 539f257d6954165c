"""``python -m aotforge explain``: export a model and print its graphs and signature.

    python -m aotforge explain --model tests/explain_example.py:TinyClassifier \\
        --input 8x16 --input 8:int64:4 --joint --loss-index 0

loads ``TinyClassifier`` from the file, builds random inputs of those shapes, exports it with
``aot_export_module`` and prints:

* the signature: what each graph input and output is (parameter, buffer, user input,
  buffer update, user output, the loss, gradient of which parameter);
* without ``--joint``: the inference graph;
* with ``--joint``: the joint graph, then the forward and backward graphs the default
  partition splits it into, and what the forward saves for the backward.

Models whose constructor takes arguments get them as JSON::

    python -m aotforge explain --model aotforge/bench/workloads/models.py:NanoGPT \\
        --init '{"vocab": 64, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16}' \\
        --input 2x8:int64:64 --input 2x8:int64:64 --joint --loss-index 0
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
from typing import Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from .aot.export import ExportError, GraphSignature, aot_export_module
from .partition import default_partition

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


class UsageError(Exception):
    """A command-line argument is wrong; the message says which and how to fix it."""


def parse_input(spec: str, default_dtype: torch.dtype) -> torch.Tensor:
    """``8x16`` -> randn(8, 16); ``8:int64:100`` -> randint(0, 100, (8,)); ``scalar`` -> randn(()).

    Format: ``SHAPE[:DTYPE[:HIGH]]`` where SHAPE is sizes joined by ``x`` (or ``scalar``),
    DTYPE one of the DTYPES names, HIGH the exclusive upper bound of random integers
    (default 2)."""
    parts = spec.split(":")
    if len(parts) > 3 or not parts[0]:
        raise UsageError(
            f"--input {spec!r}: expected SHAPE[:DTYPE[:HIGH]], e.g. 8x16 or 8:int64:100"
        )
    shape_text, dtype_text, high_text = (parts + [None, None])[:3]
    try:
        shape = () if shape_text == "scalar" else tuple(int(size) for size in shape_text.split("x"))
    except ValueError:
        raise UsageError(
            f"--input {spec!r}: the shape {shape_text!r} is not sizes joined by 'x' "
            "(e.g. 8x16) or 'scalar'"
        ) from None
    if any(size < 0 for size in shape):
        raise UsageError(f"--input {spec!r}: sizes must not be negative")
    if dtype_text is not None and dtype_text not in DTYPES:
        raise UsageError(
            f"--input {spec!r}: unknown dtype {dtype_text!r}; choose one of {', '.join(DTYPES)}"
        )
    dtype = DTYPES[dtype_text] if dtype_text is not None else default_dtype
    if dtype.is_floating_point:
        if high_text is not None:
            raise UsageError(f"--input {spec!r}: HIGH applies to integer inputs only")
        return torch.randn(shape, dtype=dtype)
    if dtype is torch.bool:
        return torch.rand(shape) < 0.5
    try:
        high = 2 if high_text is None else int(high_text)
    except ValueError:
        raise UsageError(f"--input {spec!r}: HIGH {high_text!r} is not an integer") from None
    return torch.randint(0, high, shape, dtype=dtype)


def load_model(spec: str, init_kwargs: Optional[dict] = None) -> nn.Module:
    """``path/to/file.py:Name``: ``Name`` is an nn.Module class or a function returning a
    module; it is called with ``init_kwargs`` (none by default)."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise UsageError(f"--model {spec!r}: expected path/to/file.py:ClassName")
    if not os.path.isfile(path):
        raise UsageError(f"--model {spec!r}: no such file {path!r}")
    safe_path = "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))
    module_name = "_aotforge_explain_" + safe_path
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UsageError(f"--model {spec!r}: {path!r} is not a Python file")
    source = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = source  # dataclasses and pickling look modules up by name
    # The file may import its neighbours (``from layers import Block``), as when run as a script.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        loader_spec.loader.exec_module(source)
    finally:
        sys.path.pop(0)
    if not hasattr(source, name):
        available = sorted(
            n for n, v in vars(source).items()
            if isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == module_name
        )
        raise UsageError(
            f"--model {spec!r}: {path!r} defines no {name!r}; modules defined there: "
            f"{', '.join(available) or 'none'}"
        )
    factory = getattr(source, name)
    if isinstance(factory, nn.Module):
        return factory
    try:
        model = factory(**(init_kwargs or {}))
    except TypeError as error:
        raise UsageError(
            f"--model {spec!r}: calling {name}(**{init_kwargs or {}}) failed: {error}. "
            "Pass its constructor arguments with --init '{\"name\": value, ...}'."
        ) from None
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"--model {spec!r}: {name}() returned a {type(model).__name__}, not an nn.Module"
        )
    return model


def _graph_text(gm: fx.GraphModule, title: str) -> str:
    """The graph's code with shapes and dtypes (``t: "f32[16, 8]" = aten.t(arg0_1)``),
    without print_readable's class wrapper and empty stack-trace comments."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    lines = [
        line[4:] if line.startswith("    ") else line
        for line in code.strip().splitlines()[1:]  # the first line is the class statement
        if line.strip() != "# No stacktrace found for following nodes"
    ]
    return f"==== {title} ====\n" + "\n".join(lines) + "\n"


def explain_text(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    *,
    joint: bool,
    loss_index: Optional[int],
    dynamic: bool = False,
) -> str:
    """Export ``model`` on ``inputs`` and render the signature and graphs as text."""
    gm, signature = aot_export_module(
        model, tuple(inputs), trace_joint=joint, output_loss_index=loss_index,
        dynamic_shapes=dynamic,
    )
    shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs)
    mode = "training" if model.training else "eval"
    sections = [
        f"model: {type(model).__name__} ({mode} mode), inputs: {shapes}\n",
        f"==== signature ====\n{signature.describe()}\n",
    ]
    if not joint:
        sections.append(_graph_text(gm, "forward graph (inference)"))
        return "\n".join(sections)
    sections.append(_graph_text(gm, "joint graph (forward + backward of the loss)"))
    forward, backward = _partition(gm, signature)
    num_forward_outputs = _num_forward_outputs(signature)
    (forward_output,) = forward.graph.find_nodes(op="output")
    saved = forward_output.args[0][num_forward_outputs:]
    names = ", ".join(getattr(n, "name", repr(n)) for n in saved) or "nothing"
    sections.append(
        _graph_text(forward, "forward graph (default partition)")
        + f"saved for the backward ({_saved_size(saved)}): {names}\n"
    )
    sections.append(_graph_text(backward, "backward graph (default partition)"))
    return "\n".join(sections)


def _saved_size(saved: Sequence) -> str:
    """``13 values, 1.9 KiB`` (tensor bytes from each node's fake value)."""
    total, symbolic = 0, False
    for node in saved:
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(value, torch.Tensor):
            numel = value.numel()
            if isinstance(numel, torch.SymInt):  # dynamic shapes: count the example's size
                numel, symbolic = int(numel.node.hint or 0), True
            total += numel * value.element_size()
    if total < 1024:
        size = f"{total} B"
    elif total < 2**20:
        size = f"{total / 1024:.1f} KiB"
    else:
        size = f"{total / 2**20:.1f} MiB"
    return f"{len(saved)} values, {size}" + (" at the example sizes" if symbolic else "")


def _num_forward_outputs(signature: GraphSignature) -> int:
    return (
        len(signature.buffers_to_mutate)
        + len(signature.parameters_to_mutate)
        + len(signature.user_inputs_to_mutate)
        + len(signature.user_outputs)
    )


def _partition(
    gm: fx.GraphModule, signature: GraphSignature
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split the export joint into forward and backward. It has no tangent inputs (the loss
    gradient is a constant one), so the backward takes only what the forward saves.

    The partitioner finds primal inputs by their ``primals_N`` targets; the export names its
    inputs ``argN_1`` as PyTorch does, so a copy marks them as primals (keeping their names,
    which the forward graph's inputs then carry)."""
    marked = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for index, node in enumerate(marked.graph.find_nodes(op="placeholder")):
        node.target = f"primals_{index + 1}"
    return default_partition(marked, None, num_fwd_outputs=_num_forward_outputs(signature))


def _init_kwargs(text: Optional[str]) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"--init {text!r} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise UsageError(f"--init {text!r} must be a JSON object of keyword arguments")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aotforge explain",
        description="Export a model with aot_export_module and print its graphs and signature.",
    )
    parser.add_argument(
        "--model", required=True,
        help="path/to/file.py:ClassName (or a function returning a module)",
    )
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE[:DTYPE[:HIGH]]",
        help="one positional input, e.g. 8x16, scalar, or 8:int64:100 (random ints below "
        "100); repeat per input",
    )
    parser.add_argument(
        "--dtype", default="float32",
        choices=[n for n, d in DTYPES.items() if d.is_floating_point],
        help="dtype of the model and of float inputs (default float32)",
    )
    parser.add_argument(
        "--joint", action="store_true", help="export the joint forward+backward graph of a loss"
    )
    parser.add_argument(
        "--loss-index", type=int, default=None, help="with --joint: which output is the scalar loss"
    )
    parser.add_argument(
        "--init", default=None, metavar="JSON",
        help='keyword arguments for the model\'s constructor, e.g. \'{"vocab": 64, "n_layer": 2}\'',
    )
    parser.add_argument("--eval", action="store_true", help="put the model in eval mode first")
    parser.add_argument(
        "--dynamic", action="store_true",
        help="symbolic input sizes (the graph checks the size conditions it relies on)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed for the model and inputs")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    options = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if options.joint and options.loss_index is None:
        parser.error(
            "--joint needs --loss-index N, the index of the model's output that is the scalar loss"
        )
    if options.loss_index is not None and not options.joint:
        parser.error("--loss-index applies only with --joint")
    dtype = DTYPES[options.dtype]
    try:
        torch.manual_seed(options.seed)
        model = load_model(options.model, _init_kwargs(options.init)).to(dtype)
        if options.eval:
            model.eval()
        inputs = [parse_input(spec, dtype) for spec in options.input]
        text = explain_text(
            model, inputs, joint=options.joint, loss_index=options.loss_index,
            dynamic=options.dynamic,
        )
    except UsageError as error:
        parser.error(str(error))
    except ExportError as error:
        print(f"aotforge explain: the model cannot be exported: {error}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
