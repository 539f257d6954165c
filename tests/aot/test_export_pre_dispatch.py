"""aot_export_module(pre_dispatch=True): the graph before autograd dispatch. Compared with
PyTorch's own pre-dispatch export (same graph, same subgraphs, same signature) and run
against eager in float64 (outputs, buffer and input updates, both branches of a cond)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.map import map as map_rows

from aotforge import aot_export_module, load_exported, run_exported, save_exported
from aotforge.aot.export import ExportError

from .test_export import (
    BufferUpdates,
    ConvBatchNorm,
    DictModel,
    LinearBatchNorm,
    MetadataMutation,
    assert_matches_eager,
    f64,
)
from .test_export_names import torch_signature_fields

D = torch.float64


class NoGradBlock(nn.Module):
    """A linear kept whole, a no_grad block, a buffer updated in place."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3, dtype=D)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        hidden = F.gelu(self.proj(x))
        with torch.no_grad():
            statistic = hidden.abs().mean()
        self.steps.add_(1)
        return hidden * statistic, statistic


class CondAndMap(nn.Module):
    """torch.cond on a tensor predicate and map over rows, both with captured parameters."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, dtype=D)
        self.scale = nn.Parameter(torch.randn(4, dtype=D))

    def forward(self, x, y):
        hidden = self.proj(x)
        chosen = torch.cond(
            hidden.sum() > 0,
            lambda h: (h * self.scale).sin(),
            lambda h: h.cos() - self.scale,
            (hidden,),
        )
        rows = map_rows(lambda row, other: row.softmax(0) * other, chosen, y)
        return rows.sum(0), chosen


class MutatesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1, dtype=D)

    def forward(self, image, counter):
        counter.add_(1)
        return (F.dropout(self.conv(image), 0.5, training=False).relu(),)


class KwargsTuple(DictModel):
    """(PyTorch's export takes only tuple outputs; dict outputs are compared with eager below.)"""

    def forward(self, x, *, mask, pair):
        return tuple(super().forward(x, mask=mask, pair=pair).values())


CASES = {
    "linear_batchnorm": (LinearBatchNorm, lambda: ((f64(8, 6),), {})),
    "conv_batchnorm": (lambda: ConvBatchNorm().to(D), lambda: ((f64(4, 2, 5, 5), torch.tensor([0, 1, 1, 0])), {})),
    "no_grad_block": (NoGradBlock, lambda: ((f64(5, 4),), {})),
    "cond_and_map": (CondAndMap, lambda: ((f64(3, 4), f64(3, 4)), {})),
    "input_mutation": (MutatesInput, lambda: ((f64(1, 2, 4, 4), f64(2)), {})),
    "kwargs": (
        KwargsTuple,
        lambda: ((f64(2, 3),), {"mask": f64(2, 3), "pair": (f64(3), f64(3))}),
    ),
}


def all_graph_code(gm) -> dict:
    """The graph's code and every subgraph's (cond branches, map bodies), by name."""
    return {name or "<root>": module.code for name, module in gm.named_modules() if hasattr(module, "code")}


@pytest.mark.parametrize("case", list(CASES))
def test_same_graph_and_signature_as_torch_and_matches_eager(case):
    from torch._functorch.aot_autograd import aot_export_module as torch_export

    make_model, make_args = CASES[case]
    torch.manual_seed(0)
    mod = make_model().to(D)
    args, kwargs = make_args()
    ours, our_sig = aot_export_module(mod, args, trace_joint=False, pre_dispatch=True, kwargs=kwargs)
    theirs, their_sig = torch_export(mod, args, trace_joint=False, pre_dispatch=True, kwargs=kwargs)
    assert all_graph_code(ours) == all_graph_code(theirs)
    assert torch_signature_fields(our_sig) == torch_signature_fields(their_sig)
    assert our_sig.backward_signature is None
    assert_matches_eager(ours, our_sig, mod, args, kwargs)


def test_dict_outputs_match_eager():
    torch.manual_seed(0)
    mod = DictModel().to(D)
    args, kwargs = (f64(2, 3),), {"mask": f64(2, 3), "pair": (f64(3), f64(3))}
    gm, sig = aot_export_module(mod, args, trace_joint=False, pre_dispatch=True, kwargs=kwargs)
    assert_matches_eager(gm, sig, mod, args, kwargs)


def test_buffer_reassigned_in_forward_is_updated_as_eager():
    """(PyTorch's pre-dispatch export drops this update; ours keeps it, as the default export.)"""
    torch.manual_seed(0)
    mod = BufferUpdates().to(D)
    gm, sig = aot_export_module(mod, (f64(4, 5),), trace_joint=False, pre_dispatch=True)
    assert sorted(sig.buffers_to_mutate.values()) == ["ema", "steps"]
    assert_matches_eager(gm, sig, mod, (f64(4, 5),))


def test_autocast_regions_are_kept_and_saved(tmp_path):
    """An autocast block stays a region of the graph (as in PyTorch's pre-dispatch export),
    and the saved graph holds it."""
    from torch._functorch.aot_autograd import aot_export_module as torch_export

    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 3)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                hidden = self.proj(x)
            return (hidden.float().square().sum(),)

    torch.manual_seed(0)
    mod, x = Autocast(), torch.randn(5, 4)
    gm, sig = aot_export_module(mod, (x,), trace_joint=False, pre_dispatch=True)
    assert gm.code == torch_export(mod, (x,), trace_joint=False, pre_dispatch=True)[0].code
    save_exported(tmp_path / "autocast.pt", gm, sig)
    loaded, loaded_sig = load_exported(tmp_path / "autocast.pt")
    with torch.no_grad():
        (want,) = mod(x)
    for graph, signature in ((gm, sig), (loaded, loaded_sig)):
        (got,), _ = run_exported(graph, signature, mod, x)
        torch.testing.assert_close(got, want)  # bfloat16 rounding, exactly as eager's


def targets(gm) -> set:
    return {n.target for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
            for n in module.graph.nodes if n.op == "call_function"}


def test_composite_ops_grad_mode_and_higher_order_ops_are_kept():
    torch.manual_seed(0)
    gm, _ = aot_export_module(NoGradBlock(), (f64(5, 4),), trace_joint=False, pre_dispatch=True)
    kept = targets(gm)
    assert torch.ops.aten.linear.default in kept and torch.ops.aten.gelu.default in kept
    assert torch.ops.aten.addmm.default not in kept and torch.ops.aten.t.default not in kept
    grad_switches = [n.args for n in gm.graph.nodes if n.target is torch._C._set_grad_enabled]
    assert grad_switches == [(False,), (True,)]
    # Below autograd (the default), linear is decomposed and the no_grad block leaves nothing.
    below, _ = aot_export_module(NoGradBlock(), (f64(5, 4),), trace_joint=False)
    assert torch.ops.aten.linear.default not in targets(below)
    assert torch._C._set_grad_enabled not in targets(below)

    gm, _ = aot_export_module(CondAndMap(), (f64(3, 4), f64(3, 4)), trace_joint=False, pre_dispatch=True)
    assert {torch.ops.higher_order.cond, torch.ops.higher_order.map_impl} <= targets(gm)


def test_both_branches_of_a_cond_match_eager(tmp_path):
    torch.manual_seed(0)
    mod = CondAndMap()
    gm, sig = aot_export_module(mod, (f64(3, 4), f64(3, 4)), trace_joint=False, pre_dispatch=True)
    save_exported(tmp_path / "cond.pt", gm, sig)
    loaded, loaded_sig = load_exported(tmp_path / "cond.pt")
    assert all_graph_code(loaded) == all_graph_code(gm)
    taken = set()
    for seed in range(8):
        torch.manual_seed(seed)
        args = (f64(3, 4), f64(3, 4))
        taken.add(bool(mod.proj(args[0]).sum() > 0))
        with torch.no_grad():
            want = mod(*args)
        for graph, signature in ((gm, sig), (loaded, loaded_sig)):
            got, _ = run_exported(graph, signature, mod, *args)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
    assert taken == {True, False}


def test_dynamic_shapes():
    torch.manual_seed(0)
    mod = NoGradBlock()
    gm, sig = aot_export_module(mod, (f64(5, 4),), trace_joint=False, pre_dispatch=True, dynamic_shapes=True)
    for batch in (2, 9):
        x = f64(batch, 4)
        with torch.no_grad():
            want = NoGradBlock.forward(mod, x)
        mod.steps.zero_()
        got, _ = run_exported(gm, sig, mod, x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    with pytest.raises(AssertionError, match=r"args\[0\] size 1 must be 4"):
        gm(*mod.parameters(), *mod.buffers(), f64(2, 5))


def test_same_restrictions():
    with pytest.raises(ExportError, match="pre_dispatch=True exports the forward only"):
        aot_export_module(LinearBatchNorm(), (f64(8, 6),), trace_joint=True, output_loss_index=0, pre_dispatch=True)
    with pytest.raises(ExportError, match="changes the metadata"):
        aot_export_module(MetadataMutation(), (f64(2, 3),), trace_joint=False, pre_dispatch=True)
