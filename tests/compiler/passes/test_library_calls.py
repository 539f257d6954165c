"""Padded matmuls and scatter-add accumulation (compiler/passes/library_calls.py): equal to eager
(values, gradients) through the Triton interpreter, with the rewrite visible in the kernel plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler import observe
from aotforge.compiler.passes import library_calls
from aotforge.config import config

from ..helpers import trace


@pytest.fixture
def pad_on_cpu(monkeypatch):
    """Pad CPU matmuls as CUDA ones, at sizes the interpreter runs quickly."""
    monkeypatch.setattr(library_calls, "PAD_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(library_calls, "MIN_PADDED_WORK", 1)
    monkeypatch.setitem(library_calls.ALIGNMENT, torch.float64, 4)


def _compiled_run(fn, *inputs):
    """fn through backend="aotforge" on the Triton path: outputs, input gradients, the plans."""
    torch._dynamo.reset()
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    with config.patch(triton_on_cpu=True), observe() as graphs:
        out = torch.compile(fn, backend="aotforge")(*inputs)
        out.sum().backward()
    assert graphs and all(g.path == "triton" for g in graphs)
    return out, [x.grad for x in inputs if x.requires_grad], graphs


def _matmul_shapes(graphs) -> list[list[int]]:
    """The shapes of the operands that each matmul of the kernel plans gets."""
    shapes = []
    for graph in graphs:
        for step in graph.kernel_plan.steps:
            if str(getattr(step, "op", "")) in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default"):
                for arg in step.args:
                    size = getattr(arg, "size", None) or getattr(getattr(arg, "layout", None), "size", None)
                    if size is not None:
                        shapes.append([int(s) for s in size])
    return shapes


def _plans(graphs) -> str:
    return "\n".join(str(g.kernel_plan) for g in graphs)


def _eager_run(fn, *inputs):
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = fn(*inputs)
    out.sum().backward()
    return out, [x.grad for x in inputs if x.requires_grad]


@pytest.mark.parametrize("case", ["mm", "addmm", "addmm_bias_2d", "bmm", "returned"])
def test_padded_matmul_equals_eager(pad_on_cpu, case):
    torch.manual_seed(0)
    x = torch.randn(6, 5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 11, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11 if case != "addmm_bias_2d" else 30 * 11, dtype=torch.float64, requires_grad=True)

    def fn(x, w, b):
        if case == "mm":
            return (x.reshape(30, 7).tanh() @ w).exp()
        if case == "addmm":
            return torch.addmm(b, x.reshape(30, 7), w).exp()
        if case == "addmm_bias_2d":
            return torch.addmm(b.reshape(30, 11), x.reshape(30, 7), w).exp()
        if case == "bmm":
            return torch.bmm(x, w.expand(6, 7, 11)).sin()
        return x.reshape(30, 7) @ w  # the matmul's result is the graph's output

    out, grads, plans = _compiled_run(fn, x, w, b)
    expected, expected_grads = _eager_run(fn, x, w, b)
    torch.testing.assert_close(out, expected)
    assert out.stride() == expected.stride()
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
    shapes = _matmul_shapes(plans)  # the padding is visible in the kernel plan
    assert shapes and all(size % 4 == 0 for shape in shapes for size in shape[-2:]), shapes


def test_aligned_and_small_matmuls_are_not_padded(pad_on_cpu, monkeypatch):
    monkeypatch.setattr(library_calls, "MIN_PADDED_WORK", 10 ** 9)
    x = torch.randn(30, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 11, dtype=torch.float64, requires_grad=True)
    _, _, graphs = _compiled_run(lambda x, w: (x @ w).exp(), x, w)
    assert [30, 7] in _matmul_shapes(graphs)
    monkeypatch.setattr(library_calls, "MIN_PADDED_WORK", 1)
    x = torch.randn(32, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 12, dtype=torch.float64, requires_grad=True)
    _, _, graphs = _compiled_run(lambda x, w: (x @ w).exp(), x, w)
    assert [32, 8] in _matmul_shapes(graphs)
    # no pad at all for aligned sizes (a pad of zeros would still copy the operands)
    gm = library_calls.pad_matmuls(trace(lambda x, w: (x @ w).exp(), x.detach(), w.detach()))
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.constant_pad_nd.default]


def test_matmuls_on_cpu_are_not_padded_by_default():
    x = torch.randn(30, 7, dtype=torch.float32, requires_grad=True)
    w = torch.randn(7, 11, dtype=torch.float32, requires_grad=True)
    _, _, graphs = _compiled_run(lambda x, w: (x @ w).exp(), x, w)
    assert [30, 7] in _matmul_shapes(graphs)


class _Embedder(torch.nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.embedding = torch.nn.Embedding(13, 6, padding_idx=padding_idx, dtype=torch.float64)

    def forward(self, tokens):
        return self.embedding(tokens).tanh().sum(1)


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("deterministic", [False, True])
def test_embedding_backward_with_repeated_indices_equals_eager(padding_idx, deterministic):
    torch.manual_seed(0)
    model = _Embedder(padding_idx)
    reference = _Embedder(padding_idx)
    reference.load_state_dict(model.state_dict())
    tokens = torch.tensor([[1, 2, 2, 5], [5, 5, 1, 12], [2, 0, 0, 0]])  # repeated rows
    torch._dynamo.reset()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with config.patch(triton_on_cpu=True), observe() as graphs:
            torch.compile(model, backend="aotforge")(tokens).sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    reference(tokens).sum().backward()
    torch.testing.assert_close(model.embedding.weight.grad, reference.embedding.weight.grad)
    plans = _plans(graphs)
    if deterministic:  # ATen's deterministic accumulation is kept
        assert "scatter_add" not in plans and "index_put" in plans
    else:
        assert "scatter_add" in plans and "index_put" not in plans


@pytest.mark.parametrize("broadcast", [False, True])
def test_index_put_accumulate_with_negative_and_repeated_indices(broadcast):
    index = torch.tensor([0, -1, 3, 3, -1, 0, 0])
    values = torch.randn(1 if broadcast else 7, 4, dtype=torch.float64, requires_grad=True)
    base = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def fn(base, values):
        return torch.index_put(base.exp(), (index,), values * 2, accumulate=True)

    out, grads, plans = _compiled_run(fn, base, values)
    expected, expected_grads = _eager_run(fn, base, values)
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
    assert "scatter_add" in _plans(plans)


def test_cross_entropy_over_an_unaligned_vocabulary(pad_on_cpu):
    """The GPT-2 case in small: logits over an unaligned vocabulary, forward and backward."""
    torch.manual_seed(0)
    hidden = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    head = torch.randn(37, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (12,))

    def fn(hidden, head):
        return F.cross_entropy(F.linear(hidden, head), targets)

    out, grads, plans = _compiled_run(fn, hidden, head)
    expected, expected_grads = _eager_run(fn, hidden, head)
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
    shapes = _matmul_shapes(plans)
    assert shapes and all(size % 4 == 0 for shape in shapes for size in shape[-2:]), shapes
    # the backward's two matmuls read one padded copy of the logits' gradient
    (backward,) = [g for g in plans if g.kind == "backward"]
    matmuls = [step for step in backward.kernel_plan.steps if str(getattr(step, "op", "")) == "aten.mm.default"]
    operands = [{arg.buffer.name for arg in step.args if hasattr(arg, "buffer")} for step in matmuls]
    assert len(matmuls) == 2 and operands[0] & operands[1], operands


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, dtype=torch.float64)
        self.bn = torch.nn.BatchNorm2d(8, dtype=torch.float64)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False, dtype=torch.float64)
        self.head = torch.nn.Linear(8, 5, dtype=torch.float64)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv1(x)))
        z = self.conv2(y) + y[:, :, ::2, ::2]
        return self.head(z.mean((2, 3))), z  # z: a 4-d output the caller sees


@pytest.mark.parametrize("training", [False, True])
def test_convolution_graphs_run_channels_last_with_eager_output_strides(monkeypatch, training):
    monkeypatch.setattr(library_calls, "CHANNELS_LAST_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(library_calls, "CPU_CHANNELS_LAST_DTYPES", (torch.float64,))
    monkeypatch.setattr(library_calls, "MIN_CHANNELS_LAST_CHANNELS", 1)
    torch.manual_seed(0)
    model = _ConvNet().train(training)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch._dynamo.reset()
    with torch.set_grad_enabled(training), config.patch(triton_on_cpu=True), observe() as graphs:
        out = torch.compile(model, backend="aotforge")(x)
    with torch.set_grad_enabled(training):
        expected = model(x)
    for actual, wanted in zip(out, expected):
        torch.testing.assert_close(actual, wanted)
        assert actual.stride() == wanted.stride()
    convolutions = [step for g in graphs for step in g.kernel_plan.steps
                    if str(getattr(step, "op", "")) == "aten.convolution.default"]
    assert len(convolutions) == 2
    # inference: every convolution runs NHWC, which oneDNN picks from an NHWC input or weight
    # (channel stride 1; an NHWC input keeps its weight's layout: a transposed copy of a
    # weight per call cost more than it saved); training: untouched
    channel_strides = [{int(arg.stride[1]) for arg in step.args[:2]} for step in convolutions]
    if training:
        assert all(1 not in strides for strides in channel_strides), channel_strides
    else:
        assert all(1 in strides for strides in channel_strides), channel_strides
    if not training:  # the kernels that write NHWC operands walk them in memory order
        computed = [arg.buffer for step in convolutions for arg in step.args[:2]
                    if type(arg.buffer).__name__ == "ComputedBuffer"]
        assert computed and all(list(b.layout.stride) == sorted(b.layout.stride, reverse=True) for b in computed)
        assert all(int(b.layout.size[-1]) in (3, 8) for b in computed)  # channels innermost
