"""Whole models through ``torch.compile(backend="aotforge")`` with the Triton path forced on
the CPU: a training step (loss, gradients, updated parameters and batch-norm buffers) and
inference must equal eager in float64."""
from __future__ import annotations

import copy

import pytest
import torch

import aotforge  # noqa: F401  (registers the backend)
from aotforge.compiler import observe
from aotforge.config import config

from .models import MODELS, example_input


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_matches_eager(name):
    torch.manual_seed(0)
    eager = MODELS[name]().double()
    compiled_model = copy.deepcopy(eager)
    x = example_input(name, torch.float64)
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        compiled = torch.compile(compiled_model, backend="aotforge")
        loss = compiled(x).square().mean()
        loss.backward()
    assert [g.kind for g in graphs] == ["forward", "backward"]
    assert all(g.path == "triton" and g.kernels for g in graphs)
    expected = eager(x).square().mean()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (parameter, p), (_, q) in zip(compiled_model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}.{parameter}.grad: {m}")
    for model in (eager, compiled_model):
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    for (parameter, p), (_, q) in zip(compiled_model.state_dict().items(), eager.state_dict().items()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}.{parameter} after the step: {m}")


@pytest.mark.parametrize("name", list(MODELS))
def test_inference_matches_eager(name):
    torch.manual_seed(0)
    eager = MODELS[name]().double().eval()
    x = example_input(name, torch.float64)
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), torch.no_grad(), observe() as graphs:
        actual = torch.compile(copy.deepcopy(eager), backend="aotforge")(x)
        expected = eager(x)
    assert [(g.kind, g.path) for g in graphs] == [("inference", "triton")]
    torch.testing.assert_close(actual, expected)
