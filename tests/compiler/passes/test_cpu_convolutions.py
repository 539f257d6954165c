"""The CPU convolution path (issue 34): channels-last convolutions on the CPU, per-channel
affine ops (inference BatchNorm) folded into the convolution, max pooling as a pointwise
maximum; compared with eager on the C++ path (float32, float64) with the
rewrite visible in the kernel plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotforge
from aotforge.compiler import observe
from aotforge.compiler.passes import (convolution_epilogues, convolution_timing, library_calls,
                                      matmul_convolutions, pooling)

from ..helpers import trace

aten = torch.ops.aten


def _steps(graphs, kind=None):
    return [step for g in graphs if kind is None or g.kind == kind for step in g.kernel_plan.steps]


def _externs(graphs, kind=None) -> list[str]:
    return [str(step.op) for step in _steps(graphs, kind) if hasattr(step, "op")]


def _compiled(model, *inputs, grad=False):
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad), observe() as graphs:
        out = torch.compile(model, backend="aotforge")(*inputs)
    assert graphs and all(g.path == "cpp" for g in graphs), [g.path for g in graphs]
    return out, graphs


def _check_like_eager(actual, expected, **tolerance):
    actual = actual if isinstance(actual, (tuple, list)) else (actual,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, equal_nan=True, **tolerance)
        assert a.stride() == e.stride()


class ConvBlock(nn.Module):
    """conv -> BatchNorm -> ReLU -> max pooling, twice, then a 4-d and a pooled output."""

    def __init__(self, cin=3, width=16, dtype=torch.float32, stride=1, groups=1, bias=False, pool=(2, 2, 0)):
        super().__init__()
        kernel, pool_stride, pool_padding = pool
        self.conv1 = nn.Conv2d(cin, width, 3, padding=1, bias=bias, dtype=dtype)
        self.bn1 = nn.BatchNorm2d(width, dtype=dtype)
        self.pool = nn.MaxPool2d(kernel, pool_stride, pool_padding)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups, bias=bias, dtype=dtype)
        self.bn2 = nn.BatchNorm2d(width, dtype=dtype)

    def forward(self, x):
        y = self.pool(torch.relu(self.bn1(self.conv1(x))))
        z = torch.relu(self.bn2(self.conv2(y)))
        return z, z.mean((2, 3))


def _randomize_batch_norms(model):
    """Running statistics and affine parameters away from their initial 0/1 (which would make
    a missing or doubled normalization invisible)."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            for tensor in (module.running_mean, module.weight, module.bias):
                tensor.data.copy_(torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
            module.running_var.data.copy_(torch.rand(module.running_var.shape, generator=generator,
                                                     dtype=module.running_var.dtype) + 0.5)
    return model


# --- inference on the C++ path -------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "non_contiguous"])
def test_inference_block_matches_eager_in_float32(layout):
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=3, width=16)).eval()
    x = torch.randn(3, 3, 25, 23)  # odd sizes: the pooling drops a row and a column
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "non_contiguous":
        x = torch.randn(3, 23, 3, 50).permute(0, 2, 3, 1)[..., ::2, :]  # [3, 3, 25, 23], strided
    out, graphs = _compiled(model, x)
    with torch.no_grad():
        expected = model(x)
    _check_like_eager(out, expected, rtol=1e-4, atol=1e-4)
    externs = _externs(graphs)
    assert externs.count("aten.convolution.default") == 2, externs
    # BatchNorm folded: the convolutions get a bias (the folded shift), the model has none
    calls = [step for step in _steps(graphs) if hasattr(step, "op") and "convolution" in str(step.op)]
    # NHWC operands: the first convolution's weight (its 3-channel image keeps its layout) and
    # the second's input have channel stride 1; the second's weight keeps eager's layout (an NHWC
    # input makes oneDNN run NHWC, and a transposed weight would cost a strided copy per call)
    assert all(step.args[2] is not None for step in calls)
    strides = [int(arg.stride[1]) for step in calls for arg in step.args[:2] if hasattr(arg, "stride")]
    assert strides[1:] == [1, 1, 9], strides
    assert calls[1].args[1].stride[0] == 16 * 9
    # the pooling between them is a kernel of taps fused with BatchNorm's ReLU (pooling.py)
    assert not any("max_pool" in extern for extern in externs), externs


def test_small_images_convert_only_the_weight():
    """Over fewer than 8 input channels the image keeps its layout; the weight goes NHWC, so
    oneDNN runs the convolution in NHWC and converts the small image itself."""
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=3, width=8)).eval()
    x = torch.randn(2, 3, 8, 8)
    out, graphs = _compiled(model, x)
    with torch.no_grad():
        _check_like_eager(out, model(x), rtol=1e-4, atol=1e-4)
    first = next(step for step in _steps(graphs) if "convolution" in str(getattr(step, "op", "")))
    image, weight = first.args[:2]
    assert list(map(int, image.stride)) == [192, 64, 8, 1]  # the graph's input as it came
    assert int(weight.stride[1]) == 1


class WeightHeavyNet(nn.Module):
    """conv + BatchNorm + ReLU, pooling to 2x2, then a convolution whose weight (128 x 32 x 3 x 3)
    is 36 times its input (2 x 32 x 2 x 2), as a ResNet's last stage at a small image size, then
    a 1x1 convolution."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(16, 32, 1, stride=2, bias=False),
                                    nn.Conv2d(32, 128, 3, padding=1, bias=False),
                                    nn.Conv2d(128, 16, 1, bias=False)])
        self.bns = nn.ModuleList([nn.BatchNorm2d(c) for c in (32, 128, 16)])

    def forward(self, x):
        for index, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            x = torch.relu(bn(conv(x)))
            if index == 0:
                x = F.max_pool2d(x, 4)
        return x


@pytest.fixture
def one_by_one_convolutions(monkeypatch):
    """1x1 convolutions stay convolutions (not matrix multiplies: passes/matmul_convolutions.py),
    so that the layout each one runs in shows in the kernel plan."""
    monkeypatch.setattr(matmul_convolutions, "DTYPES", ())


def test_weight_dominated_convolution_runs_nchw_and_large_weights_do_not_fold(one_by_one_convolutions):
    """A convolution whose weight outweighs its input 32 times runs NCHW between NHWC ones (its
    input converted back), and BatchNorm folds only into weights no larger than the output
    (the last two keep BatchNorm over their activation). Values and strides as eager's."""
    torch.manual_seed(0)
    model = _randomize_batch_norms(WeightHeavyNet()).eval()
    x = torch.randn(2, 16, 16, 16)
    out, graphs = _compiled(model, x)
    with torch.no_grad():
        _check_like_eager(out, model(x), rtol=1e-4, atol=1e-4)
    calls = [step for step in _steps(graphs) if "convolution" in str(getattr(step, "op", ""))]
    assert [int(step.args[0].stride[1]) == 1 for step in calls] == [True, False, True]
    assert [step.args[2] is not None for step in calls] == [True, False, False]  # folded: a bias


def test_a_dynamic_batch_keeps_the_nhwc_path_without_new_guards():
    """Under automatic dynamic shapes (a second batch size recompiles with a symbolic batch) the
    convolutions still run NHWC with BatchNorm folded, the C++ kernels walk channels as rows,
    and a third size runs the same graph (the passes add no guard on the batch)."""
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=3, width=16)).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aotforge")
    with torch.no_grad(), observe() as graphs:
        for batch in (4, 6, 5, 9):
            x = torch.randn(batch, 3, 24, 22)
            _check_like_eager(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert len(graphs) == 2 and all(g.path == "cpp" for g in graphs), [g.path for g in graphs]
    dynamic = graphs[1]
    calls = [step for step in _steps([dynamic]) if "convolution" in str(getattr(step, "op", ""))]
    assert int(calls[1].args[0].stride[1]) == 1 and all(step.args[2] is not None for step in calls)
    assert "(xnumel / 16)" in dynamic.kernel_source  # rows of the 16 channels, the batch symbolic


def test_symbolic_image_sizes_with_pooling_get_cpp_kernels():
    """``dynamic=True``: pooled sizes are ``max(1, s // 2)``, which the kernels and the wrapper
    now print; the graph runs its C++ kernels (before: ATen calls), as eager at two sizes."""
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=3, width=8)).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aotforge", dynamic=True)
    with torch.no_grad(), observe() as graphs:
        for size in ((2, 3, 12, 10), (3, 3, 15, 9)):
            x = torch.randn(*size)
            _check_like_eager(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert len(graphs) == 1 and graphs[0].path == "cpp" and graphs[0].kernels, graphs
    assert "std::max<int64_t>" in graphs[0].kernel_source or "max(" in graphs[0].program.source


@pytest.mark.parametrize("stride,groups,bias", [(2, 1, True), (1, 4, False), (2, 16, True)])
def test_strided_grouped_and_biased_convolutions_fold(stride, groups, bias):
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=8, width=16, stride=stride, groups=groups, bias=bias,
                                             pool=(3, 2, 1))).eval()
    x = torch.randn(2, 8, 15, 9)
    out, _ = _compiled(model, x)
    with torch.no_grad():
        _check_like_eager(out, model(x), rtol=1e-4, atol=1e-4)


def test_nan_and_inf_propagate_as_in_eager():
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=8, width=8)).eval()
    x = torch.randn(2, 8, 10, 10)
    x[0, 0, 1, 1] = float("nan")
    x[0, 3, 6, 6] = float("inf")
    x[1, 5, 2, 7] = float("-inf")
    out, _ = _compiled(model, x)
    with torch.no_grad():
        expected = model(x)
    assert expected[0].isnan().any() and expected[0].isfinite().any()
    _check_like_eager(out, expected, rtol=1e-4, atol=1e-4)


def test_float64_folds_batch_norm_and_keeps_eager_layout(monkeypatch):
    """float64 convolutions do not run in oneDNN: no NHWC and no fused ReLU by default, but the
    BatchNorm still folds; with float64 allowed, the NHWC path matches eager too."""
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=8, width=8, dtype=torch.float64, bias=True)).eval()
    x = torch.randn(2, 8, 9, 7, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
    out, graphs = _compiled(model, x)
    _check_like_eager(out, expected, rtol=1e-10, atol=1e-10)
    assert all(e == "aten.convolution.default" for e in _externs(graphs) if "convolution" in e)
    monkeypatch.setattr(library_calls, "CPU_CHANNELS_LAST_DTYPES", (torch.float64,))
    out, graphs = _compiled(model, x)
    _check_like_eager(out, expected, rtol=1e-10, atol=1e-10)
    calls = [s for s in _steps(graphs) if "convolution" in str(getattr(s, "op", ""))]
    assert int(calls[1].args[0].stride[1]) == 1


# --- the passes on traced graphs -------------------------------------------------------------------


def _conv_then(epilogue, channels=4, bias=True):
    weight = torch.randn(channels, 3, 3, 3, dtype=torch.float64)
    conv_bias = torch.randn(channels, dtype=torch.float64) if bias else None
    vectors = [torch.randn(channels, 1, 1, dtype=torch.float64) for _ in range(3)]
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)

    def fn(x, weight, conv_bias, a, b, c):
        return epilogue(aten.convolution(x, weight, conv_bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), a, b, c)
    return fn, (x, weight, conv_bias, *vectors)


@pytest.mark.parametrize("name,epilogue,folds", [
    ("batch_norm_form", lambda y, a, b, c: (y - a) * b * c + a, True),
    ("divide_and_reversed_operands", lambda y, a, b, c: c + b * ((y + a) / (b.abs() + 1)), True),
    ("channel_vector_of_rank_4", lambda y, a, b, c: y * a.unsqueeze(0) - c, True),
    ("scalar_like_vector", lambda y, a, b, c: y * a[:1] + c, True),
    ("vector_minus_convolution", lambda y, a, b, c: a - y, False),
    ("convolution_read_twice", lambda y, a, b, c: (y * a + b) * y, False),
    ("a_row_not_a_channel", lambda y, a, b, c: y * torch.cat([a, b[:2]]).reshape(1, 1, 6, 1), False),
])
def test_fold_channel_affine_on_traced_graphs(name, epilogue, folds):
    fn, inputs = _conv_then(epilogue)
    gm = trace(fn, *inputs)
    before = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    gm = convolution_epilogues.fold_channel_affine(gm)
    gm.recompile()
    torch.testing.assert_close(gm(*inputs), fn(*inputs), rtol=1e-12, atol=1e-12)
    after = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.convolution.default]
    big = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (aten.mul.Tensor, aten.add.Tensor,
           aten.sub.Tensor, aten.div.Tensor) and n.meta["val"].dim() == 4 and n.meta["val"].shape[0] == 2]
    assert len(after) == 1
    if folds:  # the convolution's result goes straight out: no op over the activation is left
        assert not big and after[0].args[2] is not None, gm.code
    else:
        assert big and aten.convolution.default in before


# --- max pooling as a pointwise maximum -------------------------------------------------------------


@pytest.fixture
def pointwise_pooling(monkeypatch):
    monkeypatch.setattr(pooling, "POINTWISE_POOL_DEVICES", ("cpu",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil_mode", [
    (2, 2, 0, 1, False), (3, 2, 1, 1, False), (3, 1, 1, 2, False), (3, 2, 0, 1, True), ((2, 3), (1, 2), (1, 0), 1, True),
    (5, 1, 2, 1, False),  # 25 taps: a chain of 24 selects (lowering it once took hours: ir._read_once)
])
def test_pointwise_max_pooling_matches_eager(pointwise_pooling, dtype, kernel, stride, padding, dilation, ceil_mode):
    x = torch.randn(2, 5, 9, 11, dtype=dtype)
    x[0, 1, 2, 3] = float("nan")
    x[1, 2, :, :4] = float("-inf")
    x[1, 3, 4, 5] = float("inf")

    def fn(x):
        return F.max_pool2d(torch.sigmoid(x) * x, kernel, stride, padding, dilation, ceil_mode)
    out, graphs = _compiled(fn, x)
    torch.testing.assert_close(out, fn(x), equal_nan=True)
    assert out.stride() == fn(x).stride()
    assert not any("max_pool" in e for e in _externs(graphs))  # one kernel: the pooling fused


def test_pointwise_max_pooling_over_channels_last_input(pointwise_pooling):
    x = torch.randn(2, 16, 10, 10).contiguous(memory_format=torch.channels_last)
    fn = lambda x: F.max_pool2d(torch.relu(x), 3, 2, 1)  # noqa: E731
    out, _ = _compiled(fn, x)
    _check_like_eager(out, fn(x))


@pytest.mark.parametrize("pool", [(3, 2, 1), (2, 2, 1)])
def test_padded_pooling_after_an_nhwc_convolution_reads_a_stored_nhwc_pad(pointwise_pooling, pool):
    # ResNet's stem: an NHWC convolution, BatchNorm, ReLU, then 3 x 3 / 2 pooling padded by 1
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=3, width=16, pool=pool)).eval()
    x = torch.randn(2, 3, 21, 19)
    out, graphs = _compiled(model, x)
    with torch.no_grad():
        expected = model(x)
    _check_like_eager(out, expected, rtol=1e-4, atol=1e-4)
    assert not any("max_pool" in extern for extern in _externs(graphs))
    # the pad is stored (BatchNorm and ReLU computed once, not in each tap), and the taps load
    # it under no row/column mask: masked, GCC left the loop scalar (30.8 ms against 1.1 ms)
    kernels = [k.source for g in graphs for k in g.kernels]
    taps = [k for k in kernels if "isnan" in k]
    assert taps and not any("(xmask && " in k for k in taps), taps
    # ... stored NHWC, like the convolution's output (NCHW, the pad kernel would transpose it)
    # buffers are allocated in memory order: an NHWC pad is (N, H + padding, W + padding, C)
    sizes = [eval(line.split("empty_strided_cpu(")[1].split("), (")[0] + ")")
             for g in graphs for line in g.program.source.splitlines() if "empty_strided_cpu(" in line]
    assert any(len(s) == 4 and s[3] == 16 and s[1] > 21 for s in sizes), sizes
    assert not any(len(s) == 4 and s[1] == 16 and s[2] > 21 for s in sizes), sizes


def test_max_pooling_indices_keep_the_aten_call(pointwise_pooling):
    x = torch.randn(2, 3, 8, 8)
    fn = lambda x: F.max_pool2d(x * 2, 2, return_indices=True)  # noqa: E731
    (values, indices), graphs = _compiled(fn, x)
    expected = fn(x)
    torch.testing.assert_close(values, expected[0])
    assert torch.equal(indices, expected[1])
    assert any("max_pool" in e for e in _externs(graphs))


# --- training: the passes leave it as eager computes it ---------------------------------------------


@pytest.mark.parametrize("layout", ["nchw", "forced nhwc", "timed nhwc", "timed nchw"])
def test_training_steps_match_eager_buffers_and_gradients(monkeypatch, layout):
    """Training graphs in eager's layout, NHWC by ``CHANNELS_LAST_TRAINING_DEVICES``, or in the
    layout their convolutions timed faster in (forward and backward)."""
    joint_channels_last = "nhwc" in layout
    if layout == "forced nhwc":
        monkeypatch.setattr(library_calls, "CHANNELS_LAST_TRAINING_DEVICES", ("cpu",))
    if layout.startswith("timed"):
        monkeypatch.setattr(convolution_timing, "_timed_training", {})
        monkeypatch.setattr(convolution_timing, "_measure_training",
                            lambda key, budget: (1.0, 0.5) if joint_channels_last else (1.0, 0.95))
        monkeypatch.setattr(aotforge.config, "cpu_convolution_timing", True)
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=3, width=8)).train()
    reference = _randomize_batch_norms(ConvBlock(cin=3, width=8)).train()
    reference.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aotforge")
    with observe() as graphs:
        compiled(torch.randn(4, 3, 9, 9)).__getitem__(1).sum().backward()
    convolution_inputs = [step.args[1] for step in _steps(graphs, "backward")
                          if str(getattr(step, "op", "")) == "aten.convolution_backward.default"]
    # the backward convolutions read what the forward saved: NHWC only under the joint pass
    assert len(convolution_inputs) == 2
    assert (int(convolution_inputs[0].stride[1]) == 1) == joint_channels_last
    # BatchNorm's backward gets its gradient in the graph's layout (no transposing kernel)
    gradients = [step.args[0] for step in _steps(graphs, "backward")
                 if str(getattr(step, "op", "")) == "aten.native_batch_norm_backward.default"]
    assert gradients and all((int(g.stride[1]) == 1) == joint_channels_last for g in gradients)
    model.zero_grad(), reference.load_state_dict(model.state_dict())
    for step in range(3):
        x = torch.randn(4, 3, 9, 9, generator=torch.Generator().manual_seed(step))
        x_ref = x.clone().requires_grad_()
        x = x.requires_grad_()
        out = compiled(x)
        expected = reference(x_ref)
        grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(10 + step)) for o in out]
        torch.autograd.backward(out, grads)
        torch.autograd.backward(expected, grads)
        _check_like_eager(out, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
        for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-4, msg=name)
            p.grad = p_ref.grad = None
    for (name, b), b_ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, b_ref, rtol=1e-5, atol=1e-6, msg=name)
    # and the eval-mode graph compiled afterwards reads the trained statistics
    model.eval(), reference.eval()
    x = torch.randn(2, 3, 9, 9)
    torch._dynamo.reset()
    with torch.no_grad():
        _check_like_eager(torch.compile(model, backend="aotforge")(x), reference(x), rtol=1e-4, atol=1e-4)


def test_parameters_changed_between_calls_are_read_again():
    """Nothing is frozen: the folded weight is computed from the parameters on every call."""
    torch.manual_seed(0)
    model = _randomize_batch_norms(ConvBlock(cin=8, width=8)).eval()
    x = torch.randn(2, 8, 8, 8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aotforge")
    with torch.no_grad():
        compiled(x)
        model.bn1.running_var.mul_(4)
        model.conv2.weight.mul_(-0.5)
        _check_like_eager(compiled(x), model(x), rtol=1e-4, atol=1e-4)



def test_sixteen_bit_convolutions_do_not_fold():
    fn, inputs = _conv_then(lambda y, a, b, c: (y - a) * b + c)
    inputs = tuple(t.to(torch.bfloat16) for t in inputs)
    gm = convolution_epilogues.fold_channel_affine(trace(fn, *inputs))
    assert any(n.target is aten.sub.Tensor and n.meta["val"].dim() == 4 for n in gm.graph.nodes)
