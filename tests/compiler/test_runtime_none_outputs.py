"""ATen calls may return None where fake tensors promised a tensor (cuDNN attention's philox
seed and offset without dropout); the generated wrapper passes them through."""
import torch

from aotforge.compiler.runtime.launch import ensure_layout


def test_ensure_layout_passes_none_through():
    assert ensure_layout(None, (), ()) is None


def test_ensure_layout_keeps_or_fixes_layout():
    x = torch.randn(3, 4)
    assert ensure_layout(x, (3, 4), (4, 1)) is x
    fixed = ensure_layout(x.t().contiguous().t(), (3, 4), (4, 1))
    assert fixed.stride() == (4, 1) and torch.equal(fixed, x)
