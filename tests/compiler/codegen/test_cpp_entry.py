"""A C++ graph's entry (codegen/cpp_entry.py, runtime/cpp_launch.py): the wrapper runs each run of
consecutive kernels as one call into the translation unit. A run stops at its first failing
kernel, which raises its own error as a lone launch did (eager's exception and message, naming
the kernel), and a call that does not match the graph's kernels is refused, never run."""
from __future__ import annotations

from types import SimpleNamespace

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


def gathers_in_the_middle(t, i):
    c = (t * 2).sum(0)  # a column sum
    g = (t[i] * c).sum(1)  # gathers, a row sum: the run's middle kernel
    return c, (g[:, None] * t[i]).sum(0) + c  # gathers again, a column sum: the run's last


def division_between_runs(x, y, t, i):
    s = (x * 3).sum(1)  # a row reduction
    c = torch.div(x + s[:, None], y, rounding_mode="floor").sum(0)  # an ATen division, a column sum
    g = (t[i] * c[:4]).sum(1)
    return c * 2, (g[:, None] * t[:3]).sum(0)


@pytest.fixture
def our_own_math(monkeypatch):
    monkeypatch.setattr(config, "cpu_eager_bits", False)


def compile_cpp(fn, *args):
    with config.patch(triton_on_cpu=False, cpu_codegen=True):
        return compile_fx_inner(trace(fn, *args), list(args))


def test_an_index_out_of_bounds_in_the_middle_of_a_run_raises_as_eager(our_own_math):
    t, i = torch.randn(10, 4, dtype=torch.float64), torch.tensor([0, 3, 9])
    compiled = compile_cpp(gathers_in_the_middle, t, i)
    runs = [line for line in compiled.compiled_graph.wrapper_source.splitlines() if "launch_kernels(" in line]
    assert len(runs) == 1 and "launch_kernels(0, t_1, buf0, 1, i_1, t_1, buf0, buf1, 2, " in runs[0], runs
    torch.testing.assert_close(compiled([t, i]), gathers_in_the_middle(t, i))
    with pytest.raises(IndexError, match="index 10 is out of bounds for dimension 0 with size 10"):
        compiled([t, torch.tensor([0, 10, 1])])
    torch.testing.assert_close(compiled([t, i]), gathers_in_the_middle(t, i))


@pytest.mark.parametrize("together", [True, False], ids=["runs", "one call per kernel"])
def test_an_aten_error_between_runs_raises_and_results_equal_eager(together, monkeypatch, our_own_math):
    monkeypatch.setattr(wrapper, "RUN_KERNELS_TOGETHER", together)
    x, y = torch.randint(0, 9, (8, 8)), torch.randint(1, 5, (8,))
    t, i = torch.randn(10, 4, dtype=torch.float64), torch.tensor([0, 3, 9])
    compiled = compile_cpp(division_between_runs, x, y, t, i)
    assert ("launch_kernels" in compiled.compiled_graph.wrapper_source) == together
    torch.testing.assert_close(compiled([x, y, t, i]), division_between_runs(x, y, t, i))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        compiled([x, torch.zeros_like(y), t, i])
    with pytest.raises(IndexError, match="out of bounds"):
        compiled([x, y, t, torch.tensor([0, 10, 1])])
    torch.testing.assert_close(compiled([x, y, t, i]), division_between_runs(x, y, t, i))


def test_a_run_ends_where_a_new_buffer_follows_a_free():
    """Frees wait for a run's end; a run that went on would allocate before them, and the
    allocator could not hand the freed memory on as the memory plan meant."""
    from aotforge.compiler.schedule import KernelGroup

    kernels = [object.__new__(KernelGroup) for _ in range(5)]
    steps = [kernels[0], kernels[1], kernels[2], "an ATen call", kernels[3], kernels[4]]
    fresh, reuse = SimpleNamespace(reuses=None, buffer="new"), SimpleNamespace(reuses="buf0", buffer="buf2")
    memory = SimpleNamespace(allocations={0: [fresh], 1: [fresh], 2: [fresh], 4: [fresh], 5: [reuse]},
                             frees={1: ["buf0"], 4: ["buf1"]})
    large = _buffer((64, 64), torch.float32)
    buffers = {"buf0": large, "buf1": large, "buf2": large, "new": large}
    assert wrapper._kernel_runs(steps, memory, buffers) == {0: 2, 2: 3, 4: 6}
    # a small free (a counter's old value) or a small new buffer does not end a run
    for small in ("buf0", "new"):
        sizes = dict(buffers, **{small: _buffer((), torch.int64)})
        assert wrapper._kernel_runs(steps, memory, sizes) == {0: 3, 4: 6}, small
    # a buffer of unknown (symbolic) size counts as large
    symbolic = dict(buffers, buf0=_buffer((sympy.Symbol("s0"),), torch.int64), new=_buffer((), torch.int64))
    assert wrapper._kernel_runs(steps, memory, symbolic) == {0: 3, 4: 6}
    symbolic = dict(buffers, buf0=_buffer((sympy.Symbol("s0"),), torch.int64))
    assert wrapper._kernel_runs(steps, memory, symbolic) == {0: 2, 2: 3, 4: 6}


def _buffer(size, dtype):
    return SimpleNamespace(layout=SimpleNamespace(size=list(size)), dtype=dtype)
