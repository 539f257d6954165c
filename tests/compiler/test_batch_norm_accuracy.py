"""Training through batch norm in float32 is as accurate as eager: measured against float64,
aotforge's gradients and running statistics are off by no more than a few times eager's own
error. (Traced through batch norm's decomposed training forward, the CPU benchmark's conv net
had gradients 1e-3 to 2e-2 off, where eager's are 1e-5 off.)"""
from __future__ import annotations

import copy

import torch

import aotforge  # noqa: F401  (registers the backend)
from aotforge.bench.workloads.cpu import build_cpu_convnet


def test_conv_batch_norm_training_in_float32_is_as_accurate_as_eager():
    torch.manual_seed(0)
    case = build_cpu_convnet("train", quick=False)  # three conv-BN-ReLU blocks, the loss inside
    model = case.module
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    torch._dynamo.reset()
    torch.compile(model, backend="aotforge")(*case.inputs).backward()
    eager(*case.inputs).backward()
    exact(*[a.double() if a.is_floating_point() else a for a in case.inputs]).backward()

    def error(tensor, reference):
        return ((tensor.double() - reference).abs().max() / reference.abs().max()).item()

    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
        assert error(p.grad, r.grad) <= 10 * error(q.grad, r.grad) + 1e-6, name
    for (name, b), q, r in zip(model.named_buffers(), eager.buffers(), exact.buffers()):
        if b.is_floating_point():
            assert error(b, r) <= 10 * error(q, r) + 1e-6, name


def test_batch_norm_backward_stays_an_aten_call_on_the_cpu():
    """On the CPU, batch norm's backward is not decomposed (ATen's kernel, eager's numbers);
    elsewhere it still is (the Triton path fuses it)."""
    from aotforge.compiler.decompositions import select_decomposition_table

    decompose = select_decomposition_table()[torch.ops.aten.native_batch_norm_backward.default]
    x, grad = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    weight, mean, invstd = torch.ones(4), x.mean((0, 2, 3)), torch.ones(4)
    assert decompose(grad, x, weight, None, None, mean, invstd, True, 1e-5, [True, True, True]) is NotImplemented
    meta = [t.to("meta") for t in (grad, x, weight, mean, invstd)]
    result = decompose(meta[0], meta[1], meta[2], None, None, meta[3], meta[4], True, 1e-5, [True, True, True])
    assert result is not NotImplemented


def test_conv_batch_norm_relu_training_steps_match_eager_on_odd_channels_last_input():
    """Three SGD steps of conv-BN-ReLU-conv-BN on channels-last input of odd sizes (NaN-free):
    gradients, weights and BatchNorm's running statistics as eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3, padding=1), torch.nn.BatchNorm2d(5), torch.nn.ReLU(),
                                torch.nn.Conv2d(5, 7, 1), torch.nn.BatchNorm2d(7))
    eager = copy.deepcopy(model)
    images = torch.randn(3, 3, 7, 5).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aotforge")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    for _ in range(3):
        for step, optimizer in zip((compiled, eager), optimizers):
            optimizer.zero_grad()
            step(images).square().mean().backward()
            optimizer.step()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    for (name, b), q in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, q, rtol=1e-5, atol=1e-6, msg=name)
