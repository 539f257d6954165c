"""CPU 1x1 convolutions of an NHWC inference graph as matrix multiplies
(passes/matmul_convolutions.py): values and strides as eager's (float64 exact up to summation
order, float32 with NaN and inf), the multiply in the kernel plan instead of the convolution,
and convolutions that are not such left alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from aotforge.compiler.passes import library_calls, matmul_convolutions

from .test_cpu_convolutions import _check_like_eager, _compiled, _externs, _randomize_batch_norms


@pytest.fixture
def float64(monkeypatch):
    monkeypatch.setattr(matmul_convolutions, "DTYPES", (torch.float32, torch.float64))
    monkeypatch.setattr(library_calls, "CPU_CHANNELS_LAST_DTYPES", (*library_calls.CPU_CHANNELS_LAST_DTYPES,
                                                                     torch.float64))


class Bottleneck(nn.Module):
    """A 3x3 convolution (the graph's NHWC), a 1x1 expansion with BatchNorm (folded into its
    bias), a squeeze-excite gate of 1x1 convolutions over 1x1 images, a 1x1 projection without
    bias, and a strided 1x1 one (not a matrix multiply over the buffer: left alone)."""

    def __init__(self, cin=8, mid=24, dtype=torch.float64):
        super().__init__()
        self.stem = nn.Conv2d(3, cin, 3, padding=1, dtype=dtype)
        self.expand = nn.Conv2d(cin, mid, 1, bias=False, dtype=dtype)
        self.bn = nn.BatchNorm2d(mid, dtype=dtype)
        self.squeeze = nn.Conv2d(mid, 4, 1, dtype=dtype)
        self.excite = nn.Conv2d(4, mid, 1, dtype=dtype)
        self.project = nn.Conv2d(mid, cin, 1, bias=False, dtype=dtype)
        self.strided = nn.Conv2d(cin, cin, 1, stride=2, dtype=dtype)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = torch.relu(self.bn(self.expand(x)))
        gate = torch.sigmoid(self.excite(torch.relu(self.squeeze(y.mean((2, 3), keepdim=True)))))
        z = self.project(y * gate) + x
        return z, self.strided(z)


def _matmuls_and_convolutions(graphs):
    externs = _externs(graphs)
    return (sum("mm" in op for op in externs), sum("convolution" in op for op in externs))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_inference_matches_eager(float64, layout):
    torch.manual_seed(0)
    model = _randomize_batch_norms(Bottleneck()).eval()
    x = torch.randn(3, 3, 7, 9, dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    out, graphs = _compiled(model, x)
    with torch.no_grad():
        _check_like_eager(out, model(x), rtol=1e-12, atol=1e-12)
    # expand, squeeze, excite, project as matrix multiplies; the stem and the strided one not
    assert _matmuls_and_convolutions(graphs) == (4, 2)


def test_float32_with_nan_and_inf_like_eager():
    torch.manual_seed(1)
    model = _randomize_batch_norms(Bottleneck(dtype=torch.float32)).eval()
    x = torch.randn(2, 3, 6, 6)
    x[0, 1, 2, 3], x[1, 0, 4, 5] = float("inf"), float("nan")
    out, graphs = _compiled(model, x)
    with torch.no_grad():
        _check_like_eager(out, model(x), rtol=1e-4, atol=1e-4)
    assert _matmuls_and_convolutions(graphs) == (4, 2)


def test_nchw_graphs_and_training_keep_the_convolution(float64, monkeypatch):
    """Without the NHWC layout (float64 outside the channels-last dtypes) the 1x1 convolution
    stays a convolution; training graphs are not rewritten."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(4, 6, 1), nn.ReLU()).double()
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    monkeypatch.setattr(library_calls, "CPU_CHANNELS_LAST_DTYPES", (torch.float32,))
    out, graphs = _compiled(model.eval(), x)
    with torch.no_grad():
        _check_like_eager(out, model(x), rtol=1e-12, atol=1e-12)
    assert _matmuls_and_convolutions(graphs) == (0, 1)
    out, graphs = _compiled(model.train(), x.requires_grad_(), grad=True)
    _check_like_eager(out, model(x), rtol=1e-12, atol=1e-12)
    assert not any("mm" in op for op in _externs(graphs))
