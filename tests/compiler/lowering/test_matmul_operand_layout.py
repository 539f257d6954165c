"""A matmul operand computed from a transposed read (``p.transpose(-1, -2).to(bf16)`` before
a bmm, as BERT's attention backward does) is stored in the read's memory order and handed to
the matmul as a transposed view: the kernel that writes it then walks its input and its output
in memory order, and the matmul takes either order at no cost."""
from __future__ import annotations

import pytest
import torch

import aotforge  # noqa: F401
from aotforge.compiler.lowering import lower
from aotforge.config import config

from ..helpers import trace


def _attention_backward_like(p, v):
    return torch.bmm(p.reshape(6, 32, 32).permute(0, 2, 1).to(torch.float32), v)


def test_the_operand_is_written_in_its_inputs_order():
    lowered = str(lower(trace(_attention_backward_like, torch.randn(2, 3, 32, 32, dtype=torch.float64),
                              torch.randn(6, 32, 16))))
    assert "load(p_1, 1024*i0 + 32*i1 + i2)" in lowered, lowered  # along memory, not across rows
    assert "bmm.default(view(buf0, [6, 32, 32], [1024, 1, 32], 0)" in lowered, lowered


def test_an_untransposed_operand_stays_contiguous():
    lowered = str(lower(trace(lambda p, v: torch.bmm(p.to(torch.float32), v),
                              torch.randn(6, 32, 32, dtype=torch.float64), torch.randn(6, 32, 16))))
    assert "bmm.default(buf0, v_1)" in lowered, lowered


@pytest.mark.parametrize("shape", [(2, 3, 32, 32), (1, 6, 17, 17)])
def test_values_and_gradients_match_eager(shape):
    def fn(p, v):
        return torch.bmm(p.reshape(-1, shape[-1], shape[-1]).transpose(1, 2).to(torch.float64) * 2, v)

    p = torch.randn(*shape, dtype=torch.float32, requires_grad=True)
    v = torch.randn(shape[0] * shape[1], shape[-1], 5, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True):
        actual = torch.compile(fn, backend="aotforge")(p, v)
        grads = torch.autograd.grad(actual.sum(), (p, v))
    expected = fn(p, v)
    torch.testing.assert_close(actual, expected)
    for a, e in zip(grads, torch.autograd.grad(expected.sum(), (p, v))):
        torch.testing.assert_close(a, e)
