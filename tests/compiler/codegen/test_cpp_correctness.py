"""The C++ path against eager where it was wrong or stuck (issue 37): bad indices raise eager's
exception and message; float32 sums as close to float64 as eager's; the fuzzer's edge cases
(floor division by infinity, empty softmax, bool amin/amax, NaN cast to int64). Each case runs
on the C++ path and, where it concerns the graph, on the ATen path (cpu_codegen off) too."""
from __future__ import annotations

import re

import pytest
import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler import observe
from aotforge.compiler.runtime import cpp_build
from aotforge.config import config

from .test_cpp import compile_cpp

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn, path: str):
    """``fn`` under torch.compile on one CPU path: "cpp" (C++ kernels) or "aten"."""
    compiled = torch.compile(fn, backend="aotforge", dynamic=False)

    def run(*args):
        with config.patch(cpu_codegen=(path == "cpp")), observe() as graphs:
            result = compiled(*args)
        # the path asked for (a generated program, with C++ kernels unless it has only ATen calls)
        if path == "cpp":
            assert all(g.program is not None and (g.path == "cpp" or not g.kernels) for g in graphs), graphs
        else:
            assert all(g.path == "aten" for g in graphs), graphs
        return result
    return run


def _eager_error(fn, *args) -> BaseException:
    with pytest.raises(Exception) as caught:
        fn(*args)
    return caught.value


# --- indices read from tensors ---------------------------------------------------------------

TABLE = torch.randn(5, 3, dtype=torch.float64)
INDEX_OPS = {
    "index_select": lambda t, i: (t.index_select(0, i) * 2,),
    "index_select_dim1": lambda t, i: (t.index_select(1, i) + 1,),
    "gather": lambda t, i: (t.gather(0, i.view(-1, 1).expand(-1, 3)) * 2,),
    "gather_dim1": lambda t, i: (t.gather(1, i.view(1, -1).expand(5, -1)) * 2,),
    "embedding": lambda t, i: (torch.nn.functional.embedding(i, t) * 2,),
    "advanced_indexing": lambda t, i: (t[i] * 2,),
}
BAD = {"negative": [0, -1], "too_large": [1, 5], "very_negative": [-6, 0], "huge": [2**40, 0]}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("op", list(INDEX_OPS))
@pytest.mark.parametrize("path", ["cpp", "aten"])
def test_bad_index_raises_eagers_error(op, bad, path):
    fn = INDEX_OPS[op]
    index = torch.tensor(BAD[bad])
    compiled = _compiled(fn, path)
    torch.testing.assert_close(compiled(TABLE, torch.tensor([0, 2])), fn(TABLE, torch.tensor([0, 2])))
    try:
        expected = fn(TABLE, index)
    except Exception as error:  # noqa: BLE001  (the oracle: whatever eager raises)
        with pytest.raises(type(error), match=re.escape(str(error).splitlines()[0])) as caught:
            compiled(TABLE, index)
        assert type(caught.value) is type(error)
    else:  # advanced indexing: a negative index counts from the end
        torch.testing.assert_close(compiled(TABLE, index), expected)


def test_bad_index_in_a_cpp_kernel_reports_eagers_message():
    """The C++ kernel itself (not an ATen fallback) finds the index and says what eager says."""
    fn = INDEX_OPS["gather"]
    compiled, graph = compile_cpp(fn, TABLE, torch.tensor([0, 2]))
    assert "aot_check_index" in graph.kernel_source
    error = _eager_error(fn, TABLE, torch.tensor([0, -1]))
    with pytest.raises(RuntimeError, match=re.escape(str(error))):
        compiled([TABLE, torch.tensor([0, -1])])
    compiled, _ = compile_cpp(INDEX_OPS["embedding"], TABLE, torch.tensor([0, 2]))
    with pytest.raises(IndexError, match="^index out of range in self$"):
        compiled([TABLE, torch.tensor([-1, 0])])


# --- the fuzzer's edge cases -----------------------------------------------------------------

def _same_as_eager(fn, *args, path: str = "cpp") -> None:
    """``fn`` compiled gives eager's values bit for bit (NaN where eager's is), dtype and shape,
    with no warning (a graph that fell back to ATen calls warns); where Dynamo itself refuses
    the function (``backend="eager"`` raises too), ours raises the same."""
    expected = fn(*args)
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend="eager", dynamic=False)(*args)
    except Exception as refused:  # noqa: BLE001  (Dynamo's own refusal: before any backend)
        torch._dynamo.reset()
        with pytest.raises(type(refused)):
            _compiled(fn, path)(*args)
        return
    torch._dynamo.reset()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = _compiled(fn, path)(*args)
    assert not [str(w.message) for w in caught if "aotforge" in str(w.message)]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.isnan(), expected.isnan()) if expected.is_floating_point() else True
    same = actual.eq(expected) | (actual.isnan() & expected.isnan() if expected.is_floating_point() else False)
    assert bool(same.all()), (actual, expected)
    if expected.is_floating_point():  # -0.0 and 0.0 apart (a NaN's sign is not compared)
        assert torch.equal(actual.signbit() & ~actual.isnan(), expected.signbit() & ~expected.isnan()), \
            (actual, expected)


INF = float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_floor_division_with_infinities_follows_python(dtype):
    a = torch.tensor([-5.0, 5.0, INF, -INF, 0.0, -0.0, 3.0, 7.5, -7.5, 1.0, float("nan")], dtype=dtype)
    b = torch.tensor([INF, -INF, 2.0, 2.0, INF, 3.0, -INF, -2.0, 2.0, 0.0, 1.0], dtype=dtype)
    _same_as_eager(lambda x, y: x // y, a, b)
    _same_as_eager(lambda x, y: torch.div(x, y, rounding_mode="floor") * 2, a, b)


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("path", ["cpp", "aten"])
def test_softmax_of_an_empty_integer_or_bool_tensor(op, dtype, shape, path):
    fn = getattr(torch, op)
    _same_as_eager(lambda x: fn(x, -1), torch.empty(shape, dtype=dtype), path=path)


@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_amin_amax_over_bool_compile_to_cpp(reduce):
    x = torch.rand(6, 70) > 0.9
    x[2] = False
    x[3] = True
    for dim in (0, 1):  # along rows, and down columns (tiles of columns)
        _same_as_eager(lambda t: getattr(t, reduce)(dim), x)
        compile_cpp(lambda t: (getattr(t, reduce)(dim),), x)  # (asserts the graph got C++ kernels)
    _same_as_eager(lambda t: t.max() | ~t.min(), x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_nan_and_out_of_range_floats_cast_to_integers_as_eager(dtype):
    x = torch.zeros(5)
    # a NaN constant (folded by the C++ compiler before: 0), a NaN chosen per element, and
    # values out of every integer type's range
    _same_as_eager(lambda t: t.to(dtype) + torch.full_like(t, float("nan")).to(dtype), x)
    _same_as_eager(lambda t: torch.where(t > 0, t, float("nan")).to(dtype), x)
    values = torch.tensor([float("nan"), INF, -INF, 300.0, -300.0, 1e10, -1e10, 3e9, 2.0**63, -2.0**63, 7.9])
    _same_as_eager(lambda t: (t * 1).to(dtype), values)
    _same_as_eager(lambda t: (t * 1).to(dtype), values.double())


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8, torch.int16])
def test_max_and_min_of_narrow_types_read_through_masks(dtype):
    """A masked load of a type narrower than int (``m ? ptr[i] : 0``) is an int in C++; max and
    min of it and a value of its own type did not compile (found by test_cpp_fuzz.py)."""
    t = torch.randint(0, 100, (6, 70)).to(dtype)

    def fn(a):
        return (a.unsqueeze(0).expand(2, 6, 70).amax(1), torch.maximum(a, a[:1].expand(6, 70)),
                torch.minimum(a.flip(0), a), a.amin(0))

    compiled, _ = compile_cpp(fn, t)
    for have, want in zip(compiled([t]), fn(t)):
        assert have.dtype == want.dtype and torch.equal(have, want)
