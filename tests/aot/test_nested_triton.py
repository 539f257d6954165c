"""Jagged nested tensors on the Triton path (kernels run in Triton's interpreter on the CPU):
a model trains equal to eager, through torch.compile and through aot_function with the
compiler (issue 26: the ragged size, a nested int, crashed the compiler's size reading)."""
from __future__ import annotations

import functools

import pytest
import torch

import aotforge
from aotforge.compiler import compile_fx_inner, observe

from .test_subclasses import assert_same

DOUBLE = torch.float64


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with aotforge.config.patch(triton_on_cpu=True):
        yield


def step(nested, weight, bias):
    return ((nested * weight).sin() + bias).relu(), (weight * bias).cos()


def _train(fn, steps: int = 3):
    torch.manual_seed(0)
    weight = torch.randn(4, dtype=DOUBLE, requires_grad=True)
    bias = torch.randn(4, dtype=DOUBLE, requires_grad=True)
    history = []
    for index in range(steps):
        nested = torch.nested.nested_tensor(
            [torch.randn(2 + index, 4, dtype=DOUBLE), torch.randn(3, 4, dtype=DOUBLE)],
            layout=torch.jagged, requires_grad=True)
        out, other = fn(nested, weight, bias)
        loss = out.values().pow(2).sum() + other.sum()
        loss.backward()
        history.append((out.values().detach().clone(), nested.grad.values().clone(), loss.detach()))
        with torch.no_grad():
            for parameter in (weight, bias):
                parameter -= 0.1 * parameter.grad
                parameter.grad = None
    return history, weight.detach(), bias.detach()


def _assert_trains_like_eager(compiled, graphs):
    expected, e_weight, e_bias = _train(step)
    actual, weight, bias = _train(compiled)
    for index, (a, e) in enumerate(zip(actual, expected)):
        for what, x, y in zip(("output values", "input gradient", "loss"), a, e):
            assert_same(x, y, f"step {index} {what}")
    assert_same(weight, e_weight, "trained weight")
    assert_same(bias, e_bias, "trained bias")
    kernels = [g for g in graphs if g.path == "triton" and g.kernels]
    assert {g.kind for g in kernels} >= {"forward", "backward"}, [(g.kind, g.path) for g in graphs]


def test_jagged_trains_on_the_triton_path_through_torch_compile():
    torch._dynamo.reset()
    with observe() as graphs:
        _assert_trains_like_eager(torch.compile(step, backend="aotforge", fullgraph=True), graphs)


def test_jagged_trains_on_the_triton_path_through_aot_function():
    with observe() as graphs:
        backward = functools.partial(compile_fx_inner, is_backward=True)
        _assert_trains_like_eager(aotforge.aot_function(step, compile_fx_inner, backward), graphs)
