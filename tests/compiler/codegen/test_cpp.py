"""The C++ target (codegen/cpp.py, runtime/cpp_launch.py): the generated C++ runs here, against
eager. Each arrangement of the kernel loops (one loop over outputs, rows of a broadcast
operand, tiles of columns, rows split for several reduced dimensions) is checked on sizes that
do and do not fill its tiles; errors eager raises are raised, never a crash or a stray read."""
from __future__ import annotations

import pytest
import torch

from aotforge.compiler import compile_fx_inner
from aotforge.compiler.codegen import cpp, cpp_sums
from aotforge.compiler.runtime import cpp_build
from aotforge.config import config

from ..helpers import trace

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def our_own_math(monkeypatch):
    """These tests are about our kernels' loops and sums: the ops whose eager kernel rounds its
    own way (var, softmax, exp...) are computed by them, not kept as ATen calls (the global
    value: tracing reads it too)."""
    monkeypatch.setattr(config, "cpu_eager_bits", False)


def compile_cpp(fn, *args):
    gm = trace(fn, *args)
    with config.patch(triton_on_cpu=False, cpu_codegen=True):
        compiled = compile_fx_inner(gm, list(args))
    graph = compiled.compiled_graph
    assert graph.path == "cpp" and graph.kernels, graph
    return compiled, graph


def check(fn, *args, **tolerance):
    compiled, graph = compile_cpp(fn, *args)
    actual = compiled([a.clone() for a in args])
    expected = fn(*args)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, equal_nan=True, **tolerance)
    return graph


def f64(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(16, 64), (7, 33)], ids=["fills", "odd"])
def test_pointwise_over_rows_of_a_broadcast_operand(shape):
    graph = check(lambda x, w: ((x * w + 1).exp(), torch.nn.functional.gelu(x - w)), f64(*shape), f64(shape[1]))
    if shape[1] >= 8:  # xindex % C became a loop counter
        assert "for (int64_t x1 = 0; x1 <" in graph.kernel_source


@pytest.mark.parametrize("shape", [(4, 6, 8, 16), (3, 5, 4, 4), (2, 6, 2, 2), (2, 3, 5, 7)],
                         ids=["fills", "rows16", "rows4", "odd"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_pointwise_per_channel_operands_take_rows_not_divisions(shape, layout):
    """``ptr[((xindex / HW) % C)]`` (an NCHW per-channel operand) and NHWC's ``xindex % C``:
    the rows' counters replace the division and the remainder (``_rows_of``), with NaN and
    infinities, channels-last and strided inputs."""
    x = f64(*shape)
    x.view(-1)[::7] = float("nan")
    x.view(-1)[1::11] = float("inf")
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "strided":
        x = f64(shape[0], shape[1], shape[2], 2 * shape[3])[..., ::2]
    mean, scale = f64(shape[1]), f64(shape[1])
    graph = check(lambda x, m, s: (((x - m[:, None, None]) * s[:, None, None]).relu(),), x, mean, scale)
    rows = shape[2] * shape[3] if layout != "channels_last" else shape[1]
    if rows >= 4 and layout == "contiguous":
        assert "/" not in graph.kernel_source.split("for (int64_t x1")[1], graph.kernel_source


@pytest.mark.parametrize("n", [131072, 37])
def test_selects_of_values_one_side_computes_match_eager_without_trapping_math(n):
    """hardswish's and ReLU's backwards select between a computed value and another: built
    without trapping math (so that GCC vectorizes the select), with NaN, infinities, signed
    zeros and the branch points themselves, the results are eager's bit for bit."""
    x = torch.randn(n) * 4
    x[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0, -3.0, 1e-30])
    grad = torch.randn(n)
    grad[8:12] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0])
    relu = torch.relu(x)
    # (hardswish's backward at x = NaN: eager's vectorized kernel gives NaN, its decomposition
    # the gradient, with or without this build flag: left out here)
    fn = lambda g, x, r: (torch.ops.aten.hardswish_backward(g, x.nan_to_num()), torch.ops.aten.threshold_backward(g, r, 0.0),
                          torch.where(x < 1, g / (x - 2), g * 3))
    graph = check(fn, grad, x, relu, rtol=0, atol=0)
    from aotforge.compiler.codegen.cpp import translation_unit
    assert translation_unit([graph.kernels[0].source]).startswith(cpp.NO_TRAPPING_MATH)


@pytest.mark.parametrize("n", [4099, 64])
def test_bool_buffers_load_and_store_as_bytes_like_eager(n):
    """bool buffers are uint8_t pointers in the kernels (so that GCC vectorizes them); every
    bool op still sees 0 or 1: masks written and read back, logical ops, sums and maxima of
    bools, a strided (non-contiguous) bool input, bools padded with False."""
    x = torch.randn(n)
    x[::5] = float("nan")
    m = torch.rand(2 * n) > 0.5
    fn = lambda x, m: (x.relu() <= 0, ~m[::2], m[::2] ^ (x > 0), (m[::2] | (x < 0)).sum(), m[::2].amax(),
                       torch.where(m[::2], x, -x), torch.nn.functional.pad(m[::2], (3, 2)), m[::2].to(torch.float32) * 2)
    check(fn, x, m)


@pytest.mark.parametrize("shape", [(8, 256), (3, 5)], ids=["long", "short"])
def test_row_reductions(shape):
    graph = check(lambda x: (x.sum(1), x.amax(1), x.argmax(1), torch.softmax(x, 1), x.var(1)), f64(*shape))
    # floating sums walk their rows in eager's cascade order (cpp_sums.py), also beside an argmax
    kernels = "\n".join(kernel.source for kernel in graph.kernels)
    assert kernels.count("aot_cascade_row<") >= 2, kernels  # (the var's, and the sum's beside the argmax)


@pytest.mark.parametrize("columns", [128, 100, 5])
def test_reductions_down_columns_walk_tiles_of_columns(columns):
    graph = check(lambda x, y: ((x * y).sum(0), x.amax(0), (x - 1).exp().sum(0)), f64(300, columns), f64(300, columns))
    assert "const int64_t xcount = std::min<int64_t>(64," in graph.kernel_source  # tiles of columns, accumulators as arrays


def test_reduction_over_several_dimensions_splits_its_rows():
    graph = check(lambda x: (x.sum((0, 2, 3)), x.var((0, 2, 3))), f64(4, 6, 10, 12))
    # each row of 120 summed in eager's order (the inner loop over r1), the rows' sums in a cascade
    lanes = cpp_sums.VECTOR_BYTES // 8  # (float64 lanes of a vector)
    assert f"aot_cascade_row<{lanes}, 1>(120, " in graph.kernel_source and "_cascade(4);" in graph.kernel_source


def test_nan_propagates_through_max_and_argmax_as_eager():
    x = f64(4, 40)
    x[1, 7] = float("nan")
    x[2, 0] = float("nan")
    check(lambda x: (x.amax(1), x.argmax(1), x.amin(0), x.argmin(0)), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_load_store_and_round_as_eager(dtype):
    x, w = torch.randn(16, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    check(lambda x, w: ((x * w).sigmoid(), (x + w).sum(1), x.float() * 2, (x * 3).to(torch.float32)), x, w)


def test_small_integers_wrap_and_divide_as_eager():
    x = torch.randint(-128, 127, (64,), dtype=torch.int8)
    y = torch.randint(1, 9, (64,), dtype=torch.int8) * torch.where(torch.rand(64) > 0.5, 1, -1).to(torch.int8)
    big = torch.tensor([-2**63, 5, -7, 2**62], dtype=torch.int64)  # (eager's own INT64_MIN / -1 traps)
    minus = torch.tensor([3, -1, -2, -1], dtype=torch.int64)
    check(lambda x, y, a, b: (x * y, x + x, torch.div(x, y, rounding_mode="floor"), torch.remainder(x, y),
                              torch.div(a, b, rounding_mode="trunc"), torch.remainder(a, b)), x, y, big, minus)


def test_integer_division_by_zero_raises_as_eager():
    x, y = torch.arange(8), torch.tensor([1, 2, 0, 4, 5, 6, 7, 8])
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.div(x, y, rounding_mode="floor")
    compiled, _ = compile_cpp(lambda x, y: (torch.remainder(x * 3, y),), x, y)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        compiled([x, y])
    torch.testing.assert_close(compiled([x, y + 1])[0], torch.remainder(x * 3, y + 1))


def test_an_index_out_of_bounds_raises_instead_of_reading_memory():
    table, index = f64(10, 4), torch.tensor([0, 3, 9])
    compiled, _ = compile_cpp(lambda t, i: (t[i] * 2,), table, index)
    torch.testing.assert_close(compiled([table, index])[0], table[index] * 2)
    for bad in (torch.tensor([0, 10, 1]), torch.tensor([-11, 0, 0]), torch.tensor([2**40, 0, 0])):
        with pytest.raises(IndexError, match="out of bounds for dimension 0 with size 10"):  # eager's error
            compiled([table, bad])
    torch.testing.assert_close(compiled([table, torch.tensor([-1, -10, 2])])[0], table[torch.tensor([-1, -10, 2])] * 2)


def test_random_draws_equal_the_reference_bit_for_bit():
    from aotforge import philox

    seed = torch.tensor(1234, dtype=torch.int64)
    compiled, _ = compile_cpp(lambda s: (philox.philox_rand(s, 77, [5, 33], torch.float32) * 2,), seed)
    expected = philox.philox_rand_reference(seed, 77, [5, 33], torch.float32) * 2
    assert torch.equal(compiled([seed])[0], expected)


def test_kernel_source_golden_text():
    """The form of one fused pointwise kernel: an ``extern "C"`` function of pointers and
    sizes, the rows of the broadcast operand as two loops, one statement per value."""
    _, graph = compile_cpp(lambda x, w: ((x + w).relu(),), f64(4, 16), f64(16))
    (kernel,) = graph.kernels
    body = kernel.source.split("\n", 1)[1]
    assert body == """\
    int aot_error = 0;
    #pragma omp parallel for if(xnumel >= 32768) num_threads(aot_num_threads)
    for (int64_t x0 = 0; x0 < 4; ++x0) {
        for (int64_t x1 = 0; x1 < 16; ++x1) {
            const int64_t xindex = x0 * 16 + x1;
            constexpr bool xmask = true;
            auto tmp0 = ((xmask) ? ptr0[xindex] : 0);
            auto tmp1 = ((xmask) ? ptr1[x1] : 0);
            auto tmp2 = static_cast<double>(tmp0 + tmp1);
            auto tmp3 = static_cast<double>((tmp2 < 0 ? double(0) : tmp2));
            if (xmask) ptr2[xindex] = tmp3;
        }
    }
    return aot_error;
}"""
    assert kernel.source.startswith(f'extern "C" int {kernel.name}(double* ptr0, double* ptr1, double* ptr2, '
                                    'int64_t xnumel) {')


def test_dynamic_sizes_are_arguments():
    from torch._dynamo import mark_dynamic

    def fn(x, w):
        return torch.softmax(x * w, -1).sum(0)

    from aotforge.compiler.pipeline import observe

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aotforge", dynamic=True)
    with config.patch(cpu_codegen=True), observe() as graphs:
        for rows, cols in [(6, 20), (9, 20), (5, 33)]:
            x, w = f64(rows, cols), f64(cols)
            mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x, w), fn(x, w))
    # one C++ graph serves every size: the sizes are its kernels' arguments
    assert [g.path for g in graphs] == ["cpp"] and any(k.dynamic for k in graphs[0].kernels), graphs


def test_a_cpp_build_failure_keeps_eager_kernels_and_says_so(monkeypatch):
    from aotforge.compiler.runtime import cpp_build as build

    def refuse(source, stem, prelude=""):
        raise build.CppCompileError("aotforge: compiling the C++ kernels of aot_graph failed (a test)")

    monkeypatch.setattr(build, "load_library", refuse)
    x, w = f64(8, 16), f64(16)
    gm = trace(lambda x, w: ((x * w).exp(),), x, w)
    with config.patch(triton_on_cpu=False, cpu_codegen=True), pytest.warns(UserWarning, match="runs as ATen calls"):
        compiled = compile_fx_inner(gm, [x, w])
    assert compiled.compiled_graph.path == "aten"
    torch.testing.assert_close(compiled([x, w])[0], (x * w).exp())


def test_two_threads_calling_one_graph_keep_their_errors_apart():
    """ctypes lets go of the GIL: a call that meets a bad index raises, one that does not never
    does, however the two interleave (each call has its own error flag)."""
    import threading

    table = f64(64, 256)
    good, bad = torch.randint(0, 64, (512,)), torch.full((512,), 64)
    compiled, _ = compile_cpp(lambda t, i: ((t[i] * 2).sum(1),), table, good)
    outcomes = {"good": [], "bad": []}

    def call(name, index):
        for _ in range(200):
            try:
                compiled([table, index])
                outcomes[name].append("ok")
            except IndexError:
                outcomes[name].append("raised")

    threads = [threading.Thread(target=call, args=("good", good)), threading.Thread(target=call, args=("bad", bad))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(outcomes["good"]) == {"ok"} and set(outcomes["bad"]) == {"raised"}, outcomes


@pytest.mark.parametrize("shape", [(8, 240, 4, 4), (3, 37, 9, 9), (2, 300, 3, 3), (2, 16, 32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_means_over_an_nhwc_image_walk_each_image_s_columns_bit_for_bit(shape, dtype):
    """A mean over H and W of an NHWC image (squeeze-excite, global pooling) reduces down columns
    of C channels: each image's columns are walked as tiles of their own, so that the loads
    vectorize (no per-element ``xindex / C``: 6x eager's time before) and each image takes ATen's
    column groups, which makes the sums eager's bit for bit (before: columns past the last
    group of 32 summed in another order, a few ulps off), NaN and inf included."""
    x = torch.randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    x[0, 1, 0, 0] = float("nan")
    x[-1, 2, -1, 0] = float("inf")
    fn = lambda x: (torch.nn.functional.hardswish(x).mean((2, 3), keepdim=True), x.sum((2, 3)))
    compiled, graph = compile_cpp(fn, x)
    for got, expected in zip(compiled([x]), fn(x)):
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(0.0), expected.nan_to_num(0.0))
    assert f"(xindex / {shape[1]})" not in graph.kernel_source and "aot_row" in graph.kernel_source


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_maximum_minimum_and_clamps_keep_eager_s_nan_and_signed_zeros(dtype):
    """NaN-aware max and min (two selects since they were a short-circuit ``||``, which GCC left
    scalar): NaN on either side wins, ties and signed zeros as eager's, bit for bit."""
    special = torch.tensor([float("nan"), 0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), 3.0], dtype=dtype)
    a = special.repeat_interleave(len(special))
    b = special.repeat(len(special))
    fn = lambda a, b: (torch.maximum(a, b), torch.minimum(a, b), a.clamp(-0.5, 2.0), torch.relu(a),
                       torch.nn.functional.hardswish(a), torch.nn.functional.max_pool1d(torch.stack([a, b], 1)[None], 2)[0])
    compiled, _ = compile_cpp(fn, a, b)
    for got, expected in zip(compiled([a, b]), fn(a, b)):
        assert torch.equal(got.isnan(), expected.isnan())
        numbers = ~expected.isnan()  # (a NaN's sign bit is not a value: eager's vector max sets it)
        assert torch.equal(torch.signbit(got[numbers]), torch.signbit(expected[numbers]))
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
