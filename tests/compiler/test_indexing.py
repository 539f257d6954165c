"""Index arithmetic (compiler/expr.py, compiler/indexing.py): the integer-division forms are
exact for every value, and the pieces a view splits an index into merge back, so that the
fusion pass sees a read of the element a kernel writes as that element."""
from __future__ import annotations

import random

import pytest
import sympy
import torch

from aotforge.compiler.expr import FloorDiv, ModularIndexing
from aotforge.compiler.indexing import XINDEX, simplify_index
from .helpers import compile_and_run

x = XINDEX


def _value(expr, at: int) -> int:
    return int(expr.subs(x, at))


def test_nested_divisions_take_one_form_and_keep_their_value():
    rng = random.Random(0)
    for _ in range(500):
        b, d, m = rng.randrange(1, 40), rng.randrange(1, 40), rng.randrange(1, 40)
        k = rng.choice([q for q in range(1, m + 1) if m % q == 0])
        at = rng.randrange(0, 10 ** 6)
        nested = ModularIndexing(FloorDiv(x, b), d, m)  # ((x // b) // d) % m
        assert m == 1 or (isinstance(nested, ModularIndexing) and nested.args[0] == x)
        assert _value(nested, at) == (at // b // d) % m
        assert _value(FloorDiv(ModularIndexing(x, d, m), k), at) == ((at // d) % m) // k


def test_a_split_index_merges_back():
    # BERT's softmax backward: a [192, 512, 512] pointwise kernel read its [16, 12, 512] row
    # sums through the view's pieces; with i0 = x // 512 and i1 = x % 512 that is x itself
    i0, i1 = FloorDiv(x, 512), ModularIndexing(x, 1, 512)
    assert simplify_index(i1 + 6144 * FloorDiv(i0, 12) + 512 * ModularIndexing(i0, 1, 12)) == x
    three = (262144 * ModularIndexing(x, 262144, 12) + 3145728 * FloorDiv(x, 3145728)
             + ModularIndexing(x, 1, 262144))
    assert simplify_index(three) == x
    # pieces that do not cover the whole range stay apart
    kept = 6144 * FloorDiv(i0, 12) + ModularIndexing(i0, 1, 12)
    assert simplify_index(kept) != FloorDiv(x, 512)
    for at in range(0, 10 ** 6, 9973):
        assert _value(simplify_index(kept), at) == 6144 * (at // 512 // 12) + (at // 512) % 12



def test_a_split_index_over_symbolic_sizes_merges_back():
    """A pooled side ``h = FloorDiv(s, 4)`` in a coefficient is a size, not a second division of
    the index; torch's contiguous strides ``Max(1, h)`` are ``h`` where the index divides by h
    (the division is only computed for h >= 1). Both kept the conv net's ReLU + mean under
    symbolic sizes at two divisions per element."""
    s = sympy.Symbol("s34", integer=True, positive=True)
    h, r = FloorDiv(s, 4), sympy.Symbol("rindex", integer=True, nonnegative=True)
    assert simplify_index(128 * h * FloorDiv(r, h) + 128 * ModularIndexing(r, 1, h) + x) == 128 * r + x
    wide = sympy.Max(1, h)
    assert simplify_index(wide * FloorDiv(r, h) + ModularIndexing(r, 1, h) + x * wide ** 2) == r + x * h ** 2
    assert simplify_index(x * wide) == x * wide  # (no division by h: h may be 0, the stride 1)

@pytest.mark.parametrize("triton", [False, True], ids=["cpp", "triton"])
def test_softmax_backward_through_a_view_is_one_kernel(triton):
    """The row sum and the pointwise that reads it through a view (then a cast) share a kernel
    (two before: the pointwise was refused as a read of another element)."""

    def fn(a, b, y, w):
        g = torch.bmm(a, b).view(2, 3, 8, 16)
        s = (g * y).sum(-1, keepdim=True)
        return (torch.bmm((g * y - y * s).view(6, 8, 16).float(), w),)

    args = [torch.randn(6, 8, 5, dtype=torch.float64), torch.randn(6, 5, 16, dtype=torch.float64),
            torch.rand(2, 3, 8, 16, dtype=torch.float64), torch.randn(6, 16, 4)]
    outputs, stats = compile_and_run(fn, *args, triton=triton)
    torch.testing.assert_close(outputs[0], fn(*args)[0])
    assert stats["kernels"] == 1, stats



def test_max_and_min_of_sizes_print_in_each_syntax():
    """A pooled size (``max(1, s0 // 2)``) prints as Python's and Triton's ``max`` and as
    C++'s ``std::max<int64_t>``; before, such a graph ran as ATen calls."""
    from aotforge.compiler.codegen.kernel import print_index

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    size = sympy.Max(1, FloorDiv(s0, 2))
    assert print_index(size, "//") == "max(1, (s0 // 2))"
    assert print_index(size, "/") == "std::max<int64_t>(1, (s0 / 2))"
    assert print_index(sympy.Min(s0, s1, 7) * 3, "/") == "3*std::min<int64_t>(std::min<int64_t>(7, s0), s1)"
    assert eval(print_index(size, "//"), {"s0": 9}) == 4 and eval(print_index(size, "//"), {"s0": 1}) == 1
