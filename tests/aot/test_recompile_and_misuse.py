"""A compiled graph is never reused after something it was traced with changed (module
modes, autocast dtype, module attributes, globals, hooks, parameters), and misuse of the API
is a clear error when the compiled function is made or first called (issue 11)."""
import math

import numpy as np
import pytest
import torch

from aotforge import aot_function, aot_module, nop
from aotforge.testing import verify_module

D = torch.float64


class DropoutNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4).double()
        self.dropout = torch.nn.Dropout(0.5)
        self.norm = torch.nn.BatchNorm1d(4).double()

    def forward(self, x):
        return self.norm(self.dropout(self.linear(x)))


def _same_as_eager_after_mode_switch(compile_module):
    torch.manual_seed(0)
    model, reference = DropoutNet(), DropoutNet()
    reference.load_state_dict(model.state_dict())
    compiled = compile_module(model)
    x = torch.randn(8, 4, dtype=D)
    for train in (True, False, True, False):
        model.train(train)
        reference.train(train)
        torch.manual_seed(1)
        out = compiled(x)
        torch.manual_seed(1)
        expected = reference(x)
        torch.testing.assert_close(out, expected, msg=lambda m: f"train={train}: {m}")
        torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean)
        torch.testing.assert_close(model.norm.num_batches_tracked, reference.norm.num_batches_tracked)


def test_aot_module_recompiles_after_train_eval_switch():
    _same_as_eager_after_mode_switch(lambda model: aot_module(model, nop, nop))


def test_aot_function_over_a_module_recompiles_after_train_eval_switch():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).double().requires_grad_(False)
    compiled = aot_function(lambda x: model(x), nop, nop)
    x = torch.randn(8, 4, dtype=D, requires_grad=True)
    for train in (True, False, True, False):
        model.train(train)
        torch.manual_seed(1)
        out = compiled(x)
        torch.manual_seed(1)
        torch.testing.assert_close(out, model(x), msg=lambda m: f"train={train}: {m}")


def test_closed_over_parameters_that_require_grad_are_a_clear_error():
    model = torch.nn.Linear(3, 2).double()
    compiled = aot_function(lambda x: model(x), nop)
    with pytest.raises(RuntimeError, match="requires grad but is not one of its arguments.*aot_module"):
        compiled(torch.randn(4, 3, dtype=D))
    with torch.no_grad():  # no gradient to lose: fine, and equal to eager
        torch.testing.assert_close(compiled(torch.ones(4, 3, dtype=D)), model(torch.ones(4, 3, dtype=D)))


def test_module_closing_over_a_fake_tensor_is_rejected_when_compiled():
    from torch._subclasses.fake_tensor import FakeTensorMode

    class HoldsFake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with FakeTensorMode():
                self.table = torch.randn(3)

        def forward(self, x):
            return x + self.table

    with pytest.raises(ValueError, match="HoldsFake.table is a FakeTensor"):
        aot_module(HoldsFake(), nop)
    gm = torch.fx.symbolic_trace(HoldsFake())
    with pytest.raises(ValueError, match="FakeTensor"):
        aot_module(gm, nop)


def test_recompiles_after_module_attribute_change():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = 2.0
            self.use_sin = False

        def forward(self, x):
            y = x * self.factor
            return y.sin() if self.use_sin else y

    model = Scale()
    compiled = aot_module(model, nop)
    x = torch.randn(3, dtype=D)
    for factor, use_sin in ((2.0, False), (3.0, False), (3.0, True)):
        model.factor, model.use_sin = factor, use_sin
        torch.testing.assert_close(compiled(x), model(x))


SCALE = 2.0


def _uses_global(x):
    return x * SCALE


def test_recompiles_after_global_change():
    global SCALE
    compiled = aot_function(_uses_global, nop)
    x = torch.randn(3, dtype=D)
    try:
        for value in (2.0, 5.0):
            SCALE = value
            torch.testing.assert_close(compiled(x), _uses_global(x))
    finally:
        SCALE = 2.0


def test_recompiles_after_closure_value_change():
    offset = 1.0

    def f(x):
        return x + offset

    compiled = aot_function(f, nop)
    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(compiled(x), f(x))
    offset = 4.0
    torch.testing.assert_close(compiled(x), f(x))


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook"])
def test_recompiles_after_hook_added_and_removed(kind):
    model = torch.nn.Linear(3, 3).double()
    compiled = aot_module(model, nop, nop)
    x = torch.randn(2, 3, dtype=D)
    torch.testing.assert_close(compiled(x), model(x))
    if kind == "forward_hook":
        handle = model.register_forward_hook(lambda mod, args, out: out * 10)
    else:
        handle = model.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
    torch.testing.assert_close(compiled(x), model(x))
    handle.remove()
    torch.testing.assert_close(compiled(x), model(x))


def test_recompiles_after_autocast_dtype_change():
    compiled = aot_function(lambda a, b: a @ b, nop)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            out, expected = compiled(a, b), a @ b
        assert out.dtype == expected.dtype == dtype
        torch.testing.assert_close(out, expected)


def test_parameter_added_after_first_call_gets_a_gradient():
    class Growing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, dtype=D))

        def forward(self, x):
            out = x * self.weight
            if hasattr(self, "bias"):
                out = out + self.bias
            return out

    model = Growing()
    compiled = aot_module(model, nop, nop)
    x = torch.randn(3, dtype=D)
    compiled(x).sum().backward()
    model.bias = torch.nn.Parameter(torch.randn(3, dtype=D))
    model.zero_grad()
    out = compiled(x)
    torch.testing.assert_close(out, model(x))
    out.pow(2).sum().backward()
    assert model.bias.grad is not None
    expected = torch.autograd.grad(model(x).pow(2).sum(), model.bias)[0]
    torch.testing.assert_close(model.bias.grad, expected)


def test_aot_module_trains_like_eager_across_mode_switches():
    verify_module(lambda: DropoutNet().eval(), lambda model: aot_module(model, nop, nop), lambda: torch.randn(6, 4, dtype=D))


# --- non-tensor arguments --------------------------------------------------------------------
def test_float_arguments_key_the_cache_by_value_and_nan_equals_itself():
    compiled = aot_function(lambda x, scale: x * scale, nop)
    x = torch.randn(3, dtype=D, requires_grad=True)
    for scale in (2.0, 3.0, 2.0):
        torch.testing.assert_close(compiled(x, scale), x * scale)
    assert len(compiled._aotforge_cache) == 2
    for _ in range(3):
        out = compiled(x, float("nan"))
        assert torch.isnan(out).all()
    assert len(compiled._aotforge_cache) == 3


def test_changing_float_argument_through_torch_compile():
    def f(x, scale):
        return (x * scale).sin()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aotforge_eager")
    for scale in (2.0, 3.5, -1.25, float("nan")):
        x = torch.randn(4, dtype=D, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out, expected = compiled(x, scale), f(x_ref, scale)
        torch.testing.assert_close(out, expected, equal_nan=True)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, equal_nan=True)
    torch._dynamo.reset()


def test_numpy_argument_is_a_clear_error_on_the_first_call():
    compiled = aot_function(lambda x, a: x * 2, nop)
    with pytest.raises(TypeError, match="numpy.ndarray.*torch.from_numpy"):
        compiled(torch.randn(3), np.ones(3))


# --- misuse ----------------------------------------------------------------------------------
def test_aot_function_of_a_module_points_to_aot_module():
    with pytest.raises(TypeError, match="aot_module"):
        aot_function(torch.nn.Linear(2, 2), nop)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bw_compiler": 3}, "bw_compiler must be callable"),
        ({"partition_fn": 3}, "partition_fn must be callable"),
        ({"inference_compiler": "x"}, "inference_compiler must be callable"),
        ({"decompositions": 3}, "decompositions must be a dict"),
        ({"decompositions": {"add": lambda a, b: a}}, "not an ATen op"),
        ({"decompositions": {torch.ops.aten.add.Tensor: 1}}, "must be callable"),
    ],
)
@pytest.mark.parametrize("entry", ["aot_function", "aot_module"])
def test_arguments_are_validated_when_the_compiled_function_is_made(kwargs, match, entry):
    with pytest.raises(TypeError, match=match):
        if entry == "aot_function":
            aot_function(lambda x: x * 2, nop, **kwargs)
        else:
            aot_module(torch.nn.Linear(2, 2), nop, **kwargs)


def test_functorch_keywords_are_accepted():
    def f(x, buf):
        buf.add_(1)
        return x.sin() * buf

    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = aot_function(f, compiler, enable_log=False, disable_functionalization=True)
    x = torch.randn(3, dtype=D, requires_grad=True)
    buf, buf_ref = torch.zeros(3, dtype=D), torch.zeros(3, dtype=D)
    x_ref = x.detach().clone().requires_grad_()
    for _ in range(2):
        out, expected = compiled(x, buf), f(x_ref, buf_ref)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(buf, buf_ref)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
    # disable_functionalization keeps the in-place op in the graph, as functorch does.
    assert any(n.target is torch.ops.aten.add_.Tensor for g in graphs for n in g.graph.nodes)
