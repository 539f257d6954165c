"""A C++ graph's entry (codegen/cpp_entry.py, runtime/cpp_launch.py): the wrapper runs each run of
consecutive kernels as one call into the translation unit. A run stops at its first failing
kernel, which raises its own error as a lone launch did (eager's exception and message, naming
the kernel), and a call that does not match the graph's kernels is refused, never run."""
from __future__ import annotations

import pytest
import sympy
import torch

from aotforge.compiler import compile_fx_inner
from aotforge.compiler.codegen import wrapper
from aotforge.compiler.codegen.kernel import KernelSource
from aotforge.compiler.runtime import cpp_build, cpp_launch
from aotforge.config import config

from ..helpers import trace

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")

# three hand-written kernels: add one; fail with error 1 when its first element is negative;
# double (whose output shows whether it ran)
SOURCES = {
    "aot_test_add": 'extern "C" int aot_test_add(float* p0, float* p1, int64_t xnumel) '
                    '{ for (int64_t i = 0; i < xnumel; ++i) p1[i] = p0[i] + 1; return 0; }',
    "aot_test_fail": 'extern "C" int aot_test_fail(float* p0, int64_t xnumel) { return p0[0] < 0 ? 1 : 0; }',
    "aot_test_double": 'extern "C" int aot_test_double(float* p0, float* p1, int64_t xnumel) '
                       '{ for (int64_t i = 0; i < xnumel; ++i) p1[i] = p0[i] * 2; return 0; }',
}


def kernel(group: str, name: str, arguments: tuple, numel=4) -> KernelSource:
    return KernelSource(group, name, SOURCES[name], arguments, (torch.float32,) * len(arguments), numel, 1,
                        "pointwise", False, True, language="cpp")


def three_kernels(numel=4):
    return (kernel("kernel0", "aot_test_add", ("x", "y"), numel), kernel("kernel1", "aot_test_fail", ("y",), numel),
            kernel("kernel2", "aot_test_double", ("y", "z"), numel))


@pytest.fixture(params=["entry", "one by one"])
def launch(request, monkeypatch):
    """The graph's launch and error, through the entry or (no entry) each kernel's ctypes call."""
    monkeypatch.setattr(cpp_launch, "USE_ENTRY", request.param == "entry")

    def make(kernels):
        launchers = cpp_launch.load_kernels(kernels)
        assert (next(iter(launchers.values())).entry is not None)  # this interpreter can make the builtin
        return cpp_launch.graph_entry(kernels, launchers)
    return make


def run(launch_kernels, kernel_error, *arguments):
    if code := launch_kernels(*arguments):
        raise kernel_error(code)


def test_a_run_computes_what_its_kernels_compute_in_order(launch):
    x, y, z = torch.arange(4.0), torch.zeros(4), torch.zeros(4)
    run(*launch(three_kernels()), 0, x, y, 1, y, 2, y, z)
    torch.testing.assert_close(z, (x + 1) * 2)


def test_a_run_stops_at_a_failing_kernel_in_its_middle_and_names_it(launch):
    x, y, z = torch.full((4,), -5.0), torch.zeros(4), torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"ZeroDivisionError.*aot_test_fail"):
        run(*launch(three_kernels()), 0, x, y, 1, y, 2, y, z)
    torch.testing.assert_close(y, x + 1)  # the first ran
    assert not z.any()  # the third never did


def test_symbolic_sizes_are_passed_after_the_tensors(launch):
    x, y, z = torch.arange(6.0), torch.zeros(6), torch.zeros(6)
    run(*launch(three_kernels(numel=sympy.Symbol("s0"))), 0, x, y, 6, 1, y, 6, 2, y, z, 6)
    torch.testing.assert_close(z, (x + 1) * 2)


def test_a_call_that_does_not_match_the_graph_is_refused():
    launch_kernels, kernel_error = cpp_launch.graph_entry(three_kernels(), cpp_launch.load_kernels(three_kernels()))
    x, y = torch.zeros(4), torch.zeros(4)
    for arguments in [(3, x, y), (0, x)]:  # no such kernel; too few arguments
        assert launch_kernels(*arguments) == -1
        with pytest.raises(RuntimeError, match="does not match the graph's kernels"):
            raise kernel_error(-1)
    with pytest.raises(AttributeError, match="data_ptr"):  # not a tensor
        launch_kernels(0, 1, y)
    with pytest.raises(TypeError):
        launch_kernels("0", x, y)
    assert not y.any()  # nothing ran


def gathers_in_the_middle(x, y, t, i):
    s = (x * 3).sum(1)  # a row reduction
    c = torch.div(x + s[:, None], y, rounding_mode="floor").sum(0)  # an ATen division, a column sum
    g = (t[i] * c[:4]).sum(1)  # gathers: the run's middle kernel
    return c * 2, (g[:, None] * t[:3]).sum(0)  # another column sum: the run's last


@pytest.fixture
def our_own_math(monkeypatch):
    monkeypatch.setattr(config, "cpu_eager_bits", False)


def test_an_index_out_of_bounds_in_the_middle_of_a_run_raises_as_eager(our_own_math):
    x, y = torch.randint(0, 9, (8, 8)), torch.randint(1, 5, (8,))
    t, i = torch.randn(10, 4, dtype=torch.float64), torch.tensor([0, 3, 9])
    gm = trace(gathers_in_the_middle, x, y, t, i)
    with config.patch(triton_on_cpu=False, cpu_codegen=True):
        compiled = compile_fx_inner(gm, [x, y, t, i])
    runs = [line for line in compiled.compiled_graph.wrapper_source.splitlines() if "launch_kernels(" in line]
    assert any(line.count(", i_1, t_1,") for line in runs) and max(len(line.split(", buf")) for line in runs) >= 6
    for actual, expected in zip(compiled([x, y, t, i]), gathers_in_the_middle(x, y, t, i)):
        torch.testing.assert_close(actual, expected)
    with pytest.raises(IndexError, match="index 10 is out of bounds for dimension 0 with size 10"):
        compiled([x, y, t, torch.tensor([0, 10, 1])])
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):  # the ATen call between two runs
        compiled([x, torch.zeros_like(y), t, i])
    for actual, expected in zip(compiled([x, y, t, i]), gathers_in_the_middle(x, y, t, i)):
        torch.testing.assert_close(actual, expected)


def test_the_wrapper_without_runs_computes_the_same(monkeypatch, our_own_math):
    monkeypatch.setattr(wrapper, "RUN_KERNELS_TOGETHER", False)
    x, y = torch.randint(0, 9, (8, 8)), torch.randint(1, 5, (8,))
    t, i = torch.randn(10, 4, dtype=torch.float64), torch.tensor([0, 3, 9])
    with config.patch(triton_on_cpu=False, cpu_codegen=True):
        compiled = compile_fx_inner(trace(gathers_in_the_middle, x, y, t, i), [x, y, t, i])
    assert "launch_kernels" not in compiled.compiled_graph.wrapper_source
    for actual, expected in zip(compiled([x, y, t, i]), gathers_in_the_middle(x, y, t, i)):
        torch.testing.assert_close(actual, expected)
