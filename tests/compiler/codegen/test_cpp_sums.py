"""Floating-point sums in the C++ kernels (codegen/cpp_sums.py, issue 37): over 10^6 values,
float32 sums, means, variances and LayerNorm statistics of data with a large offset are at
least as close to float64 as eager's cascade summation, in every arrangement of a reduction
loop (rows, rows split over several dimensions, tiles of columns, a sum beside a max or an
argmax, beside a store). A contiguous row's sum is eager's own order: bit for bit eager's
where eager sums each row on one thread. Before blocked sums, one accumulator per SIMD lane
drifted 10 to 40,000 times further than eager (a sum of 10^6 values near 100: 1.7e-3 relative,
eager 4e-8)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aotforge.compiler.runtime import cpp_build
from aotforge.config import config

from .test_cpp import compile_cpp

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def our_own_math(monkeypatch):
    """These tests are about our kernels' loops and sums: the ops whose eager kernel rounds its
    own way (var, softmax, exp...) are computed by them, not kept as ATen calls (the global
    value: tracing reads it too)."""
    monkeypatch.setattr(config, "cpu_eager_bits", False)


def compiled_and_eager(fn, *args):
    compiled, graph = compile_cpp(fn, *args)
    return compiled([a.clone() for a in args]), fn(*args), "\n".join(k.source for k in graph.kernels)


ULP = 2.0 ** -23  # a float32 result's last bit, relative


def error(values, reference) -> float:
    """The largest error relative to the reference's largest magnitude."""
    return max(((v.double() - r).abs().max() / r.abs().max().clamp_min(1e-300)).item()
               for v, r in zip(values, reference))


def check_at_least_as_close(fn, *args):
    got, eager, source = compiled_and_eager(fn, *args)
    reference = fn(*[a.double() for a in args])
    ours, theirs = error(got, reference), error(eager, reference)
    # at least as close as eager, up to the rounding of the float32 result (one ulp, 2^-23 relative)
    assert ours <= max(theirs, ULP), f"compiled {ours:.3e}, eager {theirs:.3e} from float64"
    return got, eager, source


def offset(*shape, base=100.0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(0)) + base


@pytest.mark.parametrize("reduction", ["sum", "mean", "var"])
def test_a_million_values(reduction):
    x = offset(10**6)
    check_at_least_as_close(lambda x: (getattr(x, reduction)(),), x)


def test_layer_norm_statistics_with_a_large_offset():
    x = torch.randn(8, 2**17, generator=torch.Generator().manual_seed(1)) * 0.1 + 1000.0
    got, eager, _ = check_at_least_as_close(
        lambda x: tuple(torch.ops.aten.native_layer_norm(x, [2**17], None, None, 1e-5)[1:]), x)
    check_at_least_as_close(lambda x: (F.layer_norm(x, (2**17,)),), x)


def test_columns_and_rows_split_over_dimensions():
    x = offset(4096, 256)
    _, _, source = check_at_least_as_close(lambda x: (x.sum(0), x.amax(0), (x * 0.5).sum(0)), x)
    assert "xcount = std::min<int64_t>(64," in source and "_up[3][64]" in source  # tiles of columns, sums in a cascade
    y = offset(64, 8, 2048)
    _, _, source = check_at_least_as_close(lambda y: (y.sum((0, 2)), y.var((0, 2))), y)
    assert "for (int64_t r0 = 0; r0 < 64; ++r0)" in source and "_cascade(64);" in source


def test_a_sum_beside_a_max_an_argmax_or_a_store():
    x = offset(4, 2**18)
    _, _, source = check_at_least_as_close(lambda x: (x.sum(1), x.amax(1), x.argmax(1)), x)
    assert source.count("aot_cascade_row<") >= 1
    _, _, source = check_at_least_as_close(lambda x: (torch.softmax(x, 1), x.sum(1)), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 5, 8, 37, 64, 1000, 4099, 70001])
def test_a_row_sum_is_eager_s_bit_for_bit(dtype, length):
    # eager sums each row on one thread (parallel over rows): the same order, the same bits
    x = torch.randn(6, length, dtype=dtype, generator=torch.Generator().manual_seed(length)) + 3
    got, eager, source = compiled_and_eager(lambda x: (x.sum(1), x.mean(1)), x)
    assert "aot_cascade_row<" in source or length == 1  # (a row of one is no reduction)
    for g, e in zip(got, eager):
        assert torch.equal(g, e), (g - e).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_sum_in_float_in_blocks(dtype):
    x = (torch.rand(2**20, generator=torch.Generator().manual_seed(2)) + 1).to(dtype)
    got, eager, _ = compiled_and_eager(lambda x: (x.sum(dtype=torch.float32), x.float().mean()), x)
    reference = (x.double().sum(), x.double().mean())
    assert error(got, reference) <= max(error(eager, reference), ULP)
