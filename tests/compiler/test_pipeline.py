"""compile_fx_inner as a whole: write-backs into inputs, lowerings that decline, identical
kernels shared across layers and graphs, and observe()."""
from __future__ import annotations

import functools

import pytest
import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler import compile_fx_inner, observe
from aotforge.compiler.lowering import registry
from aotforge.compiler.lowering.registry import LOWERINGS, NotLowerable
from aotforge.config import config

from .helpers import trace

aten = torch.ops.aten


@pytest.mark.parametrize("case", ["diagonal_zero", "row_fill", "diagonal_then_read", "slice_add"])
@pytest.mark.parametrize("training", [False, True])
def test_write_back_into_a_view_of_an_input(case, training):
    def fn(x, y):
        if case == "diagonal_zero":
            x.diagonal().zero_()
            return y * 2
        if case == "row_fill":
            x[1].fill_(3.0)
            return y.sum(0)
        if case == "diagonal_then_read":
            x.diagonal().mul_(2)
            return x.sum(1) + y.sum(1)
        x[:, 1:3].add_(y[:, :2])
        return y.exp()

    x = torch.randn(4, 4, dtype=torch.float64)
    y = torch.randn(4, 4, dtype=torch.float64, requires_grad=training)
    x_eager, y_eager = x.clone(), y.detach().clone().requires_grad_(training)
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        out = torch.compile(fn, backend="aotforge")(x, y)
    expected = fn(x_eager, y_eager)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x, x_eager)  # the input was written as eager writes it
    assert graphs and all(g.path == "triton" for g in graphs)
    if training:
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(y.grad, y_eager.grad)


def test_a_lowering_that_declines_leaves_nothing_behind(monkeypatch):
    """A lowering that realizes its input and then declines: the op runs through ATen on the
    input's value, never on a buffer that nothing computes."""
    original = LOWERINGS[aten.sin.default]

    def realize_then_decline(ctx, x):
        ctx.realize(x)
        raise NotLowerable("declines after realizing its input")

    monkeypatch.setitem(LOWERINGS, aten.sin.default, realize_then_decline)
    fn = lambda x: (torch.sin(x * 2 + 1) + (x * 2 + 1).cos(),)
    x = torch.randn(8, 8, dtype=torch.float64)
    gm = trace(fn, x)
    with config.patch(triton_on_cpu=True):
        compiled = compile_fx_inner(gm, [x])
        (out,) = compiled([x.clone()])
    torch.testing.assert_close(out, fn(x)[0])
    assert compiled.compiled_graph.stats["fallbacks"] == {"aten.sin.default": 1}
    # nothing the declined lowering emitted is left: x * 2 + 1 once (for the ATen sin), the
    # ATen call, the sum with the cosine
    kinds = [type(op).__name__ for op in compiled.compiled_graph.lowered.operations]
    assert kinds == ["ComputedBuffer", "ExternCall", "ComputedBuffer"], str(compiled.compiled_graph.lowered)
    assert original is not realize_then_decline


class _Layers(torch.nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                                              torch.nn.GELU()) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_identical_kernels_of_repeated_layers_are_one_source():
    torch.manual_seed(0)
    model = _Layers(4).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        compiled = torch.compile(model, backend="aotforge")
        compiled(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for actual, expected in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(actual, expected)
    for graph in graphs:
        names = [k.name for k in graph.kernels]
        # the layer's kernels repeat four times, under one name each (compiled once)
        assert len(set(names)) * 2 <= len(names), (graph.kind, names)
        shared = {id(graph.launchers[k.group]) for k in graph.kernels}
        assert len(shared) == len({(k.name, k.numel, k.rnumel) for k in graph.kernels})


def test_observe_collects_the_graphs_of_a_block():
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        torch.compile(lambda x: (x.exp() * 3).sum(), backend="aotforge")(x).backward()
    assert [g.kind for g in graphs] == ["forward", "backward"]
    assert graphs[0].timings["trace"] > 0 and graphs[0].timings["partition"] > 0
    with observe() as later:
        pass
    assert later == []


def test_backward_compiles_with_the_forward_and_each_first_run_is_timed():
    # torch.compile's backend compiles the backward graph at once, so that a compile pool
    # builds both graphs' kernels together; the first call of each graph records how long it
    # waited for the pool, compiled and autotuned
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    fn = lambda x: (x.sin() * 3).sum(-1)
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        out = torch.compile(fn, backend="aotforge")(x)
        assert [g.kind for g in graphs] == ["forward", "backward"]
        out.sum().backward()
    torch.testing.assert_close(x.grad, 3 * x.detach().cos())
    for graph in graphs:
        assert {"pool_wait", "triton_compile", "autotune", "first_run"} <= set(graph.timings)
        assert "triton_compile" in graph.describe_timings()


def test_backward_compiled_in_autograd_thread_is_observed():
    import threading

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    backward = functools.partial(compile_fx_inner, is_backward=True)
    compiled = aotforge.aot_function(lambda x: x.exp() * 3, compile_fx_inner, backward)
    with config.patch(triton_on_cpu=True), observe() as graphs:
        out = compiled(x)
        # as autograd does for CUDA tensors: the backward (and its lazy compile) in another thread
        thread = threading.Thread(target=lambda: out.sum().backward())
        thread.start()
        thread.join()
    assert [g.kind for g in graphs] == ["forward", "backward"]
    torch.testing.assert_close(x.grad, 3 * x.detach().exp())
