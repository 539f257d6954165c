"""aotforge.inspect: per compiled graph and per recompile, for aot_function, aot_module and
torch.compile'd modules and functions; every part prints readably."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels of the Triton path run on the CPU

import pytest
import torch

import aotforge
from aotforge.compiler import compile_fx_inner
from aotforge.config import config


def f(x, w):
    y = torch.nn.functional.gelu(x @ w)
    return y.sum(-1)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x)).sum(-1)


def _inputs(dtype=torch.float64, rows=4):
    torch.manual_seed(0)
    return (torch.randn(rows, 8, dtype=dtype, requires_grad=True),
            torch.randn(8, 8, dtype=dtype, requires_grad=True))


def _check_training_record(record, *, kernels: bool):
    assert set(record.graphs) >= {"joint", "forward", "backward"}
    assert record.partition is not None and record.partition.saved
    text = str(record)
    for part in ("signature:", "--- joint graph ---", "--- forward graph ---",
                 "--- backward graph ---", "--- partition ---", "saved for backward",
                 "compile time:"):
        assert part in text, f"{part!r} missing from:\n{text}"
    if kernels:
        for part in ("forward lowered", "forward kernel_plan", "forward memory_plan",
                     "forward wrapper_source", "def call(args)", "@triton.jit"):
            assert part in text or part.replace("@triton.jit", "tl.program_id") in text, part
        assert "launch=" in text  # each kernel with its launch configuration
        forward = record.compiled["forward"]
        assert forward.compiled_graph is not None and forward.kernels()


def test_aot_function_per_compile_and_recompile():
    with config.patch(triton_on_cpu=True):
        compiled = aotforge.aot_function(f, compile_fx_inner)
        x, w = _inputs(torch.float32)
        out = compiled(x, w)
        torch.testing.assert_close(out, f(x, w))
        out.sum().backward()
        compiled(*_inputs(torch.float32, rows=6)).sum().backward()
    report = aotforge.inspect(compiled)
    assert [r.number for r in report.records] == [0, 1]
    _check_training_record(report.records[0], kernels=True)
    assert report.records[1].recompile_reason == "input 0 shape (4, 8) -> (6, 8)"
    text = str(report)
    assert "compile 1 (recompile: input 0 shape (4, 8) -> (6, 8))" in text
    assert "input 0: torch.float32 (4, 8) on cpu, requires_grad" in text


def test_aot_function_not_called_yet_says_so():
    compiled = aotforge.aot_function(f, aotforge.nop)
    assert "not compiled yet" in str(aotforge.inspect(compiled))


def test_aot_module_inference_and_training():
    model = Block().double()
    compiled = aotforge.aot_module(model, aotforge.nop)
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    compiled(x).sum().backward()
    report = aotforge.inspect(compiled)
    assert report.target == "Block"
    inference, training = report.records
    assert set(inference.graphs) == {"inference"} and inference.partition is None
    assert "--- inference graph ---" in str(inference)
    assert training.recompile_reason.startswith("inference -> training graph")
    _check_training_record(training, kernels=False)
    # nop keeps the FX graph: the record says no kernels were generated
    assert "runs as the FX graph's ATen calls" in str(training)


def test_torch_compiled_module_with_source_lines_and_guards():
    torch._dynamo.reset()
    model = Block()
    compiled = torch.compile(model, backend="aotforge")
    x = torch.randn(4, 8)
    with config.patch(triton_on_cpu=True):
        out = compiled(x)
        torch.testing.assert_close(out, model(x))
        out.sum().backward()
    report = aotforge.inspect(compiled)
    assert report.target == "Block" and len(report.records) == 1
    record = report.records[0]
    _check_training_record(record, kernels=True)
    text = str(record)
    assert "source lines ---" in text and "test_inspect.py" in text and "torch.tanh" in text
    assert "guards:" in text and record.guards


def test_torch_compiled_function_graph_break_records_each_graph():
    torch._dynamo.reset()

    def g(x):
        y = x.sin() * 2
        torch._dynamo.graph_break()
        return y.cos().sum()

    compiled = torch.compile(g, backend="aotforge_eager")
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(compiled(x), g(x))
    report = aotforge.inspect(compiled)
    assert report.target == "g"
    assert len(report.records) == 2  # one per Dynamo graph
    assert "Dynamo graph" in report.records[1].recompile_reason
    for record in report.records:
        assert "forward" in record.graphs and "backward" in record.graphs
        assert "sin" in str(record) or "cos" in str(record)


def test_things_aotforge_did_not_compile_are_rejected():
    with pytest.raises(TypeError, match="was not compiled by aotforge"):
        aotforge.inspect(f)


def test_two_models_of_one_class_are_inspected_apart():
    torch._dynamo.reset()
    first, second = Block().double(), torch.nn.Sequential(Block()).double()
    third = torch.nn.Sequential(torch.nn.Linear(8, 8)).double()
    compiled = [torch.compile(m, backend="aotforge_eager") for m in (first, second, third)]
    x = torch.randn(2, 8, dtype=torch.float64)
    for c, m in zip(compiled, (first, second, third)):
        torch.testing.assert_close(c(x), m(x))
    reports = [aotforge.inspect(c) for c in compiled]
    assert [len(r.records) for r in reports] == [1, 1, 1]
    assert [r.target for r in reports] == ["Block", "Sequential", "Sequential"]
    assert "tanh" not in str(reports[2]) and "tanh" in str(reports[1])


@pytest.mark.parametrize("entry", ["torch.compile", "aot_module"])
def test_a_model_of_torch_layers_only_has_source_lines(entry):
    """nn.Sequential of torch's own layers has no line of the user's inside it (and Dynamo
    drops torch's frames): each node still names the layer it comes from and the user's line
    that called the model, in the forward and the backward graphs."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU())
    if entry == "torch.compile":
        compiled = torch.compile(model, backend="aotforge_eager")
    else:
        compiled = aotforge.aot_module(model, aotforge.nop)
    x = torch.randn(3, 8)
    out = compiled(x)  # the line the graphs name as the caller
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    record = aotforge.inspect(compiled).records[0]
    for kind in ("forward", "backward"):
        graph = record.graphs[kind]
        assert "No stacktrace found" not in graph.print_readable(print_output=False), kind
        traces = {n.name: n.meta.get("stack_trace") or "" for n in graph.graph.nodes if n.op == "call_function"}
        assert traces and all("out = compiled(x)" in t for t in traces.values()), traces
        assert any("linear.py" in t for t in traces.values()) and any("activation.py" in t for t in traces.values())
    lines = "\n".join(aotforge.inspection.source_lines(record.graphs["forward"]))
    assert "linear.py" in lines and "activation.py" in lines, lines
