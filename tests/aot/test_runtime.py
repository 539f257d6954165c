"""aot/runtime.py: the epilogue's write-backs into mutated inputs, against eager.

Mutations that record no autograd history (BatchNorm's running statistics, counters, writes
under no_grad or through .detach()) are written back together by one ``_foreach_copy_``; the
others one by one. Both must leave every input, version counter and gradient as eager does.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from aotforge.aot import aot_function, aot_module
from aotforge.aot.boxing import nop
from aotforge.aot import runtime
from aotforge.testing import Inputs, verify, verify_module


def _hidden_writes(x, a, b, counter, weight):
    # three buffers written through .detach() and under no_grad, one counter of another dtype,
    # and a write autograd sees (weight is not touched: its gradient must still flow)
    a.detach().mul_(0.5).add_(x.detach().mean(0))
    with torch.no_grad():
        b.copy_(x.var(0))
        counter.add_(1)
    y = x * weight
    return y.sum(0), a + 1


def _inputs():
    return Inputs((torch.randn(6, 4, dtype=torch.float64, requires_grad=True),
                   torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
                   torch.zeros((), dtype=torch.long),
                   torch.randn(4, dtype=torch.float64, requires_grad=True)))


def test_hidden_writes_match_eager_in_every_mode():
    verify(_hidden_writes, _inputs)


def test_hidden_writes_are_batched_and_bump_each_version():
    fn = aot_function(_hidden_writes, nop, nop)
    args = _inputs().args
    expected_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    versions = [a._version for a in args]
    eager_versions_before = [a._version for a in expected_args]
    out = fn(*args)
    eager = _hidden_writes(*expected_args)
    for got, want in zip(args, expected_args):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0)
    # a, b and counter changed their version as eager's in-place writes did
    for i in (1, 2, 3):
        assert args[i]._version > versions[i]
        assert expected_args[i]._version > eager_versions_before[i]
    (out[0].sum() + out[1].sum()).backward()
    (eager[0].sum() + eager[1].sum()).backward()
    torch.testing.assert_close(args[0].grad, expected_args[0].grad, rtol=0, atol=0)
    torch.testing.assert_close(args[4].grad, expected_args[4].grad, rtol=0, atol=0)


def test_epilogue_batches_only_history_free_writes(monkeypatch):
    def fn(x, buffer, tracked):
        buffer.detach().add_(1)
        with torch.no_grad():
            x.add_(0)  # a second history-free write: the two go together
        tracked.mul_(2)  # autograd sees this one: it stays a copy_ of its own
        return tracked * 1

    together = []
    write_back_together = runtime._write_back_together
    monkeypatch.setattr(runtime, "_write_back_together",
                        lambda originals, updated: together.append(originals) or write_back_together(originals, updated))
    x, buffer, base = torch.randn(3), torch.randn(3), torch.randn(3, requires_grad=True)
    aot_function(fn, nop, nop)(x, buffer, base.clone())
    assert len(together) == 1 and [id(t) for t in together[0]] == [id(x), id(buffer)]


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=0.3),
            nn.Linear(8, 3), nn.BatchNorm1d(3),
        )

    def forward(self, x):
        return self.layers(x)


def test_batch_norm_buffers_after_training_steps_match_eager():
    verify_module(lambda: _BatchNormNet().double(), lambda m: aot_module(m, nop, nop),
                  lambda: torch.randn(16, 5, dtype=torch.float64), steps=4, lr=0.1, rtol=1e-12, atol=1e-12)
