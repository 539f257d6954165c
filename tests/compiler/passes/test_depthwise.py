"""The weight gradient of a CPU depthwise convolution as a grouped convolution
(passes/depthwise.py): each form gives eager's gradients (float64, exact up to summation
order), the pass leaves other convolutions alone, keeps ATen's call for the input and bias
gradients, and picks the form by the rule or by timing."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import aotforge
from aotforge.compiler.passes import depthwise

aten = torch.ops.aten


@pytest.fixture
def float64(monkeypatch):
    """float64 takes the path too, for comparisons without float32's rounding."""
    monkeypatch.setattr(depthwise, "DTYPES", (torch.float32, torch.float64))
    monkeypatch.setattr(depthwise, "_timed", {})


def _force(monkeypatch, form: str) -> list:
    """Every depthwise weight gradient takes ``form``; the list records the forms built."""
    built = []
    real = depthwise.weight_gradient

    def spy(call, *args, padded):
        built.append("padded" if padded else "grouped")
        return real(call, *args, padded=padded)

    monkeypatch.setattr(depthwise, "_rule", lambda node: form)
    monkeypatch.setattr(depthwise, "weight_gradient", spy)
    return built


# channels, height, width, kernel, stride, padding, dilation
SHAPES = [
    (16, 9, 10, 5, 1, 2, 1),   # MobileNetV3's 5x5
    (12, 7, 8, 5, 2, 2, 1),    # strided, odd sizes: the grouped convolution has an extra row
    (8, 2, 2, 5, 1, 2, 1),     # padding as large as the image
    (6, 11, 12, 3, 2, 1, 2),   # dilated and strided
    (6, 8, 9, 5, 1, 4, 2),
    (4, 5, 6, (3, 5), (1, 2), (1, 2), 1),  # rectangular kernel, per-axis stride and padding
]


class Depthwise(nn.Module):
    def __init__(self, channels, kernel, stride, padding, dilation, bias):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel, stride, padding, dilation, groups=channels, bias=bias)
        self.after = nn.Conv2d(channels, channels, 1)  # a use of the output other than the loss

    def forward(self, x):
        return self.after(torch.relu(self.conv(x))).square().mean()


def _eager_and_compiled(model, x):
    """Loss and gradients (input, then each parameter) of eager and of aotforge."""
    results = []
    for fn in (model, torch.compile(model, backend="aotforge")):
        inputs = [x.detach().clone().requires_grad_(x.requires_grad)]
        loss = fn(*inputs)
        leaves = [t for t in (*inputs, *model.parameters()) if t.requires_grad]
        results.append((loss.detach(), torch.autograd.grad(loss, leaves)))
    return results


@pytest.mark.parametrize("form", ["grouped", "padded"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_training_matches_eager(float64, monkeypatch, form, shape):
    torch._dynamo.reset()
    built = _force(monkeypatch, form)
    channels, height, width, kernel, stride, padding, dilation = shape
    torch.manual_seed(0)
    model = Depthwise(channels, kernel, stride, padding, dilation, bias=True).double()
    x = torch.randn(3, channels, height, width, dtype=torch.float64, requires_grad=True)
    (loss, grads), (compiled_loss, compiled_grads) = _eager_and_compiled(model, x)
    assert built == [form]
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-12, atol=1e-12)
    for compiled, eager in zip(compiled_grads, grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("input_grad", [True, False])
def test_channels_last_input_and_no_input_gradient(float64, monkeypatch, input_grad):
    """An NHWC input (the reshape into planes copies it), and a first layer, whose input needs
    no gradient: ATen's call stays for the bias gradient, and goes without a bias."""
    torch._dynamo.reset()
    built = _force(monkeypatch, "grouped")
    torch.manual_seed(1)
    for bias in (True, False):
        torch._dynamo.reset()
        model = Depthwise(8, 5, 1, 2, 1, bias=bias).double()
        x = torch.randn(2, 8, 6, 7, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
        x.requires_grad_(input_grad)
        (loss, grads), (compiled_loss, compiled_grads) = _eager_and_compiled(model, x)
        torch.testing.assert_close(compiled_loss, loss, rtol=1e-12, atol=1e-12)
        for compiled, eager in zip(compiled_grads, grads, strict=True):
            torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)
    assert built == ["grouped", "grouped"]


def test_float32_with_nan_and_inf_like_eager(monkeypatch):
    """float32 (the dtype it is for), with an infinity and a NaN in the input: the gradients'
    non-finite entries are eager's, the rest match to float32 rounding."""
    torch._dynamo.reset()
    built = _force(monkeypatch, "grouped")
    torch.manual_seed(2)
    model = nn.Conv2d(8, 8, 5, 1, 2, groups=8)
    x = torch.randn(2, 8, 6, 6)
    x[0, 1, 2, 3], x[1, 4, 0, 0] = float("inf"), float("nan")
    results = []
    for fn in (model, torch.compile(model, backend="aotforge")):
        out = fn(x)
        results.append(torch.autograd.grad(out.sum(), list(model.parameters())))
    assert built == ["grouped"]
    for compiled, eager in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4, equal_nan=True)


def _backward_graph(x, weight, grad, stride, padding, dilation, groups, mask):
    """A graph of one ``convolution_backward`` (traced on fake tensors, as the joint graph is)."""
    def f(grad, x, weight):
        return aten.convolution_backward.default(grad, x, weight, [weight.shape[0]], stride, padding, dilation,
                                                 False, [0, 0], groups, mask)
    return make_fx(f, tracing_mode="fake")(grad, x, weight), (grad, x, weight)


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("mask", [[True, True, True], [False, True, False], [False, True, True]])
def test_the_pass_keeps_atens_call_for_the_other_gradients(float64, monkeypatch, mask):
    _force(monkeypatch, "grouped")
    torch.manual_seed(3)
    x, weight = torch.randn(2, 6, 7, 7, dtype=torch.float64), torch.randn(6, 1, 5, 5, dtype=torch.float64)
    grad = torch.randn(2, 6, 4, 4, dtype=torch.float64)
    gm, inputs = _backward_graph(x, weight, grad, [2, 2], [2, 2], [1, 1], 6, mask)
    expected = gm(*inputs)
    gm = depthwise.depthwise_weight_gradients(gm)
    gm.recompile()
    grouped = [n for n in _calls(gm, aten.convolution.default) if n.args[8] == 2 * 6]
    assert len(grouped) == 1
    remaining = _calls(gm, aten.convolution_backward.default)
    assert [n.args[10] for n in remaining] == [[mask[0], False, mask[2]]]
    for got, want in zip(gm(*inputs), expected, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["dense", "multiplier", "float32 unused weight gradient", "grouped not depthwise"])
def test_other_convolutions_are_left_alone(float64, monkeypatch, case):
    _force(monkeypatch, "grouped")
    x, weight, groups = torch.randn(2, 4, 6, 6), torch.randn(4, 4, 5, 5), 1
    mask = [True, True, False]
    if case == "multiplier":  # two filters per channel
        weight, groups = torch.randn(8, 1, 5, 5), 4
    elif case == "float32 unused weight gradient":
        weight, groups, mask = torch.randn(4, 1, 5, 5), 4, [True, False, False]
    elif case == "grouped not depthwise":
        weight, groups = torch.randn(4, 2, 5, 5), 2
    grad = torch.randn(2, weight.shape[0], 6, 6)
    gm, _ = _backward_graph(x, weight, grad, [1, 1], [2, 2], [1, 1], groups, mask)
    before = [n.target for n in gm.graph.nodes]
    assert [n.target for n in depthwise.depthwise_weight_gradients(gm).graph.nodes] == before


@pytest.mark.parametrize("kernel, padding, image, form", [
    (3, 1, 8, "aten"), (5, 2, 4, "grouped"), (5, 2, 2, "padded"), ((3, 5), (1, 2), 8, "aten")])
def test_rule(kernel, padding, image, form):
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    x = torch.randn(2, 4, image, image)
    gm, _ = _backward_graph(x, torch.randn(4, 1, kh, kw), torch.randn(2, 4, image, image), [1, 1], [ph, pw],
                            [1, 1], 4, [True, True, False])
    node = _calls(gm, aten.convolution_backward.default)[0]
    assert depthwise._rule(node) == form


def _timed_graph():
    x = torch.randn(2, 4, 6, 6)
    gm, _ = _backward_graph(x, torch.randn(4, 1, 5, 5), torch.randn(2, 4, 6, 6), [1, 1], [2, 2], [1, 1], 4,
                            [True, True, False])
    return gm


@pytest.mark.parametrize("seconds, form", [
    ({"aten": 1.0, "grouped": 2.0, "padded": 3.0}, "aten"),
    ({"aten": 3.0, "grouped": 2.0, "padded": 1.0}, "padded"),
    ({"aten": 3.0, "grouped": 0.95, "padded": 1.0}, "grouped"),   # the rule's form: kept on a near tie
    ({"aten": 1.0, "grouped": 1.05, "padded": 1.0}, "grouped")])
def test_timing_picks_a_clearly_faster_form_and_remembers_it(monkeypatch, seconds, form):
    monkeypatch.setattr(depthwise, "_timed", {})
    timed = []

    def measure(key, budget):
        timed.append(key)
        return seconds

    monkeypatch.setattr(depthwise, "_measure", measure)
    with aotforge.config.patch(cpu_convolution_timing=True):
        for _ in range(2):
            node = _calls(_timed_graph(), aten.convolution_backward.default)[0]
            assert depthwise._choose(node, depthwise.convolution_timing.Budget()) == form
    assert len(timed) == 1  # the second graph's shape was timed before


def test_timing_runs_every_form_and_a_failure_keeps_the_rule(monkeypatch):
    monkeypatch.setattr(depthwise, "_timed", {})
    node = _calls(_timed_graph(), aten.convolution_backward.default)[0]
    with aotforge.config.patch(cpu_convolution_timing=True):
        key = ((2, 4, 6, 6), (2, 4, 6, 6), (4, 1, 5, 5), torch.float32, ((1, 1), (2, 2), (1, 1)), 1)
        seconds = depthwise._measure(key, depthwise.convolution_timing.Budget())
        assert set(seconds) == {"aten", "grouped", "padded"} and all(s > 0 for s in seconds.values())

        def fail(key, budget):
            raise RuntimeError("out of memory")

        monkeypatch.setattr(depthwise, "_measure", fail)
        assert depthwise._choose(node, depthwise.convolution_timing.Budget()) == depthwise._rule(node)
        # a spent budget: the rule, without timing
        monkeypatch.setattr(depthwise, "_measure", lambda key, budget: pytest.fail("timed"))
        assert depthwise._choose(node, depthwise.convolution_timing.Budget(0.0)) == depthwise._rule(node)


def test_the_forms_compute_atens_weight_gradient():
    """The functions the timing runs are the ones the graph gets: both match ATen's gradient."""
    torch.manual_seed(4)
    x, grad = torch.randn(3, 5, 9, 8, dtype=torch.float64), torch.randn(3, 5, 5, 2, dtype=torch.float64)
    weight = torch.randn(5, 1, 5, 5, dtype=torch.float64)
    want = aten.convolution_backward.default(grad, x, weight, None, [2, 3], [2, 1], [1, 1], False, [0, 0], 5,
                                             [False, True, False])[1]

    def run(target, *args):
        return target(*args)

    for padded in (False, True):
        got = depthwise.weight_gradient(run, grad, x, weight.shape, [2, 3], [2, 1], [1, 1], padded=padded)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
