"""The functorch.compile names aotforge also offers: print_compile, draw_graph,
memory_efficient_fusion, get_aot_graph_name, get_aot_compilation_context,
default_decompositions. Compared with functorch.compile where it has the same name."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch.fx.passes import graph_drawer

import aotforge
from aotforge.testing import verify


def f(x, w):
    return torch.nn.functional.gelu(x @ w).tanh().sum(-1)


def _inputs():
    return (torch.randn(4, 8, dtype=torch.float64, requires_grad=True),
            torch.randn(8, 8, dtype=torch.float64, requires_grad=True))


def test_default_decompositions_match_functorch():
    from functorch.compile import default_decompositions as functorch_decompositions

    assert set(aotforge.default_decompositions) == set(functorch_decompositions)


def test_print_compile_prints_each_graph_and_runs_it(capsys):
    verify(f, _inputs, compile=lambda fn, mode: aotforge.aot_function(fn, aotforge.print_compile))
    out = capsys.readouterr().out
    assert "def forward(self, primals_1, primals_2)" in out  # the training forward
    assert "tangents_1" in out  # and its backward
    assert "torch.ops.aten.mm.default" in out


def test_memory_efficient_fusion_function_and_module():
    verify(f, _inputs, modes=("train",), compile=lambda fn, mode: aotforge.memory_efficient_fusion(fn))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).double()
    compiled = aotforge.memory_efficient_fusion(model)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    out, expected = compiled(x), model(x)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    expected_grads = torch.autograd.grad(expected.sum(), [x, *model.parameters()])
    torch.testing.assert_close(grads, expected_grads)
    # gelu_backward came apart by the default decompositions (min-cut may move its
    # pointwise pieces into the forward)
    graphs = aotforge.inspect(compiled).records[0].graphs
    code = graphs["forward"].code + graphs["backward"].code
    assert "gelu_backward" not in code and "erf" in code, code


def test_graph_name_and_context_inside_a_compiler():
    seen = []

    def compiler(gm, example_inputs):
        seen.append((aotforge.get_aot_graph_name(), aotforge.get_aot_compilation_context()))
        return gm

    compiled = aotforge.aot_function(f, compiler)
    compiled(*_inputs()).sum().backward()
    with torch.no_grad():
        compiled(*_inputs())
    assert seen == [
        ("f__forward_0", (["forward"], "f", 0)),
        ("f__backward_0", (["backward"], "f", 0)),
        ("f__inference_1", (["inference"], "f", 1)),
    ]
    assert aotforge.get_aot_compilation_context() == ([], "", 0)  # outside a compile


def test_draw_graph_without_graphviz_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(graph_drawer, "HAS_PYDOT", False)
    gm = torch.fx.symbolic_trace(lambda x: x.sin() + 1)
    with pytest.raises(ImportError, match="pip install pydot.*Graphviz"):
        aotforge.draw_graph(gm, str(tmp_path / "graph.svg"))


def test_draw_graph_writes_the_graph(tmp_path):
    # pydot is in the test extra; ".raw" writes the dot source without Graphviz's binary.
    assert graph_drawer.HAS_PYDOT, "pydot missing: pip install -e '.[test]'"
    gm = torch.fx.symbolic_trace(lambda x: x.sin() + 1)
    aotforge.draw_graph(gm, str(tmp_path / "graph.raw"))
    text = (tmp_path / "graph.raw").read_text()
    assert "digraph" in text and "sin" in text
