"""Lowering of functionalized RNG's draws (aotforge::philox_rand): the Triton kernels (run on
the CPU by Triton's interpreter) generate the random numbers from the seed and the counters,
equal to the reference implementation bit for bit; a training step through backend="aotforge"
redraws the forward's mask in the backward, at the right rate, and the generator advances as
eager's."""
import pytest
import torch

import aotforge
from aotforge.compiler import compile_fx_inner
from aotforge.config import config
from aotforge.philox import philox_rand
from tests.compiler.helpers import trace

D = torch.float64


def _compile(fn, *args):
    gm = trace(fn, *args)
    with config.patch(triton_on_cpu=True):
        compiled = compile_fx_inner(gm, list(args))
        outputs = compiled(list(args))
    return outputs, compiled.compiled_graph.stats, gm


@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 7, 2**62 + 99])
@pytest.mark.parametrize("offset", [0, 17, 2**33])
def test_kernel_draws_equal_reference(seed, offset):
    seed_tensor = torch.tensor(seed, dtype=torch.int64)

    def fn(s, x):
        return (philox_rand(s, offset, [37, 29], torch.float32) * x,)

    x = torch.ones(37, 29)
    (out,), stats, _ = _compile(fn, seed_tensor, x)
    assert stats["lowered"].get("aotforge.philox_rand.default") == 1 and not stats["fallbacks"]
    expected = philox_rand(seed_tensor, offset, [37, 29], torch.float32)
    assert torch.equal(out, expected)


def test_draw_is_generated_in_the_kernel():
    seed = torch.tensor(5, dtype=torch.int64)

    def fn(s, x):
        keep = philox_rand(s, 0, [64], torch.float32) >= 0.5
        return (x * keep * 2.0,)

    x = torch.randn(64)
    (out,), stats, _ = _compile(fn, seed, x)
    assert stats["kernels"] == 1 and stats["externs"] == 0 and not stats["fallbacks"]
    source = stats["kernel_source"]
    assert "tl.rand(" in source
    # the draw becomes a float32 in one call, its counter in 32 bits: no 64-bit arithmetic
    assert "tl.int64" not in source[source.index("def aot_"):], source
    torch.testing.assert_close(out, x * (philox_rand(seed, 0, [64], torch.float32) >= 0.5) * 2.0)


def test_dtype_and_rate():
    seed = torch.tensor(9, dtype=torch.int64)

    def fn(s):
        return (philox_rand(s, 3, [20000], D),)

    (out,), _, _ = _compile(fn, seed)
    assert out.dtype == D
    assert torch.equal(out, philox_rand(seed, 3, [20000], D))
    assert abs(out.mean().item() - 0.5) < 0.01 and 0 <= out.min() and out.max() < 1


class _Net(torch.nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed
        self.linear = torch.nn.Linear(64, 64)

    def block(self, x):
        return torch.nn.functional.dropout(self.linear(x).relu(), 0.3, True)

    def forward(self, x):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_training_step_redraws_forward_mask(checkpointed):
    """backend="aotforge" with Triton on the CPU: the backward's gradient uses exactly the
    forward's mask (recomputed in the kernel, not saved), 30% dropped, the generator state
    after the step equals eager's."""
    torch.manual_seed(0)
    model = _Net(checkpointed)
    x = torch.randn(256, 64)
    weight = torch.randn(256, 64)
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True):
        compiled = torch.compile(model, backend="aotforge")
        torch.manual_seed(1)
        out = compiled(x)
        (out * weight).sum().backward()
        state = torch.get_rng_state()
    kept = out.detach() != 0
    hidden = model.linear(x).relu().detach()
    alive = hidden != 0
    assert torch.equal(kept, kept & alive)
    rate = kept[alive].float().mean().item()
    assert abs(rate - 0.7) < 0.02
    # grad of linear.bias = sum over rows of weight * mask / 0.7 where relu is active
    expected_bias = (weight * kept / 0.7 * alive).sum(0)
    torch.testing.assert_close(model.linear.bias.grad, expected_bias, rtol=1e-4, atol=1e-4)
    # eager draws one dropout's worth (checkpoint's recompute restores the state it redraws)
    torch.manual_seed(1)
    eager_out = model(x)
    (eager_out * weight).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)


class _Mixed(torch.nn.Module):
    """Dropout under checkpoint, an effectful print and a linalg backward, in one graph."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def block(self, x):
        return torch.nn.functional.dropout(self.linear(x).relu(), 0.3, True)

    def forward(self, x):
        torch.ops.aten._print("forward")
        y = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return torch.linalg.inv(y[:4, :4] + 4 * torch.eye(4)) + y.sum()


def test_fallback_random_through_the_compiler_matches_eager():
    """fallback_random: dropout runs through ATen on eager's generator, saving the state its
    redraw in the backward uses: outputs, gradients and generator state equal eager's."""
    torch.manual_seed(0)
    model = _Mixed()
    x = torch.randn(8, 16)
    torch.manual_seed(1)
    expected = model(x)
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    expected_state = torch.get_rng_state()
    model.zero_grad()
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True, fallback_random=True):
        compiled = torch.compile(model, backend="aotforge")
        torch.manual_seed(1)
        actual = compiled(x)
        actual.sum().backward()
    assert torch.equal(torch.get_rng_state(), expected_state)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    for parameter, grad in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(parameter.grad, grad, rtol=1e-5, atol=1e-5)
