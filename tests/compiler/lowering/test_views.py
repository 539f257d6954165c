"""lowering/views.py against eager: views whose meaning depends on how a value is stored."""
from __future__ import annotations

import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler import observe


def _compiled(fn, *inputs):
    torch._dynamo.reset()
    with torch.no_grad(), observe() as graphs:
        out = torch.compile(fn, backend="aotforge")(*inputs)
    return out, graphs


def test_as_strided_reads_a_channels_last_value_as_eager_stores_it():
    # as_strided indexes its input's storage: over a channels-last clone, the strides below
    # take every other row and column of each image in NHWC memory order. A value stored in
    # other strides than eager's (contiguous) would hand the view other elements.
    def fn(x):
        y = (x * 2).contiguous(memory_format=torch.channels_last)  # strides (48, 1, 12, 3)
        return torch.as_strided(y, (2, 3, 2, 2), (48, 1, 24, 6), 0) + 1

    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    out, graphs = _compiled(fn, x)
    torch.testing.assert_close(out, fn(x), rtol=0, atol=0)
    assert graphs


def test_as_strided_with_an_offset_over_a_permuted_value():
    def fn(x):
        y = (x + 1).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # NHWC storage
        return torch.as_strided(y, (2, 2, 3), (60, 1, 5), 7) * 3

    x = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    out, _ = _compiled(fn, x)
    torch.testing.assert_close(out, fn(x), rtol=0, atol=0)
