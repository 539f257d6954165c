"""Functionalized RNG (issue 12): random ops that the backward recomputes (checkpoint, min-cut)
redraw the forward's numbers, the global generator advances as eager's, and generator changes
inside the function follow eager or raise. Each case compares with eager: values, gradients
and the generator state after the step."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import aotforge
from aotforge import aot_function, aot_module, nop
from aotforge.aot.rng import RngError
from aotforge.partition.mincut import min_cut_rematerialization_partition

D = torch.float64


def _dynamo(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aotforge_eager", fullgraph=False, dynamic=False)


def _module(fn):
    class Wrapper(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    return aot_module(Wrapper(), nop, nop)


def _mincut(budget):
    def compile_fn(fn):
        def partition(joint, inputs, **kwargs):
            return min_cut_rematerialization_partition(joint, inputs, memory_budget=budget, **kwargs)
        return aot_function(fn, nop, nop, partition_fn=partition)
    return compile_fn


COMPILES = {
    "aot_function": lambda fn: aot_function(fn, nop, nop),
    "aot_module": _module,
    "dynamo": _dynamo,
    "mincut_budget_0": _mincut(0.0),
}


def _step(fn, make_args, seed=0):
    """One training step from a seeded generator: output, gradients, generator state after."""
    torch.manual_seed(1234)
    args = make_args()
    torch.manual_seed(seed)
    out = fn(*args)
    loss = out.sum() if out.dim() else out
    loss.backward()
    grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return out.detach(), grads, torch.get_rng_state()


def _assert_steps_equal(actual, expected):
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
    for a, e in zip(actual[1], expected[1]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert torch.equal(actual[2], expected[2]), "the CPU generator state after the step differs from eager's"


def _dropout_block(x, w):
    return torch.nn.functional.dropout((x @ w).sin(), 0.4, True).cos()


def checkpointed_dropout(x, w):
    return checkpoint(_dropout_block, x, w, use_reentrant=False)


def two_checkpoints(x, w):
    y = checkpoint(_dropout_block, x, w, use_reentrant=False)
    z = torch.nn.functional.dropout(y, 0.2, True)
    return checkpoint(_dropout_block, z, w, use_reentrant=False) + torch.rand_like(z)


def plain_dropouts(x, w):
    y = torch.nn.functional.dropout(x @ w, 0.5, True)
    mask = torch.bernoulli(torch.full_like(y, 0.3))
    return (y * mask).tanh() + torch.rand(y.shape, dtype=D)


def _inputs():
    return (torch.randn(6, 5, dtype=D, requires_grad=True), torch.randn(5, 5, dtype=D, requires_grad=True))


@pytest.mark.parametrize("compile_name", sorted(COMPILES))
@pytest.mark.parametrize("fn", [checkpointed_dropout, two_checkpoints, plain_dropouts], ids=lambda f: f.__name__)
def test_matches_eager_on_cpu(fn, compile_name):
    """On the CPU random ops run through ATen on eager's generator, saving the state they
    drew from for the backward's redraws: masks, gradients and generator state are eager's."""
    compiled = COMPILES[compile_name](fn)
    expected = _step(fn, _inputs)
    for seed in (0, 0, 7):  # the second call reuses the compiled graphs
        if seed:
            expected = _step(fn, _inputs, seed)
        _assert_steps_equal(_step(compiled, _inputs, seed), expected)


def test_checkpoint_without_functionalized_rng_raises():
    """Without functionalization the backward's redraw would silently differ: refuse."""
    with aotforge.config.patch(functionalize_rng=False):
        compiled = aot_function(checkpointed_dropout, nop, nop)
        with pytest.raises(RngError, match="functionalize_rng"):
            compiled(*_inputs())


def test_module_training_loop_with_dropout():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16, dtype=D), torch.nn.GELU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 4, dtype=D)
    )
    reference = torch.nn.Sequential(
        torch.nn.Linear(8, 16, dtype=D), torch.nn.GELU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 4, dtype=D)
    )
    reference.load_state_dict(model.state_dict())
    compiled = aot_module(model, nop, nop, partition_fn=min_cut_rematerialization_partition)
    x = torch.randn(32, 8, dtype=D)
    for step in range(3):
        torch.manual_seed(step)
        expected = reference(x)
        expected.square().sum().backward()
        state = torch.get_rng_state()
        torch.manual_seed(step)
        actual = compiled(x)
        actual.square().sum().backward()
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        assert torch.equal(torch.get_rng_state(), state)
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_inference_draws_like_eager():
    compiled = aot_function(plain_dropouts, nop, nop)
    x, w = (t.detach() for t in _inputs())
    with torch.no_grad():
        torch.manual_seed(3)
        expected = plain_dropouts(x, w)
        state = torch.get_rng_state()
        torch.manual_seed(3)
        actual = compiled(x, w)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), state)


def test_compiling_leaves_the_generator_alone():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    compiled = aot_function(two_checkpoints, nop, nop)
    args = _inputs()
    torch.set_rng_state(before)
    compiled(*args).sum().backward()
    after_compiled = torch.get_rng_state()
    torch.set_rng_state(before)
    two_checkpoints(*args).sum().backward()
    assert torch.equal(after_compiled, torch.get_rng_state())


# --- generator changes inside the function ------------------------------------------------


def _reseeds(x):
    torch.manual_seed(0)
    return torch.nn.functional.dropout(x, 0.5, True)


def _reseeds_without_drawing(x):
    torch.manual_seed(0)
    return x * 2


def _draws_from_own_generator(x):
    generator = torch.Generator().manual_seed(0)
    return x * torch.rand(x.shape, generator=generator, dtype=D)


def _rewinds(x):
    state = torch.get_rng_state()
    y = torch.nn.functional.dropout(x, 0.5, True)
    torch.set_rng_state(state)
    return y


def _restores_with_fork_rng(x):
    state = torch.get_rng_state()
    y = torch.nn.functional.dropout(x, 0.5, True)
    with torch.random.fork_rng():
        torch.set_rng_state(state)
        z = torch.nn.functional.dropout(x, 0.5, True)  # the same mask again, as in eager
    return y + z + torch.nn.functional.dropout(x, 0.5, True)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize(
    "fn, message",
    [(_reseeds, "reseeds"), (_reseeds_without_drawing, "reseeds"), (_draws_from_own_generator, "torch.Generator"),
     (_rewinds, "rewound")],
    ids=["manual_seed", "manual_seed_no_draw", "own_generator", "rewind"],
)
def test_generator_changes_raise(fn, message, grad):
    compiled = aot_function(fn, nop, nop)
    x = torch.randn(8, dtype=D, requires_grad=grad)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    with pytest.raises(RngError, match=message):
        compiled(x)
    assert torch.equal(torch.get_rng_state(), state), "a failed compile must not move the generator"


def test_fork_rng_restore_follows_eager():
    compiled = aot_function(_restores_with_fork_rng, nop, nop)
    make = lambda: (torch.randn(16, dtype=D, requires_grad=True),)  # noqa: E731
    _assert_steps_equal(_step(compiled, make), _step(_restores_with_fork_rng, make))


# --- the philox scheme (what CUDA, and CPU kernels, use) --------------------------------------


@pytest.fixture
def philox_on_cpu(monkeypatch):
    """Triton-on-CPU (tests) selects the philox scheme for CPU tensors; the graphs run as FX
    here, so the philox draws run through the reference implementation."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with aotforge.config.patch(triton_on_cpu=True):
        yield


def _graphs_of(fn, **kwargs):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return nop(gm, example_inputs)

    return aot_function(fn, keep, keep, **kwargs), graphs


def _dropout_scaled(x, w):
    return torch.nn.functional.dropout(x, 0.25, True) * w


def test_philox_redraw_matches_forward_mask(philox_on_cpu):
    """The backward's redraw (checkpoint) gives the forward's mask: the gradient is exactly
    mask * scale * w for the mask the forward output shows."""
    fn = lambda x, w: checkpoint(_dropout_scaled, x, w, use_reentrant=False)  # noqa: E731
    compiled, graphs = _graphs_of(fn)
    x = torch.rand(4000, dtype=D).add_(0.5).requires_grad_()
    w = torch.randn(4000, dtype=D)
    out = compiled(x, w)
    out.sum().backward()
    kept = out.detach() != 0
    torch.testing.assert_close(x.grad, kept.to(D) * w / 0.75, rtol=1e-14, atol=0)
    forward, backward = graphs
    philox_in = lambda gm: gm.graph.find_nodes(op="call_function", target=torch.ops.aotforge.philox_rand.default)  # noqa: E731
    assert philox_in(forward) and philox_in(backward), "the backward recomputes the draw"
    assert abs(kept.double().mean().item() - 0.75) < 0.03


def test_philox_mincut_recomputes_draw(philox_on_cpu):
    """Philox draws are pure, so min-cut may recompute them instead of saving the mask."""
    def fn(x):
        return torch.nn.functional.dropout(x.exp(), 0.5, True).sin()

    def partition(joint, inputs, **kwargs):
        return min_cut_rematerialization_partition(joint, inputs, memory_budget=0.0, **kwargs)

    compiled, graphs = _graphs_of(fn, partition_fn=partition)
    x = torch.randn(1000, dtype=D, requires_grad=True)
    out = compiled(x)
    out.sum().backward()
    kept = out.detach() != 0
    y = x.detach().exp() * 2
    torch.testing.assert_close(x.grad, kept.to(D) * y.cos() * y, rtol=1e-12, atol=1e-12)


def test_philox_reproducible_and_advancing(philox_on_cpu):
    compiled = aot_function(_dropout_scaled, nop, nop)
    x = torch.ones(2000, dtype=D, requires_grad=True)
    w = torch.ones(2000, dtype=D)
    torch.manual_seed(0)
    first = compiled(x, w)
    second = compiled(x, w)
    torch.manual_seed(0)
    again = compiled(x, w)
    assert torch.equal(first, again), "the same generator state draws the same mask"
    assert not torch.equal(first, second), "the next step draws a new mask"
    # the CPU generator advanced as eager's dropout would have advanced it
    torch.manual_seed(0)
    compiled(x, w)
    state = torch.get_rng_state()
    torch.manual_seed(0)
    _dropout_scaled(x, w)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("fn", [two_checkpoints, plain_dropouts], ids=lambda f: f.__name__)
def test_fallback_random_matches_eager_bitwise(philox_on_cpu, fn):
    with aotforge.config.patch(fallback_random=True):
        compiled = aot_function(fn, nop, nop)
        _assert_steps_equal(_step(compiled, _inputs), _step(fn, _inputs))


def test_philox_reference_matches_known_values():
    """The reference counter-based generator: uniform in [0, 1), a pure function of
    (seed, counter), offsets shift the stream."""
    from aotforge.philox import philox_rand

    seed = torch.tensor(42, dtype=torch.int64)
    a = philox_rand(seed, 0, [1000], torch.float32)
    b = philox_rand(seed, 10, [990], torch.float32)
    assert torch.equal(a[10:], b)
    assert 0 <= a.min() and a.max() < 1
    assert abs(a.mean().item() - 0.5) < 0.03
    assert not torch.equal(a, philox_rand(seed + 1, 0, [1000], torch.float32))


def test_manual_seed_under_dynamo_follows_eager():
    """Under torch.compile, Dynamo runs torch.manual_seed itself (a graph break), and the graphs
    after it draw from the reseeded generator: values, gradients and state equal eager's."""
    def fn(x):
        torch.manual_seed(0)
        return torch.nn.functional.dropout(x, 0.5, True) * torch.rand(x.shape, dtype=D)

    make = lambda: (torch.randn(16, dtype=D, requires_grad=True),)  # noqa: E731
    _assert_steps_equal(_step(_dynamo(fn), make, seed=5), _step(fn, make, seed=5))
