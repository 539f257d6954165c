"""Functionalized RNG on CUDA (issue 12): philox draws in the kernels redraw the forward's mask
in the backward; the CUDA generator state after a step equals eager's (offset advanced by
ATen's formula); fallback_random gives eager's masks bit for bit."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and compiled, not interpreted, Triton)")

import aotforge  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed
        self.linear = torch.nn.Linear(256, 256)

    def block(self, x):
        return torch.nn.functional.dropout(self.linear(x).relu(), 0.1, True)

    def forward(self, x):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)


def _step(model, x, weight):
    torch.manual_seed(3)
    out = model(x)
    (out * weight).sum().backward()
    return out.detach(), torch.cuda.get_rng_state()


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("options", [{}, {"fallback_random": True}], ids=["philox", "fallback_random"])
def test_cuda_dropout_step(checkpointed, options):
    torch.manual_seed(0)
    model = _Net(checkpointed).cuda()
    x = torch.randn(512, 256, device="cuda")
    weight = torch.randn(512, 256, device="cuda")
    eager_out, eager_state = _step(model, x, weight)
    eager_grad = model.linear.bias.grad.clone()
    model.zero_grad()
    torch._dynamo.reset()
    out, state = _step(torch.compile(model, backend="aotforge", options=options or None), x, weight)
    assert torch.equal(state, eager_state), "the CUDA generator state after the step differs from eager's"
    kept = out != 0
    alive = model.linear(x).relu() != 0
    expected_bias = (weight * kept / 0.9 * alive).sum(0)
    torch.testing.assert_close(model.linear.bias.grad, expected_bias, rtol=1e-3, atol=1e-3)
    if options.get("fallback_random"):
        assert torch.equal(out, eager_out)
        torch.testing.assert_close(model.linear.bias.grad, eager_grad, rtol=1e-4, atol=1e-4)
    else:
        assert abs(kept[alive].float().mean().item() - 0.9) < 0.01
