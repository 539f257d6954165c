"""Jagged nested tensors through aotforge (torch.compile and aot_function), compared with eager."""
from __future__ import annotations

import pytest
import torch

import aotforge
from aotforge.aot.boxing import nop

from .test_subclasses import assert_same

DOUBLE = torch.float64


def make_inputs():
    torch.manual_seed(0)
    nested = torch.nested.nested_tensor(
        [torch.randn(2, 4, dtype=DOUBLE), torch.randn(3, 4, dtype=DOUBLE)], layout=torch.jagged, requires_grad=True
    )
    weight = torch.randn(4, dtype=DOUBLE, requires_grad=True)
    return nested, weight


def function(nested, weight):
    return (nested * weight).sin() + 1, weight.cos()


def run(fn):
    nested, weight = make_inputs()
    out, other = fn(nested, weight)
    (out.values().sum() + other.sum()).backward()
    return nested, weight, out, other


@pytest.mark.parametrize("backend", ["aotforge_eager", "aotforge"])
def test_jagged_through_torch_compile(backend):
    torch._dynamo.reset()
    compiled = torch.compile(function, backend=backend, fullgraph=True)
    nested, weight, out, other = run(compiled)
    e_nested, e_weight, e_out, e_other = run(function)
    assert type(out) is type(e_out)
    # The output shares the input's offsets (the same ragged dimension), as in eager.
    assert out._offsets is nested._offsets and out.shape == nested.shape
    assert_same(out.values().detach(), e_out.values().detach(), "output values")
    assert_same(other.detach(), e_other.detach(), "plain output")
    assert_same(nested.grad.values(), e_nested.grad.values(), "nested gradient")
    assert_same(weight.grad, e_weight.grad, "weight gradient")


def test_jagged_through_aot_function():
    compiled = aotforge.aot_function(function, nop)
    for _ in range(2):
        nested, weight, out, other = run(compiled)
        e_nested, e_weight, e_out, e_other = run(function)
        assert out.shape == nested.shape
        assert_same(out.values().detach(), e_out.values().detach(), "output values")
        assert_same(nested.grad.values(), e_nested.grad.values(), "nested gradient")
        assert_same(weight.grad, e_weight.grad, "weight gradient")
