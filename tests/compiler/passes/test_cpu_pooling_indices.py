"""Max pooling with indices in a training forward graph as a generated C++ kernel
(``pooling.pointwise_max_pooling_with_indices``, issue 34): values, int64 indices and input
gradients compared with eager bit for bit (max is exact), and a small conv + BatchNorm + ReLU +
pooling model trained for 3 SGD steps against eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler import observe
from aotforge.compiler.passes import pooling

from ..helpers import trace

aten = torch.ops.aten


def _forward_externs(graphs) -> list[str]:
    return [str(step.op) for g in graphs if g.kind == "forward" for step in g.kernel_plan.steps if hasattr(step, "op")]


def _special_values(x: torch.Tensor) -> torch.Tensor:
    """NaN (one and two in a window: the last wins), -inf over whole windows, +inf, ties of
    equal values and of 0.0 with -0.0 (the first wins)."""
    x = x.clone()
    x[0, 0, 1, 1] = float("nan")
    x[0, 1, 2, 2] = x[0, 1, 2, 3] = float("nan")
    x[1, 0, :4, :] = float("-inf")
    x[1, 1, 3, 4] = float("inf")
    x[0, 2, :, :] = 0.5  # ties everywhere
    x[1, 2, 0::2, :] = -0.0
    x[1, 2, 1::2, :] = 0.0
    return x


def _check_pooling(x, kernel, stride, padding, dilation, ceil_mode, view=None):
    """The pooling of ``x * 1.0`` (a tensor the graph computes), or with ``view`` of
    ``view(x)`` itself: the graph's input, in that view's strides and storage offset."""
    def fn(x):
        return F.max_pool2d(x * 1.0 if view is None else x, kernel, stride, padding, dilation, ceil_mode,
                            return_indices=True)
    base_eager, base_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    x_eager, x_compiled = (base if view is None else view(base) for base in (base_eager, base_compiled))
    torch._dynamo.reset()
    with observe() as graphs:
        values, indices = torch.compile(fn, backend="aotforge")(x_compiled)
    expected_values, expected_indices = fn(x_eager)
    torch.testing.assert_close(values, expected_values, equal_nan=True, rtol=0, atol=0)
    # bit for bit: NaN payloads and the sign of zeros included
    assert torch.equal(values.view(torch.int64 if x.dtype == torch.float64 else torch.int32),
                       expected_values.view(torch.int64 if x.dtype == torch.float64 else torch.int32))
    assert torch.equal(indices, expected_indices)
    assert values.stride() == expected_values.stride() and indices.stride() == expected_indices.stride()
    grad = torch.randn(expected_values.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(3))
    expected_values.backward(grad)
    values.backward(grad)
    torch.testing.assert_close(base_compiled.grad, base_eager.grad, rtol=0, atol=0)
    return graphs


CASES = [  # kernel, stride, padding, dilation, ceil_mode
    (2, 2, 0, 1, False), (3, 2, 1, 1, False), (3, 1, 1, 2, False), (3, 2, 0, 1, True), (3, 2, 1, 1, True),
    ((2, 3), (1, 2), (1, 0), 1, True), ((3, 2), (2, 1), (0, 1), (2, 1), False), ((1, 2), 2, 0, 1, True),
    (2, 3, 1, 3, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil_mode", CASES)
def test_values_indices_and_gradients_match_eager(dtype, kernel, stride, padding, dilation, ceil_mode):
    x = _special_values(torch.randn(2, 3, 9, 11, dtype=dtype))
    graphs = _check_pooling(x, kernel, stride, padding, dilation, ceil_mode)
    assert not any("max_pool2d_with_indices.default" in e for e in _forward_externs(graphs))


@pytest.mark.parametrize("layout", ["three_dims", "offset_view", "channels_last", "strided"])
def test_layouts_match_eager(layout):
    """A (C, H, W) input, or a contiguous view starting past its storage's start (the graph's
    input: ``as_strided`` reads it at that offset), gets the kernel; channels-last and strided
    inputs keep ATen's call (its NHWC kernel is fast)."""
    x, view = _special_values(torch.randn(3, 8, 9, 22)), None
    if layout == "three_dims":  # (C, H, W)
        x = x[1, :, :, :11].contiguous()
    elif layout == "offset_view":
        view = lambda x: x[1:, :, :, :]  # noqa: E731
        x = x[..., :11].contiguous()
    elif layout == "channels_last":
        x = x[..., :11].contiguous(memory_format=torch.channels_last)
    else:
        view = lambda x: x[..., ::2]  # noqa: E731
    for kernel, stride, padding, dilation, ceil_mode in CASES[:4]:
        graphs = _check_pooling(x, kernel, stride, padding, dilation, ceil_mode, view=view)
        generated = not any("max_pool2d_with_indices.default" in e for e in _forward_externs(graphs))
        assert generated == (layout in ("three_dims", "offset_view"))


def test_tiny_planes_with_padding_and_dilation():
    """Windows whose first taps lie in the padding: the index starts at the first tap inside."""
    x = torch.full((1, 2, 3, 4), float("-inf"), dtype=torch.float64)
    x[0, 1] = torch.tensor([[1.0, float("nan"), 1.0, 3.0], [2.0, 2.0, float("nan"), -1.0], [0.0, -0.0, 5.0, 5.0]])
    for kernel, stride, padding, dilation, ceil_mode in [(3, 1, 1, 1, False), (3, 2, 1, 1, True), (2, 1, 1, 2, True),
                                                         (4, 1, 2, 1, False), (3, 1, 1, 2, True)]:
        _check_pooling(x, kernel, stride, padding, dilation, ceil_mode)


def test_a_one_by_one_window_stays_an_aten_call():
    graphs = _check_pooling(torch.randn(2, 3, 8, 8), 1, 2, 0, 1, True)
    assert any("max_pool2d_with_indices.default" in e for e in _forward_externs(graphs))


def test_the_pass_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(pooling, "POOL_INDICES_DEVICES", ())
    graphs = _check_pooling(torch.randn(2, 3, 8, 8), 2, 2, 0, 1, False)
    assert any("max_pool2d_with_indices.default" in e for e in _forward_externs(graphs))


def test_sixteen_bit_pooling_stays_an_aten_call():
    def fn(x):
        return F.max_pool2d(x, 2, return_indices=True)
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    gm = trace(fn, x)
    pooling.pointwise_max_pooling_with_indices(gm)
    assert any(n.target is aten.max_pool2d_with_indices.default for n in gm.graph.nodes)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 3, 2, 1, ceil_mode=True)
        return self.head(x.mean((2, 3)))


def test_conv_net_trains_like_eager():
    torch.manual_seed(0)
    model = _Net().double()
    reference = _Net().double()
    reference.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aotforge")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(4, 3, 13, 11, dtype=torch.float64, generator=generator)
        target = torch.randint(0, 5, (4,), generator=generator)
        with observe() as graphs:
            loss = F.cross_entropy(compiled(x), target)
            loss.backward()
        expected = F.cross_entropy(reference(x), target)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
        for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-9, atol=1e-10, msg=name)
        optimizer.step(), reference_optimizer.step()
        optimizer.zero_grad(), reference_optimizer.zero_grad()
        if step == 0:
            assert not any("max_pool2d_with_indices.default" in e for e in _forward_externs(graphs))
    for (name, b), b_ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, b_ref, rtol=1e-10, atol=1e-10, msg=name)
