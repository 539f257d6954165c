"""run_exported: an exported graph called like the module reproduces eager (float64):
outputs, buffer and input updates written back, gradients by name; wrong calls are errors."""
import copy

import pytest
import torch
import torch.nn as nn

from aotforge import aot_export_module, run_exported
from aotforge.aot.export import ExportError

from .test_export import ConvBatchNorm, DictModel, LinearBatchNorm, f64

D = torch.float64


def test_joint_run_matches_eager_and_updates_buffers():
    torch.manual_seed(0)
    mod = ConvBatchNorm().to(D)
    eager = copy.deepcopy(mod)
    args = (f64(4, 2, 5, 5), torch.tensor([0, 1, 1, 0]))
    gm, sig = aot_export_module(mod, args, trace_joint=True, output_loss_index=0)

    (loss, logits), gradients = run_exported(gm, sig, mod, *args)
    want_loss, want_logits = eager(*args)
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss.detach())
    torch.testing.assert_close(logits, want_logits)
    assert sorted(gradients) == sorted(name for name, _ in eager.named_parameters())
    for name, parameter in eager.named_parameters():
        torch.testing.assert_close(gradients[name], parameter.grad)
    for (name, got), want in zip(mod.named_buffers(), eager.buffers()):
        torch.testing.assert_close(got, want, msg=name)
    assert mod.bn.num_batches_tracked.item() == 1


def test_kwargs_structured_outputs_and_input_gradients():
    torch.manual_seed(0)
    mod = DictModel().to(D)
    x = f64(2, 3, requires_grad=True)
    kwargs = {"mask": f64(2, 3), "pair": (f64(3), f64(3, requires_grad=True))}
    gm, sig = aot_export_module(mod, (x,), trace_joint=True, output_loss_index=1, kwargs=kwargs)
    outputs, gradients = run_exported(gm, sig, mod, x, **kwargs)
    want = mod(x, **kwargs)
    want["loss"].backward()
    assert list(outputs) == ["logits", "loss"]
    torch.testing.assert_close(outputs["loss"], want["loss"].detach())
    torch.testing.assert_close(gradients["args[0]"], x.grad)
    torch.testing.assert_close(gradients["kwargs['pair'][1]"], kwargs["pair"][1].grad)


def test_inference_run_writes_input_mutations_back():
    class Normalize(nn.Module):
        def forward(self, x):
            x.sub_(x.mean())
            return x.square().sum()

    x = f64(5)
    gm, sig = aot_export_module(Normalize(), (x,), trace_joint=False)
    eager_x, graph_x = x.clone(), x.clone()
    want = Normalize()(eager_x)
    got, gradients = run_exported(gm, sig, Normalize(), graph_x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(graph_x, eager_x)
    assert gradients == {}


def test_wrong_calls_are_errors():
    mod = LinearBatchNorm().to(D)
    gm, sig = aot_export_module(mod, (f64(8, 6),), trace_joint=False)
    with pytest.raises(ExportError, match=r"args\[0\] has shape \(5, 6\).*exported for shape \(8, 6\)"):
        run_exported(gm, sig, mod, f64(5, 6))
    with pytest.raises(ExportError, match="do not have the structure"):
        run_exported(gm, sig, mod, f64(8, 6), f64(8, 6))
    with pytest.raises(ExportError, match="no parameter or buffer 'linear.weight'"):
        run_exported(gm, sig, nn.Linear(6, 4).to(D), f64(8, 6))
    assert mod.bn.num_batches_tracked.item() == 0  # nothing ran
