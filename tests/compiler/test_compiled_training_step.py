"""A whole training step inside one ``torch.compile``d function (issue 37): forward,
``loss.backward()`` and an AdamW step, the most common form of a training script.

``loss.backward()`` runs aotforge's backward while Dynamo's frame hook is active; Dynamo must
not trace into aotforge's own wrappers (it did, and compiled pieces of them again: the step
failed with "cannot evaluate the symbolic size"). Compared with ``backend="eager"``, which
Dynamo compiles into the same frames: the same number of graphs, the same losses and
parameters, bit for bit on both CPU paths: the ATen path runs eager's kernels, the C++ path
keeps the ops whose eager kernel rounds its own way (GELU, LayerNorm, exp, sqrt...) as ATen
calls (config.cpu_eager_bits, aotforge/eager_rounding.py) and sums as eager does."""
from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler.runtime import cpp_build
from aotforge.config import config

from .models import TinyGPT

# the 1,000 steps with AOTFORGE_LONG_TESTS=1 (about 2 minutes per path on 2 busy cores)
LONG_STEPS = 1000 if os.environ.get("AOTFORGE_LONG_TESTS") == "1" else 50

needs_cpp = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                          torch.nn.Linear(32, 4))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layers(x), y)


def _batches(model_name: str, steps: int):
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if model_name == "gpt":
            yield (torch.randint(0, 50, (4, 16), generator=generator),
                   torch.randint(0, 50, (4, 16), generator=generator))
        else:
            yield torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)


def _run(backend: str, model_name: str, steps: int, optimizer_step: bool, dtype=torch.float32):
    """(losses, parameters, gradients, Dynamo's count of graphs) after ``steps`` calls."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = (TinyGPT() if model_name == "gpt" else Net()).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(*batch):
        if optimizer_step:
            optimizer.zero_grad()
        loss = model(*batch)
        loss.backward()
        if optimizer_step:
            optimizer.step()
        return loss

    compiled = torch.compile(step, backend=backend)
    losses = [compiled(*[b.to(dtype) if b.is_floating_point() else b for b in batch]).detach()
              for batch in _batches(model_name, steps)]
    graphs = counters["stats"]["unique_graphs"]
    return (losses, [p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()], graphs)


def _compare(got, expected, exact: bool):
    for what, have, want in zip(("losses", "parameters", "gradients"), got[:3], expected[:3]):
        for h, w in zip(have, want):
            if exact:
                assert torch.equal(h, w), what
            else:
                torch.testing.assert_close(h, w, rtol=1e-4, atol=1e-5, msg=what)
    # aotforge's own wrappers (the backward run under the step's frame) are never traced
    assert got[3] == expected[3], f"aotforge compiled {got[3]} graphs, eager's backend {expected[3]}"


@pytest.mark.parametrize("cpu_codegen", [pytest.param(True, marks=needs_cpp), False], ids=["cpp", "aten"])
def test_forward_and_backward_in_one_compiled_function(cpu_codegen):
    expected = _run("eager", "gpt", 3, optimizer_step=False)
    with config.patch(cpu_codegen=cpu_codegen):
        got = _run("aotforge", "gpt", 3, optimizer_step=False)
    _compare(got, expected, exact=True)


@pytest.mark.parametrize("cpu_codegen", [pytest.param(True, marks=needs_cpp), False], ids=["cpp", "aten"])
def test_whole_adamw_step_in_one_compiled_function(cpu_codegen):
    # AdamW turns a gradient that is zero up to rounding (the attention's key bias: softmax
    # ignores it) into a full step of either sign: any rounding of our own would show at once
    expected = _run("eager", "gpt", 6, optimizer_step=True)
    with config.patch(cpu_codegen=cpu_codegen):
        got = _run("aotforge", "gpt", 6, optimizer_step=True)
    _compare(got, expected, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cpu_codegen", [pytest.param(True, marks=needs_cpp), False], ids=["cpp", "aten"])
def test_many_adamw_steps_bit_identical(cpu_codegen, dtype):
    """The issue's criterion: zero_grad, forward (Linear, GELU, LayerNorm, MSE), backward and
    AdamW.step in one compiled function, every loss and the final parameters bit for bit
    ``backend="eager"``'s (1,000 steps with AOTFORGE_LONG_TESTS=1)."""
    expected = _run("eager", "mlp", LONG_STEPS, optimizer_step=True, dtype=dtype)
    with config.patch(cpu_codegen=cpu_codegen):
        got = _run("aotforge", "mlp", LONG_STEPS, optimizer_step=True, dtype=dtype)
    _compare(got, expected, exact=True)
