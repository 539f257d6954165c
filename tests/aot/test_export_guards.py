"""Runtime checks in exported graphs: dynamic shapes that generalize to new sizes (compared
with eager in float64), and clear assertion errors for calls outside what the trace assumed."""
import copy

import pytest
import torch
import torch.nn as nn

from aotforge import aot_export_module, load_exported, run_exported, save_exported

from .test_export import ConvBatchNorm, f64


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(16, 8, dtype=torch.float64)
        self.norm = nn.BatchNorm1d(8, dtype=torch.float64)
        self.head = nn.Linear(8, 4, dtype=torch.float64)

    def forward(self, x, target):
        logits = self.head(torch.relu(self.norm(self.encoder(x))))
        return nn.functional.cross_entropy(logits, target), logits.detach()


def classifier_inputs(batch: int):
    return f64(batch, 16), torch.randint(0, 4, (batch,))


def assert_run_matches_eager(gm, sig, mod, args):
    eager, exported = copy.deepcopy(mod), copy.deepcopy(mod)
    want_loss, want_logits = eager(*args)
    want_loss.backward()
    (loss, logits), gradients = run_exported(gm, sig, exported, *args)
    torch.testing.assert_close(loss, want_loss.detach())
    torch.testing.assert_close(logits, want_logits)
    for name, parameter in eager.named_parameters():
        torch.testing.assert_close(gradients[name], parameter.grad, msg=name)
    for (name, got), want in zip(exported.named_buffers(), eager.buffers()):
        torch.testing.assert_close(got, want, msg=name)


def test_dynamic_batch_joint_export_runs_at_other_batch_sizes(tmp_path):
    torch.manual_seed(0)
    mod = Classifier()
    # A batch of 8 equals the hidden size 8: without duck sizing the batch stays its own size.
    gm, sig = aot_export_module(
        mod, classifier_inputs(8), trace_joint=True, output_loss_index=0, dynamic_shapes=True
    )
    for batch in (3, 13):
        assert_run_matches_eager(gm, sig, mod, classifier_inputs(batch))
    save_exported(tmp_path / "dynamic.pt", gm, sig)
    loaded, loaded_sig = load_exported(tmp_path / "dynamic.pt")
    assert_run_matches_eager(loaded, loaded_sig, mod, classifier_inputs(5))


def test_dynamic_conv_batchnorm_inference():
    torch.manual_seed(0)
    mod = ConvBatchNorm().to(torch.float64)
    args = (f64(4, 2, 6, 6), torch.tensor([0, 1, 1, 0]))
    gm, sig = aot_export_module(mod, args, trace_joint=False, dynamic_shapes=True)
    other = (f64(3, 2, 9, 7), torch.tensor([1, 0, 1]))
    eager = copy.deepcopy(mod)
    with torch.no_grad():
        want = eager(*other)
    got, _ = run_exported(gm, sig, mod, *other)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(mod.bn.running_var, eager.bn.running_var)


def test_sizes_the_trace_fixed_or_related_are_checked():
    mod = Classifier()
    gm, sig = aot_export_module(
        mod, classifier_inputs(8), trace_joint=True, output_loss_index=0, dynamic_shapes=True
    )
    state = [*mod.parameters(), *mod.buffers()]
    with pytest.raises(AssertionError, match=r"user input args\[0\] size 1 must be 16"):
        gm(*state, f64(5, 12), torch.randint(0, 4, (5,)))
    with pytest.raises(
        AssertionError, match=r"user input args\[1\] size 0 must be equal to user input args\[0\] size 0"
    ):
        gm(*state, f64(5, 16), torch.randint(0, 4, (6,)))


def test_shape_branches_and_reshapes_are_guarded():
    class Branch(nn.Module):
        def forward(self, x):
            rows = x.reshape(-1, 4)
            return rows * 2 if x.shape[0] > 4 else rows * 3

    gm, sig = aot_export_module(Branch(), (f64(6, 6),), trace_joint=False, dynamic_shapes=True)
    x = f64(8, 6)
    torch.testing.assert_close(gm(x)[0], Branch()(x))
    with pytest.raises(AssertionError, match=r"about its input sizes \(.*user input args\[0\] size 0"):
        gm(f64(3, 4))  # takes the other branch
    with pytest.raises(AssertionError, match="about its input sizes"):
        gm(f64(7, 3))  # 21 elements are not rows of 4


# ---------------------------------------------------------------------------------------------
# Values read from tensors (.item()) used as sizes: unbacked sizes under dynamic_shapes=True


class TakeFirst(nn.Module):
    """Uses a count read from a tensor as a size: slicing, a new tensor's size, arithmetic on
    it, and an output whose size is the count."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x, count):
        n = count.item()
        torch._check(n >= 0)
        torch._check(n <= x.shape[0])
        head = x[:n] * self.weight
        padded = torch.cat([head, torch.zeros(x.shape[0] - n, 4, dtype=x.dtype)])
        return (padded * padded).sum(), torch.ones(n, dtype=x.dtype) * head.detach().sum()


COUNTS = [(6, 3), (9, 0), (5, 5), (2, 1)]  # (rows, count): other sizes and counts than traced


@pytest.mark.parametrize("trace_joint", [True, False], ids=["joint", "inference"])
def test_item_used_as_a_size_runs_for_other_values(tmp_path, trace_joint):
    torch.manual_seed(0)
    mod = TakeFirst()
    gm, sig = aot_export_module(
        mod, (f64(6, 4), torch.tensor(3)), trace_joint=trace_joint,
        output_loss_index=0 if trace_joint else None, dynamic_shapes=True,
    )
    assert torch.ops.aten._local_scalar_dense.default in {n.target for n in gm.graph.nodes}
    save_exported(tmp_path / "unbacked.pt", gm, sig)
    loaded = load_exported(tmp_path / "unbacked.pt")
    for rows, count in COUNTS:
        x, n = f64(rows, 4), torch.tensor(count)
        eager = copy.deepcopy(mod)
        want_loss, want_ones = eager(x, n)
        if trace_joint:
            want_loss.backward()
        for graph, signature in ((gm, sig), loaded):
            (loss, ones), gradients = run_exported(graph, signature, mod, x, n)
            torch.testing.assert_close(loss, want_loss.detach())
            torch.testing.assert_close(ones, want_ones)
            assert ones.shape == (count,)
            if trace_joint:
                torch.testing.assert_close(gradients["weight"], eager.weight.grad)


def test_what_the_forward_checked_about_the_value_is_asserted():
    mod = TakeFirst()
    gm, sig = aot_export_module(mod, (f64(6, 4), torch.tensor(3)), trace_joint=False, dynamic_shapes=True)
    with pytest.raises(RuntimeError):  # eager's torch._check
        mod(f64(4, 4), torch.tensor(5))
    with pytest.raises(AssertionError, match=r"the forward checks u\d+ <= s\d+ \(.*user input args\[0\] size 0"):
        run_exported(gm, sig, mod, f64(4, 4), torch.tensor(5))
    with pytest.raises(AssertionError, match=r"the forward checks 0 <= u\d+"):
        run_exported(gm, sig, mod, f64(4, 4), torch.tensor(-1))


def test_data_dependent_output_shapes_under_dynamic_shapes():
    class Positive(nn.Module):
        def forward(self, x):
            return x[x > 0] * 2, x.nonzero()

    gm, sig = aot_export_module(Positive(), (f64(7),), trace_joint=False, dynamic_shapes=True)
    for x in (f64(7), f64(12), -f64(5).abs()):
        got, _ = run_exported(gm, sig, Positive(), x)
        for g, w in zip(got, Positive()(x)):
            torch.testing.assert_close(g, w)


def test_values_read_from_tensors_need_dynamic_shapes_and_torch_check():
    from aotforge.aot.export import ExportError

    args = (f64(6, 4), torch.tensor(3))
    with pytest.raises(ExportError, match="export with dynamic_shapes=True"):
        aot_export_module(TakeFirst(), args, trace_joint=False)

    class Branch(nn.Module):
        def forward(self, x, count):
            return x[: count.item()] if count.item() > 2 else x * 2

    with pytest.raises(ExportError, match=r"decides something from a value it read .*u\d+ > 2.*torch._check"):
        aot_export_module(Branch(), args, trace_joint=False, dynamic_shapes=True)
