"""Indices read from tensors in generated Triton kernels (issue 37): a negative or out-of-range
index raises eager's exception and message, never wraps like Python indexing (the Triton path
returned x[-1] for ``index_select(0, [-1])``, where eager raises IndexError).

Run here in Triton's interpreter (TRITON_INTERPRET=1, no GPU), whose ``aot_check_index`` raises
eager's error; on a GPU the same call is a device assert (eager's CUDA kernels assert too), which
Triton compiles only into kernels built with debug on: launch.py asks for it for the kernels
that check indices, with debug's integer-overflow checks off."""
from __future__ import annotations

import re

import pytest
import torch

from aotforge.compiler import compile_fx_inner
from aotforge.compiler.codegen.triton import CHECKS_INDICES, module_prelude
from aotforge.config import config

from ..helpers import trace

TABLE = torch.randn(5, 3, dtype=torch.float64)
INDEX_OPS = {
    "index_select": lambda t, i: (t.index_select(0, i) * 2,),
    "index_select_dim1": lambda t, i: (t.index_select(1, i) + 1,),
    "gather": lambda t, i: (t.gather(0, i.view(-1, 1).expand(-1, 3)) * 2,),
    "embedding": lambda t, i: (torch.nn.functional.embedding(i, t) * 2,),
    "advanced_indexing": lambda t, i: (t[i] * 2,),
}
BAD = {"negative": [0, -1], "too_large": [1, 5], "very_negative": [-6, 0]}


def _compile_triton(fn, *args):
    gm = trace(fn, *args)
    with config.patch(triton_on_cpu=True):
        compiled = compile_fx_inner(gm, list(args))
    graph = compiled.compiled_graph
    assert graph.path == "triton" and graph.kernels, graph
    return compiled, graph


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("op", list(INDEX_OPS))
def test_bad_index_raises_eagers_error_in_a_triton_kernel(op, bad):
    fn = INDEX_OPS[op]
    compiled, graph = _compile_triton(fn, TABLE, torch.tensor([0, 2]))
    assert CHECKS_INDICES in graph.kernel_source
    torch.testing.assert_close(compiled([TABLE, torch.tensor([0, 2])])[0], fn(TABLE, torch.tensor([0, 2]))[0])
    index = torch.tensor(BAD[bad])
    try:
        expected = fn(TABLE, index)
    except Exception as error:  # noqa: BLE001  (the oracle: whatever eager raises)
        with pytest.raises(type(error), match=re.escape(str(error).splitlines()[0])) as caught:
            compiled([TABLE, index])
        assert type(caught.value) is type(error)
    else:  # advanced indexing: a negative index counts from the end
        torch.testing.assert_close(compiled([TABLE, index])[0], expected[0])


def test_kernels_that_check_indices_are_built_with_device_asserts():
    """The GPU's half, checked without a GPU: the helper asserts, and the launcher of a kernel
    that calls it asks Triton for debug (asserts compiled in) without overflow checks."""
    prelude = module_prelude(interpret=False)
    assert "def aot_check_index(" in prelude and "tl.device_assert(" in prelude
    _, graph = _compile_triton(INDEX_OPS["gather"], TABLE, torch.tensor([0, 2]))
    launchers = list(graph.launchers.values())
    assert launchers and all(c.get("debug") is True and c.get("sanitize_overflow") is False
                             for launcher in launchers for c in launcher.configs)
    _, plain = _compile_triton(lambda t, i: (t * 2 + 1,), TABLE, torch.tensor([0, 2]))
    assert all("debug" not in c for launcher in plain.launchers.values() for c in launcher.configs)
