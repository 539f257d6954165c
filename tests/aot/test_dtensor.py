"""DTensor through torch.compile(backend="aotforge") on the CPU, forward and backward, on
torch's fake process group (world size 2, one process: collectives do not move data, the
same in eager and compiled runs), compared with eager: local shards, placements, gradients."""
from __future__ import annotations

import pytest
import torch

distributed = pytest.importorskip("torch.distributed")
if not distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import aotforge  # noqa: E402,F401  registers the backends

from .test_subclasses import assert_same  # noqa: E402

DOUBLE = torch.float64


@pytest.fixture(scope="module")
def mesh():
    if distributed.is_initialized():
        pytest.skip("a process group is already initialized")
    distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        distributed.destroy_process_group()


def mlp(x, w1, w2):
    return (torch.relu(x @ w1) @ w2).sum(dim=1), x.view(-1)


def make_inputs(mesh):
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(4, 3, dtype=DOUBLE), mesh, [Shard(0)]).requires_grad_()
    w1 = distribute_tensor(torch.randn(3, 5, dtype=DOUBLE), mesh, [Replicate()]).requires_grad_()
    w2 = distribute_tensor(torch.randn(5, 2, dtype=DOUBLE), mesh, [Replicate()]).requires_grad_()
    return x, w1, w2


def assert_same_dtensor(actual, expected, what):
    assert isinstance(actual, DTensor), f"{what}: {type(actual).__name__} is not a DTensor"
    assert actual.placements == expected.placements, f"{what}: {actual.placements} != eager {expected.placements}"
    assert actual.shape == expected.shape
    assert_same(actual.to_local().detach(), expected.to_local().detach(), what)


@pytest.mark.parametrize("backend", ["aotforge", "aotforge_eager"])
def test_dtensor_forward_and_backward(mesh, backend):
    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend=backend)
    for call in range(2):
        results = []
        for fn in (compiled, mlp):
            args = make_inputs(mesh)
            out, view = fn(*args)
            out.sum().backward()
            results.append((out, view, args))
        (out, view, args), (e_out, e_view, e_args) = results
        assert_same_dtensor(out, e_out, f"call {call} output")
        assert_same_dtensor(view, e_view, f"call {call} view output")
        assert view._base is args[0], "the view output must alias the input, as in eager"
        for i, (a, e) in enumerate(zip(args, e_args)):
            assert_same_dtensor(a.grad, e.grad, f"call {call}, gradient of input {i}")


def test_dtensor_input_mutation(mesh):
    def fn(x, y):
        x.add_(y)
        return x * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aotforge")
    results = []
    for function in (compiled, fn):
        torch.manual_seed(0)
        x = distribute_tensor(torch.randn(4, 3, dtype=DOUBLE), mesh, [Shard(0)])
        y = distribute_tensor(torch.randn(4, 3, dtype=DOUBLE), mesh, [Shard(0)])
        results.append((function(x, y), x))
    (out, x), (e_out, e_x) = results
    assert_same_dtensor(out, e_out, "output")
    assert_same_dtensor(x, e_x, "input after the call")
