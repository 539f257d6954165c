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
        # the path asked for (the C++ path's graphs have kernels)
        assert all(g.path == ("cpp" if path == "cpp" else "aten") for g in graphs), graphs
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
