"""Symbolic sizes through the whole compiler: one compiled graph per direction serves every
batch size and sequence length, with generated kernels (not the ATen fallback), equal to
eager in float64 on the CPU (Triton's interpreter)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler.pipeline import observe

from .models import TinyGPT, TransformerBlock, train_step

OPTIONS = {"triton_on_cpu": True}


def _frames() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_transformer_three_lengths_two_batches_one_graph_per_direction():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = TinyGPT().double()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aotforge", dynamic=True, options=OPTIONS)
    frames = _frames()
    seen = []
    for batch in (2, 3):
        for length in (8, 12, 16):
            idx = torch.randint(0, 50, (batch, length))
            targets = torch.randint(0, 50, (batch, length))
            with observe() as graphs:
                loss, grads = train_step(compiled, idx, targets)
            expected_loss, expected_grads = train_step(eager, idx, targets)
            torch.testing.assert_close(loss, expected_loss)
            for got, want in zip(grads, expected_grads):
                torch.testing.assert_close(got, want)
            seen += graphs
    assert _frames() - frames == 1, "one Dynamo graph for every size"
    assert sorted(g.kind for g in seen) == ["backward", "forward"], "one compiled graph per direction"
    for graph in seen:
        assert graph.path == "triton" and graph.lowered.sizes.dynamic
        stats = graph.stats
        assert stats["kernels"] >= 5 and not stats["lowering_errors"]
        # the elementwise work is generated code, not ATen calls
        assert not set(stats["fallbacks"]) & {"aten.add.Tensor", "aten.mul.Tensor", "aten.sum.dim_IntList",
                                              "aten.native_layer_norm.default", "aten.amax.default"}
        assert "ks0" in graph.kernel_source and "s" in graph.wrapper_source


def test_symbolic_sizes_add_no_guard():
    """Compiling reads sizes through their expressions: Dynamo's ShapeEnv gets no new guard
    (a guard would make the next size recompile)."""
    from torch._guards import TracingContext

    counts = []

    import aotforge.compiler as compiler

    original = compiler.compile_fx_inner

    def counting(gm, example_inputs, **kwargs):
        shape_env = TracingContext.get().fake_mode.shape_env
        before = len(shape_env.guards)
        compiled = original(gm, example_inputs, **kwargs)
        counts.append(len(shape_env.guards) - before)
        return compiled

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerBlock().double()
    compiler.compile_fx_inner = counting
    try:
        compiled = torch.compile(model, backend="aotforge", dynamic=True, options=OPTIONS)
        compiled(torch.randn(2, 8, 32, dtype=torch.double, requires_grad=True)).sum().backward()
    finally:
        compiler.compile_fx_inner = original
    assert counts and counts == [0] * len(counts)


@pytest.mark.parametrize("length", [5, 17])
def test_sizes_not_multiple_of_block(length):
    """Odd sizes: masks cover the ragged last block of every kernel."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerBlock().double()
    compiled = torch.compile(model, backend="aotforge", dynamic=True, options=OPTIONS)
    for size in (length, length + 6):
        x = torch.randn(2, size, 32, dtype=torch.double)
        torch.testing.assert_close(compiled(x), model(x))


def test_linear_view_repro():
    """Issue 14's repro: a 24x32 input with backward, then a 32x32 one."""
    torch._dynamo.reset()
    lin = nn.Linear(32, 32).double()
    f = torch.compile(lambda x: lin(x).view(-1), backend="aotforge", dynamic=True, options=OPTIONS)
    for rows in (24, 32):
        x = torch.randn(rows, 32, dtype=torch.double, requires_grad=True)
        reference = x.detach().clone().requires_grad_()
        out = f(x)
        out.sum().backward()
        expected = lin(reference).view(-1)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.grad, reference.grad)


@pytest.mark.parametrize("reduction", ["sum", "amax"])
def test_long_symbolic_column_reduction_is_split(reduction):
    """A bias gradient's column sum over a symbolic number of rows is cut into pieces (the
    last one masked) and still equals eager for row counts the pieces do not divide."""
    torch._dynamo.reset()
    f = torch.compile(lambda x: getattr(x, reduction)(0), backend="aotforge", dynamic=True, options=OPTIONS)
    for rows in (5000, 7001):
        x = torch.randn(rows, 16, dtype=torch.double)
        with observe() as graphs:
            torch.testing.assert_close(f(x), getattr(x, reduction)(0))
        if graphs:
            plan = str(graphs[0].kernel_plan)
            assert plan.count("reduction") == 2, plan  # the partials, then their combination


def test_sizes_past_32_bit_indexing_run_the_aten_graph(monkeypatch):
    """Kernels index in 32 bits when the example sizes allow it; the wrapper checks each
    call's sizes and runs the graph's ATen calls when they would overflow (the limit is
    lowered here so that a small tensor crosses it)."""
    from aotforge.compiler.codegen import wrapper

    monkeypatch.setattr(wrapper, "INT32_MAX", 2000)
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.sigmoid(x) * 3, backend="aotforge", dynamic=True, options=OPTIONS)
    small = torch.randn(40, 16, dtype=torch.double)
    with observe() as graphs:
        torch.testing.assert_close(f(small), torch.sigmoid(small) * 3)
    (graph,) = graphs
    assert "run_aten_graph" in graph.wrapper_source
    kernel = next(iter(graph.launchers.values()))
    assert kernel.best is not None  # the small call ran the kernel
    kernel.best = None  # forget it: a kernel launch would choose a configuration again
    large = torch.randn(200, 16, dtype=torch.double)
    torch.testing.assert_close(f(large), torch.sigmoid(large) * 3)
    assert kernel.best is None, "the large call must not launch the 32-bit kernel"


def test_data_dependent_sizes_run_as_aten_calls():
    """A size that depends on data (nonzero's) cannot be read from the inputs: that graph runs
    as ATen calls, still equal to eager."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from aotforge.compiler import compile_fx_inner
    from aotforge.config import config

    x = torch.randn(30, 4, dtype=torch.double)
    gm = make_fx(lambda x: (torch.nonzero(x > 0) * 2,), tracing_mode="symbolic")(x)
    with config.patch(triton_on_cpu=True):
        compiled = compile_fx_inner(gm, [x])
    assert compiled.compiled_graph.path == "aten"
    torch.testing.assert_close(compiled([x])[0], torch.nonzero(x > 0) * 2)


def test_arange_with_symbolic_bounds():
    """``arange`` whose start depends on a symbolic size (T5's relative positions, cache
    positions) counts from that start, for every size."""
    def f(x):
        n = x.shape[0]
        return (torch.arange(n) + torch.arange(3, n + 3) * 2 + torch.arange(n - 1, -1, -1)).double() + x

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aotforge", dynamic=True, options=OPTIONS)
    for n in (5, 9):
        x = torch.randn(n, dtype=torch.double)
        torch.testing.assert_close(compiled(x), f(x))


def test_slice_from_the_end_by_a_symbolic_length():
    """``bias[:, -n:]`` with a symbolic n (T5's position bias): the start counts from the end."""
    def f(bias, x):
        return bias[:, -x.shape[1]:] + x

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aotforge", dynamic=True, options=OPTIONS)
    for n in (5, 9):
        bias, x = torch.randn(3, 12, dtype=torch.double), torch.randn(3, n, dtype=torch.double)
        torch.testing.assert_close(compiled(bias, x), f(bias, x))


def test_a_compile_failure_with_symbolic_sizes_falls_back_to_aten(monkeypatch, caplog):
    """A bug met only with symbolic sizes costs the graph its kernels, not the user's compile
    (a warning says so); the result still equals eager."""
    from aotforge.compiler import pipeline

    def broken(*args, **kwargs):
        raise NotImplementedError("simulated codegen bug")

    monkeypatch.setattr(pipeline, "emit_wrapper", broken)
    torch._dynamo.reset()
    # outside strict mode (the tests' default raises, so that no bug hides behind the fallback)
    f = torch.compile(lambda x: torch.tanh(x) + 1, backend="aotforge", dynamic=True,
                      options={**OPTIONS, "strict": False})
    x = torch.randn(7, 3, dtype=torch.double)
    with observe() as graphs, caplog.at_level("WARNING", logger="aotforge"):
        torch.testing.assert_close(f(x), torch.tanh(x) + 1)
    assert [g.path for g in graphs] == ["aten"]
    assert "simulated codegen bug" in caplog.text
