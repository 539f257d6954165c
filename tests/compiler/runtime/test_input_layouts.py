"""One check of a graph's inputs per call (runtime/launch.py InputLayouts, emitted by
codegen/wrapper.py): it passes only inputs laid out exactly as in the last call that ran the
per-input checks, so a wrong layout is still copied (ensure_layout), a wrong shape or a
mutated input of another layout still raises, exactly as with a check per input."""
from __future__ import annotations

import pytest
import torch

from aotforge.compiler import compile_fx_inner
from aotforge.compiler.codegen import wrapper
from aotforge.compiler.runtime import cpp_build, launch
from aotforge.config import config

from ..helpers import trace

needs_cpp = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")


def test_the_check_passes_only_what_it_remembered():
    layouts = launch.InputLayouts()
    x, w = torch.randn(4, 8), torch.nn.Parameter(torch.randn(8))
    assert not layouts.check(x, w)  # nothing remembered: the per-input checks run
    layouts.remember(x, w)
    assert layouts.check(x, w) and layouts.check(torch.randn(4, 8), torch.nn.Parameter(torch.randn(8)))
    for other in [(x.t().contiguous().t(), w), (torch.randn(4, 9), w), (x.double(), w), (x, w.detach()),
                  (x, None), (x, 1.0), (x[:, :4], w)]:
        assert not layouts.check(*other), other
    layouts.remember(x, None)  # not all tensors: never passes
    assert not layouts.check(x, None) and not layouts.check(x, w)


def compile_cpp(fn, *args):
    with config.patch(triton_on_cpu=False, cpu_codegen=True):
        compiled = compile_fx_inner(trace(fn, *args), list(args))
    assert compiled.compiled_graph.path == "cpp"
    return compiled


def block(x, w, b):
    return (torch.relu(x * w + b).sum(1), torch.nn.functional.linear(x, w.expand(8, 8)) + 1)


@needs_cpp
@pytest.mark.parametrize("once", [True, False], ids=["checked once", "checked one by one"])
def test_inputs_of_another_layout_are_copied_and_of_another_shape_refused(once, monkeypatch):
    monkeypatch.setattr(wrapper, "CHECK_INPUTS_ONCE", once)
    x, w, b = torch.randn(8, 8), torch.randn(8), torch.randn(8)
    compiled = compile_cpp(block, x, w, b)
    assert ("input_layouts.check(" in compiled.compiled_graph.wrapper_source) == once
    for inputs in [(x, w, b), (x, w, b), (x.t().contiguous().t(), w, b), (x, w, b), (x.t().contiguous().t(), w, b)]:
        for actual, expected in zip(compiled(list(inputs)), block(*inputs)):
            torch.testing.assert_close(actual, expected)
    with pytest.raises(RuntimeError, match="specialized to the shapes"):
        compiled([torch.randn(8, 9), w, b])
    for actual, expected in zip(compiled([x, w, b]), block(x, w, b)):
        torch.testing.assert_close(actual, expected)


def add_in_place(x, y):
    x.add_(y)
    return (y.sum(1),)


@needs_cpp
def test_a_mutated_input_of_another_layout_still_raises_after_good_calls():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    compiled = compile_cpp(add_in_place, x.clone(), y)
    assert "check_mutated_input" in compiled.compiled_graph.wrapper_source
    for _ in range(2):
        a = x.clone()
        torch.testing.assert_close(compiled([a, y])[0], y.sum(1))
        torch.testing.assert_close(a, x + y)
    with pytest.raises(RuntimeError, match="an input the graph writes into has layout"):
        compiled([x.clone().t().contiguous().t(), y])
    a = x.clone()
    torch.testing.assert_close(compiled([a, y])[0], y.sum(1))
    torch.testing.assert_close(a, x + y)
