"""compile_fx_inner end to end on small graphs: kernels equal eager, fusion decisions show in
the generated code, and the wrapper's runtime behaviour (mutation, reuse, errors)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from aotforge.compiler import compile_fx_inner
from aotforge.config import config

from .helpers import compile_and_run, trace

f64 = dict(dtype=torch.float64)


def test_graph_without_calls_is_returned_as_it_is():
    gm = trace(lambda x: (x,), torch.randn(3))
    compiled = compile_fx_inner(gm, [torch.randn(3)])
    x = torch.randn(3)
    assert compiled([x])[0] is x


def test_cpu_default_path_runs_cpp_kernels_or_aten_calls_when_off():
    x = torch.randn(4, 8, **f64)
    for cpu_codegen, path in ((True, "cpp"), (False, "aten")):
        (out,), info = compile_and_run(lambda x: (torch.softmax(x, -1) * 2,), x, triton=False, cpu_codegen=cpu_codegen)
        assert info["path"] == path
        torch.testing.assert_close(out, torch.softmax(x, -1) * 2)


def test_pointwise_chain_is_one_kernel():
    x, y = torch.randn(16, 8, **f64), torch.randn(8, **f64)
    fn = lambda x, y: (torch.sigmoid(x * y + 1).exp() - torch.tanh(x),)
    (out,), info = compile_and_run(fn, x, y)
    torch.testing.assert_close(out, fn(x, y)[0])
    assert info["kernels"] == 1 and info["externs"] == 0


def test_layer_norm_forward_is_one_kernel_with_mean_and_variance_in_registers():
    x, w, b = torch.randn(32, 64, **f64), torch.randn(64, **f64), torch.randn(64, **f64)
    fn = lambda x, w, b: (F.layer_norm(x, (64,), w, b),)
    (out,), info = compile_and_run(fn, x, w, b)
    torch.testing.assert_close(out, fn(x, w, b)[0])
    assert info["kernels"] == 1
    source = info["kernel_source"]
    assert source.count("_sum_combine)") == 2  # mean and variance, one pass over the row
    assert source.count("tl.store(") == 1  # only the result reaches memory


@pytest.mark.parametrize("case", ["softmax", "var", "argmax", "max", "prod", "any"])
def test_looped_reductions_match_eager(case):
    x = torch.randn(6, 50, **f64)
    fn = {"softmax": lambda x: (torch.softmax(x, -1),), "var": lambda x: (x.var(-1),),
          "argmax": lambda x: (x.argmax(-1),), "max": lambda x: (x.amax(-1) - x.amin(-1),),
          "prod": lambda x: ((x * 0.1 + 1).prod(-1),), "any": lambda x: ((x > 2).any(-1),)}[case]
    (out,), info = compile_and_run(fn, x, persistent_reduction_limit=16)
    assert "for roffset in range(0, rnumel, RBLOCK)" in info["kernel_source"]
    torch.testing.assert_close(out, fn(x)[0])


def test_split_reduction_matches_eager():
    x = torch.randn(512, 4, **f64)
    fn = lambda x: (x.sum(0), x.amax(0))
    outputs, info = compile_and_run(fn, x, split_reduction_threshold=64)
    assert "(8, 4)" in info["wrapper"] or "(16, 4)" in info["wrapper"] or "(2, 4)" in info["wrapper"]
    for actual, expected in zip(outputs, fn(x)):
        torch.testing.assert_close(actual, expected)


def test_input_mutation_is_written_into_the_input():
    def fn(x, y):
        x.mul_(2).add_(y)
        return (x.sum(),)
    x, y = torch.randn(4, 4, **f64), torch.randn(4, **f64)
    gm = trace(fn, x.clone(), y)
    assert any(n.target is torch.ops.aten.copy_.default for n in gm.graph.nodes)
    with config.patch(triton_on_cpu=True):
        compiled = compile_fx_inner(gm, [x, y])
    actual_x = x.clone()
    (total,) = compiled([actual_x, y])
    expected_x = x * 2 + y
    torch.testing.assert_close(actual_x, expected_x)
    torch.testing.assert_close(total, expected_x.sum())


def test_op_without_lowering_runs_as_an_aten_extern():
    x = torch.randn(5, 6, **f64)
    fn = lambda x: (torch.cumsum(x.sin(), 1) * 2,)
    (out,), info = compile_and_run(fn, x)
    torch.testing.assert_close(out, fn(x)[0])
    assert info["fallbacks"] == {"aten.cumsum.default": 1} and info["kernels"] == 2


def test_freed_buffers_are_reused():
    x, w = torch.randn(8, 8, **f64), torch.randn(8, 8, **f64)

    def fn(x, w):
        for _ in range(3):
            x = torch.relu(x @ w) + 1
        return (x,)
    (out,), info = compile_and_run(fn, x, w)
    torch.testing.assert_close(out, fn(x, w)[0])
    assert "# in place" in info["wrapper"]  # relu(x @ w) + 1 written over the product


def test_generated_code_is_dumped(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTFORGE_DUMP_DIR", str(tmp_path))
    compile_and_run(lambda x: (x.exp().sum(0),), torch.randn(4, 4))
    files = [f for f in tmp_path.rglob("*") if f.is_file()]  # <pid>/<compile>/<numbered files>
    names = [f.name for f in files]
    assert any("kernels" in n for n in names) and any("wrapper" in n for n in names)
    assert any("@triton.jit" in f.read_text() for f in files)


def test_unaligned_input():
    base = torch.randn(65, **f64)
    x = base[1:].view(8, 8)  # data pointer 8 bytes past an aligned allocation
    assert x.data_ptr() % 16 != 0
    gm = trace(lambda x: (x * 3 + 1,), x.clone())
    with config.patch(triton_on_cpu=True):
        (out,) = compile_fx_inner(gm, [x])([x])
    torch.testing.assert_close(out, x * 3 + 1)


def test_input_of_the_wrong_shape_is_a_clear_error():
    gm = trace(lambda x: (x + 1,), torch.randn(4, 4))
    with config.patch(triton_on_cpu=True):
        compiled = compile_fx_inner(gm, [torch.randn(4, 4)])
    with pytest.raises(RuntimeError, match="compiled for"):
        compiled([torch.randn(5, 4)])


def test_half_precision_computes_in_float32():
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    (out,), info = compile_and_run(lambda x: (torch.softmax(x, -1),), x)
    assert ".to(tl.float32)" in info["kernel_source"] and ".to(tl.bfloat16)" in info["kernel_source"]
    torch.testing.assert_close(out, torch.softmax(x.float(), -1).to(torch.bfloat16), atol=1e-2, rtol=1e-2)


def test_large_tensors_index_in_int64():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2**16, 2**15 + 1, dtype=torch.float16)
        gm = trace(lambda x: (x * 2,), x)
        with config.patch(triton_on_cpu=True):
            compiled = compile_fx_inner(gm, [x])
    assert "tl.program_id(0).to(tl.int64)" in compiled.compiled_graph.kernel_source


def test_config_patch_rejects_unknown_options():
    with pytest.raises(AttributeError, match="no option"):
        with config.patch(no_such_option=1):
            pass


def test_unsupported_dtypes_and_empty_tensors_fall_back_cleanly():
    z = torch.randn(4, dtype=torch.complex64)
    (out,), info = compile_and_run(lambda z: (z * 2 + 1,), z)
    torch.testing.assert_close(out, z * 2 + 1)
    assert info["kernels"] == 0 and info["fallbacks"]
    e = torch.randn(0, 3, **f64)
    (out,), _ = compile_and_run(lambda e: (e.exp() + 1,), e)
    assert out.shape == (0, 3)
