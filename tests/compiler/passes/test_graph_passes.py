"""Each post-grad pass on a small graph: what it removes or rewrites, and that the graph
still computes what it did."""
from __future__ import annotations

import torch

from aotforge.compiler import passes

from ..helpers import trace

aten = torch.ops.aten


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _same_result(before_fn, gm, *args):
    gm.recompile()  # passes edit the graph; the runner regenerates the code once, at the end
    torch.testing.assert_close(gm(*args), before_fn(*args))


def test_cse_merges_identical_nodes():
    fn = lambda x: (x.sin() + x.sin(),)
    gm = passes.cse(trace(fn, torch.randn(4)))
    assert _targets(gm).count(aten.sin.default) == 1
    _same_result(fn, gm, torch.randn(4))


def test_cse_keeps_random_ops_apart():
    gm = passes.cse(trace(lambda x: (torch.rand_like(x) + torch.rand_like(x),), torch.randn(4)))
    assert sum("rand" in str(t) for t in _targets(gm)) == 2


def test_dead_code_elimination():
    def fn(x):
        x.cos()
        return (x.sin(),)
    gm = passes.dead_code_elimination(trace(fn, torch.randn(4)))
    assert aten.cos.default not in _targets(gm)


def test_remove_noops():
    fn = lambda x: ((x - 0) * 1 + x.clone().to(torch.float32) / 1,)
    gm = passes.remove_noops(trace(fn, torch.randn(4)))
    assert _targets(gm) == [aten.add.Tensor]
    _same_result(fn, gm, torch.randn(4))


def test_adding_zero_is_kept_for_floats_where_it_turns_negative_zero_positive():
    """-0.0 + 0 is +0.0: eager's sign, kept through the whole compiler; integer x + 0 goes."""
    x = torch.tensor([-0.0, 0.0, -1.5, float("nan")], dtype=torch.float64)
    for fn in (lambda t: ((t + 0) * 2,), lambda t: ((t - (-0.0)) * 2,), lambda t: (torch.add(t, 0.0) * 1,)):
        gm = passes.remove_noops(trace(fn, x))
        assert aten.add.Tensor in _targets(gm) or aten.sub.Tensor in _targets(gm)
        compiled = torch.compile(fn, backend="aotforge")(x)[0]
        torch.testing.assert_close(compiled, fn(x)[0], equal_nan=True)
        assert torch.equal(compiled.signbit(), fn(x)[0].signbit())
    identities = passes.remove_noops(trace(lambda t: ((t + (-0.0)) * 2 - (t - 0) * 3,), x))
    assert _targets(identities) == [aten.mul.Tensor, aten.mul.Tensor, aten.sub.Tensor]  # the float identities go
    integers = passes.remove_noops(trace(lambda t: ((t + 0) * 2,), torch.arange(4)))
    assert _targets(integers) == [aten.mul.Tensor]


def test_remove_noops_keeps_a_copy_that_is_an_output():
    gm = passes.remove_noops(trace(lambda x: (x.clone(),), torch.randn(4)))
    assert aten.clone.default in _targets(gm)


def test_view_to_reshape():
    gm = passes.view_to_reshape(torch.fx.experimental.proxy_tensor.make_fx(lambda x: (x.view(2, 2) + 1,))(torch.randn(4)))
    assert aten.reshape.default in _targets(gm) and aten.view.default not in _targets(gm)


def test_constant_folding_of_parameter_free_subgraphs():
    fn = lambda x: (x + torch.arange(4, dtype=torch.float32).exp(),)
    gm = passes.constant_fold(trace(fn, torch.randn(4)))
    assert aten.exp.default not in _targets(gm)
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    _same_result(fn, gm, torch.randn(4))


def test_pattern_rewrites():
    fn = lambda x: ((x.abs() + 1).sqrt().reciprocal() + (-(-x)) + x.permute(1, 0).permute(1, 0),)
    gm = passes.apply_pattern_rewrites(trace(fn, torch.randn(3, 3)))
    targets = _targets(gm)
    assert aten.rsqrt.default in targets and aten.reciprocal.default not in targets
    assert aten.neg.default not in targets and aten.permute.default not in targets
    _same_result(fn, gm, torch.randn(3, 3))


def test_functionalize_inplace_on_intermediates():
    def fn(x):
        y = x.sum(0, keepdim=True)
        y.add_(1)
        return (x * y,)
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(torch.randn(3, 3))
    gm = passes.graph_passes.functionalize_inplace(gm)
    assert aten.add_.Tensor not in _targets(gm) and aten.add_.Scalar not in _targets(gm)
    _same_result(fn, gm, torch.randn(3, 3))
