"""Effect tokens (issue 12): side-effectful ops stay in the graphs, in order, through forward
and backward; tokens never reach the user; the linalg backward (whose error checks torch 2.13
registers as effectful) works. Each case compares with eager."""
import io
import contextlib

import pytest
import torch

import aotforge
from aotforge import aot_function, nop
from aotforge.partition import default_partition
from aotforge.partition.mincut import min_cut_rematerialization_partition
from aotforge.testing import Inputs, verify

from .test_eager_contract import _aot_module_compile, _dynamo_compile

D = torch.float64


def _mincut_compile(fn, mode):
    return aot_function(fn, nop, nop, partition_fn=min_cut_rematerialization_partition)


COMPILES = {
    "aot_function": lambda fn, mode: aot_function(fn, nop, nop),
    "aot_function_mincut": _mincut_compile,
    "aot_module": _aot_module_compile,
    "dynamo": _dynamo_compile,
}


def _well_conditioned(n=4):
    a = torch.randn(n, n, dtype=D)
    return (a @ a.mT + n * torch.eye(n, dtype=D)).requires_grad_()


LINALG = {
    "inv": (lambda a: torch.linalg.inv(a), lambda: (_well_conditioned(),)),
    "solve": (lambda a, b: torch.linalg.solve(a, b), lambda: (_well_conditioned(), torch.randn(4, 2, dtype=D, requires_grad=True))),
    "cholesky": (lambda a: torch.linalg.cholesky(a), lambda: (_well_conditioned(),)),
    "eig": (lambda a: torch.linalg.eig(a)[0].real, lambda: (_well_conditioned(),)),
    "inv_ex_chain": (lambda a: torch.linalg.inv(torch.linalg.inv(a) * 2).sin(), lambda: (_well_conditioned(),)),
}


@pytest.mark.parametrize("compile_name", sorted(COMPILES))
@pytest.mark.parametrize("case", sorted(LINALG))
def test_linalg_backward_matches_eager(case, compile_name):
    fn, make_inputs = LINALG[case]
    verify(fn, make_inputs, compile=COMPILES[compile_name], modes=("train", "inference"), rtol=1e-6, atol=1e-6)


def test_linalg_error_still_raised():
    """The error check runs in the compiled graph: a singular matrix raises as in eager."""
    compiled = aot_function(lambda a: torch.linalg.inv(a), nop, nop)
    singular = torch.zeros(3, 3, dtype=D, requires_grad=True)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.inv(singular)
    with pytest.raises(torch.linalg.LinAlgError):
        compiled(singular)


def _printed(fn, *args):
    """What ``fn`` prints through aten._print (C++ std::cout), captured at the fd level."""
    import os
    import tempfile

    with tempfile.TemporaryFile(mode="w+b") as capture:
        stdout = os.dup(1)
        try:
            os.dup2(capture.fileno(), 1)
            result = fn(*args)
            if isinstance(result, torch.Tensor) and result.requires_grad:
                result.sum().backward()
        finally:
            os.dup2(stdout, 1)
            os.close(stdout)
        capture.seek(0)
        return result, capture.read().decode().split()


class _PrintInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        torch.ops.aten._print("backward")
        return grad * 2


def _prints_everywhere(x):
    torch.ops.aten._print("first")
    y = x.sin()
    torch.ops.aten._print("second")
    z = _PrintInBackward.apply(y)
    torch.ops.aten._print("third")
    return z.cos()


@pytest.mark.parametrize("compile_name", ["aot_function", "aot_function_mincut", "aot_module"])
def test_prints_run_in_order_forward_and_backward(compile_name):
    compiled = COMPILES[compile_name](_prints_everywhere, "train")
    x = torch.randn(3, dtype=D, requires_grad=True)
    expected, eager_lines = _printed(_prints_everywhere, x)
    eager_grad = x.grad
    x.grad = None
    for _ in range(2):  # the second call reuses the compiled graphs
        actual, lines = _printed(compiled, x)
        assert lines == eager_lines == ["first", "second", "third", "backward"]
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(x.grad, eager_grad)
        x.grad = None


def test_prints_in_inference():
    compiled = aot_function(_prints_everywhere, nop, nop)
    x = torch.randn(3, dtype=D)
    _, lines = _printed(compiled, x)
    assert lines == ["first", "second", "third"]


def test_tokens_stay_inside_the_graphs():
    """No token is an input or output of a compiled graph (the user's inputs and outputs are
    exactly eager's), and every chain starts at _make_token and ends in _sink_tokens."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return nop(gm, example_inputs)

    compiled = aot_function(_prints_everywhere, keep, keep)
    x = torch.randn(3, dtype=D, requires_grad=True)
    with contextlib.redirect_stdout(io.StringIO()):
        _printed(compiled, x)
    forward, backward = graphs
    for gm in (forward, backward):
        placeholders = gm.graph.find_nodes(op="placeholder")
        assert not any("token" in p.name for p in placeholders)
        assert gm.graph.find_nodes(op="call_function", target=torch.ops.prims._sink_tokens.default)
        assert gm.graph.find_nodes(op="call_function", target=torch.ops.prims._make_token.default)
    # forward: primals only; backward: saved values and one tangent
    assert len(forward.graph.find_nodes(op="placeholder")) == 1


def test_partitioners_agree_on_effects():
    for partition in (default_partition, min_cut_rematerialization_partition):
        compiled = aot_function(_prints_everywhere, nop, nop, partition_fn=partition)
        x = torch.randn(3, dtype=D, requires_grad=True)
        _, lines = _printed(compiled, x)
        assert lines == ["first", "second", "third", "backward"]


@pytest.fixture(scope="module")
def effectful_custom_op():
    """A custom op registered through torch.library and marked as ordered-effectful."""
    from torch._higher_order_ops import effects as torch_effects
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    log: list = []
    lib = torch.library.Library("aotforge_test_effects", "FRAGMENT")  # noqa: TOR901
    lib.define("record(Tensor x, str tag) -> ()")

    def record(x, tag):
        log.append((tag, float(x.detach().sum())))

    lib.impl("record", record, "CompositeExplicitAutograd")
    lib._register_fake("record", lambda x, tag: None)
    handle = _register_effectful_op(torch.ops.aotforge_test_effects.record.default, _EffectType.ORDERED)
    yield torch.ops.aotforge_test_effects.record.default, log
    if hasattr(handle, "destroy"):  # torch >= 2.12 returns a registration handle
        handle.destroy()
    else:
        torch_effects._deregister_effectful_op(torch.ops.aotforge_test_effects.record.default)
    lib._destroy()


def test_custom_effectful_op(effectful_custom_op):
    record, log = effectful_custom_op

    def fn(x):
        record(x, "in")
        y = x * 3
        record(y, "out")
        return y.exp()

    compiled = aot_function(fn, nop, nop)
    x = torch.randn(4, dtype=D, requires_grad=True)
    log.clear()
    expected = fn(x)
    eager_log = list(log)
    log.clear()
    actual = compiled(x)
    assert log == eager_log and [tag for tag, _ in log] == ["in", "out"]
    torch.testing.assert_close(actual, expected)
    actual.sum().backward()
    torch.testing.assert_close(x.grad, (3 * (3 * x).exp()).detach())


def test_with_effects_called_directly():
    """A function that calls the with_effects operator itself is not an effect of ours to
    thread, but it still runs, in order, and returns eager's values."""
    from torch._higher_order_ops.effects import with_effects

    def fn(x):
        token = torch.tensor([])
        token, _ = with_effects(token, torch.ops.aten._print.default, "direct")
        return x + token.numel()

    compiled = aot_function(fn, nop, nop)
    x = torch.randn(2, dtype=D)
    _, lines = _printed(compiled, x)
    assert lines == ["direct"]
    torch.testing.assert_close(compiled(x), fn(x))
