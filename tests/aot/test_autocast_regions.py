"""A graph traced under autocast already holds autocast's casts; running its ATen calls under
the caller's autocast again would cast the regions the model ran with autocast disabled (a
rotary embedding's float32 matmul: LLaMA, Mistral, Qwen2, GPT-NeoX under bf16 autocast)."""
from __future__ import annotations

import pytest
import torch

import aotforge  # noqa: F401


def rotary_like(x, inv_freq, positions):
    with torch.autocast("cpu", enabled=False):
        freqs = inv_freq.float()[:, None] @ positions.float()[None, :]  # stays float32
        cos = freqs.cos()
    return x @ x.t(), cos, cos * 2  # the first matmul is autocast's (bfloat16)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("backend", ["aotforge", "aotforge_eager"])
def test_autocast_disabled_region_keeps_float32(backend, train):
    x = torch.randn(8, 8, requires_grad=train)
    inv_freq = torch.rand(8, requires_grad=train)
    positions = torch.arange(16.0)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(train):
        expected = rotary_like(x, inv_freq, positions)
        actual = torch.compile(rotary_like, backend=backend)(x, inv_freq, positions)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e)
