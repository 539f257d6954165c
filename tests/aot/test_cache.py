"""aot/cache.py: an AOT compile described as plain data (JSON), and the runtime rebuilt from
that description around the same compiled graphs behaves as eager: values, gradients,
in-place updates of inputs."""
import json

import pytest
import torch
import torch.fx as fx

from aotforge.aot import aot_module_simplified
from aotforge.aot import cache as aot_cache
from aotforge.aot.api import bind_parameters, lifted_state
from aotforge.aot.boxing import make_boxed_func


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))

    def forward(self, x, calls):
        calls.add_(1)  # an input updated in place (as Dynamo passes a module's buffers)
        return (x @ self.weight).tanh(), x.sum()


def compile_capturing(gm: fx.GraphModule, args: list) -> tuple:
    compiled = {}

    def keep(kind):
        def compiler(graph, example_inputs):
            compiled[kind] = make_boxed_func(graph.forward)
            return compiled[kind]
        return compiler

    forward = aot_module_simplified(gm, args, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                    inference_compiler=keep("inference"), compile_backward_now=True)
    return forward, compiled


@pytest.mark.parametrize("grad", [True, False])
def test_rebuilt_runtime_matches_eager(grad):
    torch.manual_seed(0)
    module = Scaled()
    gm = fx.symbolic_trace(module)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=grad)
    calls, eager_calls = torch.zeros(()), torch.zeros(())
    with torch.set_grad_enabled(grad):
        forward, compiled = compile_capturing(gm, [x, calls])
    plan = json.loads(json.dumps(forward.aot_plan))  # plain data: survives JSON as it is
    assert plan["training"] is grad
    rebuilt = bind_parameters(aot_cache.rebuild(plan, compiled), lifted_state(gm)[0], gm)
    eager = Scaled()
    eager.load_state_dict(module.state_dict())
    for _ in range(2):  # the buffer counts calls: each must update the caller's buffer
        x1 = x.detach().clone().requires_grad_(grad)
        x2 = x.detach().clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            got, want = rebuilt(x1, calls), eager(x2, eager_calls)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e)
        torch.testing.assert_close(calls, eager_calls)
        if grad:
            got[0].sum().backward()
            want[0].sum().backward()
            torch.testing.assert_close(x1.grad, x2.grad)
            torch.testing.assert_close(module.weight.grad, eager.weight.grad)


def plan_of(fn, *args) -> tuple:
    gm = fx.symbolic_trace(fn)
    forward, _ = compile_capturing(gm, list(args))
    return forward.aot_plan, forward.aot_plan_missing


def test_views_of_inputs_are_described_and_replayed():
    """An output that is a view of an input: the plan keeps its view replay, and the rebuilt
    runtime hands back a real view of the caller's tensor (writing to it writes the input)."""
    gm = fx.symbolic_trace(lambda x: (x.t(), x * 2))
    x = torch.randn(2, 3)
    forward, compiled = compile_capturing(gm, [x])
    plan = json.loads(json.dumps(forward.aot_plan))
    rebuilt = aot_cache.rebuild(plan, compiled)
    y = torch.randn(2, 3)
    view, doubled = rebuilt([y])
    torch.testing.assert_close(doubled, y * 2)
    assert view._base is y and view.shape == (3, 2)
    view.mul_(0)
    assert torch.equal(y, torch.zeros(2, 3))


def test_duplicated_inputs_are_not_described():
    x = torch.randn(3)
    plan, why = plan_of(lambda a, b: a + b, x, x)
    assert plan is None and "DedupeInputs" in why


def test_a_plan_of_another_format_is_refused():
    x = torch.randn(3)
    plan, _ = plan_of(lambda a: a * 2, x)
    with pytest.raises(ValueError, match="format"):
        aot_cache.rebuild(dict(plan, format=0), {})
