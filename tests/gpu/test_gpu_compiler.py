"""The compiler on CUDA: the model tests in fp32 and bf16 (real Triton kernels), and a check
that the ops the issue lists are fused into generated kernels, not run as ATen fallbacks."""
from __future__ import annotations

import copy
import sys
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and compiled, not interpreted, Triton)")

import aotforge  # noqa: E402
from aotforge.compiler import observe, compile_fx_inner, select_decomposition_table  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "compiler"))
from models import MODELS, example_input  # noqa: E402

TOLERANCE = {torch.float32: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
# ops allowed to run as ATen calls: matmul, convolution, attention and their backwards
EXTERN_OK = ("mm", "bmm", "addmm", "convolution", "convolution_backward", "scaled_dot_product",
             "index_put", "cumprod", "cumsum", "scatter")  # scans and scatters are ATen calls by design


def _relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_on_cuda(name, dtype):
    torch.manual_seed(0)
    eager = MODELS[name]().cuda().to(dtype)
    compiled_model = copy.deepcopy(eager)
    reference = copy.deepcopy(eager).double()
    x = example_input(name, dtype, "cuda")
    torch._dynamo.reset()
    with observe() as graphs:
        loss = torch.compile(compiled_model, backend="aotforge")(x).float().square().mean()
        loss.backward()
    assert graphs and all(g.path == "triton" for g in graphs)
    expected = reference(x.double()).square().mean()
    expected.backward()
    eager(x).float().square().mean().backward()
    limit = 1e-3 if dtype == torch.float32 else 3e-2
    assert _relative_error(loss, expected) < limit
    for (parameter, p), (_, q), (_, e) in zip(compiled_model.named_parameters(), reference.named_parameters(),
                                              eager.named_parameters()):
        # no worse than eager's own error against float64, with some slack
        allowed = max(limit, 3 * _relative_error(e.grad, q.grad))
        assert _relative_error(p.grad, q.grad) < allowed, f"{name}.{parameter}.grad"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_inference_on_cuda(name, dtype):
    torch.manual_seed(0)
    eager = MODELS[name]().cuda().to(dtype).eval()
    x = example_input(name, dtype, "cuda")
    torch._dynamo.reset()
    with torch.no_grad():
        actual = torch.compile(copy.deepcopy(eager), backend="aotforge")(x)
        expected = copy.deepcopy(eager).double()(x.double())
    assert _relative_error(actual, expected) < (1e-3 if dtype == torch.float32 else 3e-2)


FUSED_CASES = {
    "layer_norm_gelu": lambda x, w: F.gelu(F.layer_norm(x, (x.shape[-1],), w, w)),
    "softmax": lambda x, w: torch.softmax(x * w, -1),
    "log_softmax": lambda x, w: torch.log_softmax(x, -1) + w,
    "batch_norm": lambda x, w: F.batch_norm(x, None, None, w[:x.shape[1]], w[:x.shape[1]], training=True),
    "silu_tanh_sigmoid": lambda x, w: F.silu(x) * torch.tanh(x) + torch.sigmoid(w),
    "reductions": lambda x, w: (x.sum(0) + x.mean(0) + x.amax(0) + x.var(0) + x.prod(0) + w,),
    "cat_pad_index": lambda x, w: torch.cat([F.pad(x, (1, 1)), x[:, [0, 2, 1, 3]].repeat(1, 1)[:, :2].sum(1, keepdim=True).expand(-1, 66)], 0) * 2,
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_listed_ops_become_kernels(case):
    fn = FUSED_CASES[case]
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, device="cuda", requires_grad=True)
    seen = []

    def compiler(gm, example_inputs, **kwargs):
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        seen.append(compiled.compiled_graph.stats)
        return compiled
    compiled = aotforge.aot_function(fn, compiler, compiler, decompositions=select_decomposition_table())
    out = compiled(x, w)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    expected = fn(x.detach().double().requires_grad_(), w.detach().double().requires_grad_())
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert _relative_error(out, expected) < 1e-4
    assert seen and all(s["path"] == "triton" and s["kernels"] > 0 for s in seen)
    for s in seen:
        unexpected = [op for op in s["fallbacks"] if not any(name in op for name in EXTERN_OK)]
        assert not unexpected, f"{case}: ops ran as ATen fallbacks: {unexpected}"


def test_direct_launches_follow_the_arguments_alignment():
    """After the first launch, kernels skip Triton's dispatch; an argument whose alignment
    differs from what a kernel was compiled for (an unaligned view) gets its own compile."""
    fn = lambda x, y: (x * 2 + y.sin(), (x - y).sum(-1))
    x, y = torch.randn(64, 96, device="cuda"), torch.randn(64, 96, device="cuda")
    gm = make_fx_graph(fn, x, y)
    compiled = compile_fx_inner(gm, [x, y])
    launchers = list(compiled.compiled_graph.launchers.values())
    base = torch.randn(64 * 96 + 1, device="cuda")
    unaligned = base[1:].view(64, 96)  # 4 bytes past an aligned allocation
    for args in ([x, y], [x, y], [unaligned, y], [x, y], [unaligned, y], [y, x]):
        expected = fn(*args)
        for actual, wanted in zip(compiled(list(args)), expected):
            torch.testing.assert_close(actual, wanted)
    found = {k.name: (k.direct and {key: launch is not None for key, launch in k.direct.launches.items()})
             for k in launchers}
    # every kernel launches directly, with one entry per specialization (x aligned or not)
    assert all(entries and all(entries.values()) for entries in found.values()), found
    assert any(len(entries) == 2 for entries in found.values()), found


@pytest.mark.parametrize("columns", [30522, 1000])
def test_wide_column_sum_matches_eager(columns):
    """A sum down the columns of a wide tensor (BERT's MLM bias gradient) is cut into pieces
    (lowering/reductions.py): the pieces and their second pass give eager's values, in float32
    and in bf16, for a column count that is and one that is not a multiple of the tile."""
    fn = lambda g, z: ((g * z.exp()).sum(0), g.sum(0, keepdim=True))
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        g = torch.randn(8192, columns, device="cuda").to(dtype)
        z = torch.randn(8192, columns, device="cuda").to(dtype)
        compiled = compile_fx_inner(make_fx_graph(fn, g, z), [g, z])
        expected = fn(g.double(), z.double())
        for actual, wanted in zip(compiled([g, z]), expected):
            assert actual.dtype == dtype and actual.shape == wanted.shape
            assert _relative_error(actual, wanted) < tolerance


def make_fx_graph(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"),
                   decomposition_table=select_decomposition_table(), tracing_mode="fake")(*args)
