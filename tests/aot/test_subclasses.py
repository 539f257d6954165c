"""Tensor subclasses (__tensor_flatten__/__tensor_unflatten__) through aotforge, compared with
eager: output values, subclass types and inner tensors, gradients, inputs after the call,
aliasing. DTensor and jagged nested tensors are in test_dtensor.py and test_nested.py."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.utils._pytree as pytree
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass, return_and_correct_aliasing

import aotforge
from aotforge.aot.boxing import nop
from aotforge.torch_versions import torch_at_least

DOUBLE = torch.float64


def plain(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=DOUBLE)


def two(*shape, requires_grad=False) -> TwoTensor:
    return TwoTensor(plain(*shape), plain(*shape)).requires_grad_(requires_grad)


def assert_same(actual, expected, what: str = "value") -> None:
    """Same type, flatten context and (recursively) inner tensors: values, shapes, strides."""
    assert type(actual) is type(expected), f"{what}: {type(actual).__name__} != eager {type(expected).__name__}"
    if not isinstance(expected, torch.Tensor):
        assert actual == expected, f"{what}: {actual!r} != eager {expected!r}"
        return
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != eager {expected.shape}"
    assert actual.requires_grad == expected.requires_grad, f"{what}: requires_grad differs from eager"
    if is_traceable_wrapper_subclass(expected):
        names, context = expected.__tensor_flatten__()
        actual_names, actual_context = actual.__tensor_flatten__()
        assert (actual_names, actual_context) == (names, context), f"{what}: flatten {actual_names, actual_context} != eager {names, context}"
        for name in names:
            assert_same(getattr(actual, name), getattr(expected, name), f"{what}.{name}")
        return
    assert actual.stride() == expected.stride(), f"{what}: stride {actual.stride()} != eager {expected.stride()}"
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _leaves(args) -> list:
    return [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad]


def _backward(outputs) -> None:
    """Backpropagate ones into every differentiable output (each gradient of its output's type:
    summing a subclass output with a plain one would hand the plain output a subclass
    gradient, which PyTorch's AOTAutograd rejects as well)."""
    differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    torch.autograd.backward(differentiable, [torch.ones_like(o) for o in differentiable])


def check_against_eager(fn: Callable, make_inputs: Callable, compiled: Callable, *, backward=True, calls=2) -> list:
    """Run ``fn`` eagerly and ``compiled`` on equal fresh inputs (``calls`` times, so the
    cached path runs too); compare outputs, inputs afterwards, grad_fn presence and the
    gradients of every leaf after backpropagating the sum of every differentiable output."""
    torch.manual_seed(0)
    eager_args = make_inputs()
    expected = pytree.tree_leaves(fn(*eager_args))
    for call in range(calls):
        torch.manual_seed(0)
        args = make_inputs()
        actual = pytree.tree_leaves(compiled(*args))
        assert len(actual) == len(expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"call {call}, output {i}")
            if isinstance(e, torch.Tensor):
                assert (a.grad_fn is None) == (e.grad_fn is None), f"output {i}: grad_fn presence differs"
        for i, (a, e) in enumerate(zip(args, eager_args)):
            if isinstance(e, torch.Tensor):
                assert_same(a, e, f"call {call}, input {i} after the call")
        if backward and any(isinstance(e, torch.Tensor) and e.requires_grad for e in expected):
            if call == 0:
                _backward(expected)
            _backward(actual)
            for i, (a, e) in enumerate(zip(_leaves(args), _leaves(eager_args))):
                assert (a.grad is None) == (e.grad is None), f"gradient {i}: presence differs"
                if e.grad is not None:
                    assert_same(a.grad, e.grad, f"call {call}, gradient of leaf {i}")
    return actual


def aot(fn: Callable) -> Callable:
    return aotforge.aot_function(fn, nop)


# ----------------------------------------------------------------------------- TwoTensor


def test_two_tensor_input_forward_and_backward():
    def fn(x, y):
        return (x * y).sin() + x, y.cos()

    check_against_eager(fn, lambda: (two(3, 4, requires_grad=True), plain(3, 4).requires_grad_()), aot(fn))


def test_two_tensor_input_inference():
    def fn(x, y):
        return (x @ y).relu()

    with torch.no_grad():
        outputs = check_against_eager(fn, lambda: (two(3, 4), plain(4, 2)), aot(fn))
    assert isinstance(outputs[0], TwoTensor)


def test_two_tensor_output_is_rebuilt_on_every_call():
    """A subclass output is rebuilt from this call's graph outputs (not a traced constant)."""
    compiled = aot(lambda x: x * 2)
    for _ in range(3):
        x = two(4)
        out = compiled(x)
        assert isinstance(out, TwoTensor)
        torch.testing.assert_close(out.a, x.a * 2)
        torch.testing.assert_close(out.b, x.b * 2)


def test_two_tensor_data_mutation():
    def fn(x, y):
        x.mul_(y)
        return x + 1

    check_against_eager(fn, lambda: (two(3), plain(3)), aot(fn))
    with torch.no_grad():
        check_against_eager(fn, lambda: (two(3), plain(3)), aot(fn))


def test_two_tensor_mutation_of_non_leaf_input_reaches_the_gradient():
    def fn(x, y):
        x.mul_(y)
        return x.sum(0)

    def run(function):
        torch.manual_seed(0)
        leaf = two(2, 3, requires_grad=True)
        x, y = leaf * 1, plain(2, 3)  # a non-leaf TwoTensor, mutated in place
        out = function(x, y)
        out.sum().backward()
        return out, x, leaf.grad

    for actual, expected in zip(run(aot(fn)), run(fn)):
        assert_same(actual.detach(), expected.detach())


def test_two_tensor_mutation_under_no_grad_keeps_requires_grad():
    def fn(x, y):
        with torch.no_grad():
            y.add_(1)
        return x * y

    check_against_eager(fn, lambda: (two(3, requires_grad=True), two(3)), aot(fn))


def test_two_tensor_metadata_mutation_is_rejected_like_pytorch():
    def fn(x):
        x.t_()
        return x + 1

    with pytest.raises(RuntimeError, match="Metadata mutations of tensor subclasses are not supported"):
        aot(fn)(two(2, 3))
    # PyTorch's AOTAutograd rejects it too up to 2.13; from 2.14 it supports it (aotforge
    # does not yet: a clear error, never a wrong layout).
    from functorch.compile import aot_function as functorch_aot_function

    if not torch_at_least("2.14"):
        with pytest.raises(RuntimeError, match="Metadata mutations are currently not allowed on tensor subclasses"):
            functorch_aot_function(fn, nop)(two(2, 3))


def test_two_tensor_outputs_alias_inputs():
    def fn(x, y):
        return x.view(-1), x.t(), x, (y * 2).view(-1)

    def make():
        return two(2, 3, requires_grad=True), two(2, 3)

    compiled = aot(fn)
    outputs = check_against_eager(fn, make, compiled)
    torch.manual_seed(0)
    x, y = make()
    flat, transposed, same, _ = compiled(x, y)
    assert same is x
    assert flat._base is x and transposed._base is x
    assert type(flat.grad_fn).__name__ == "ViewBackward0"
    # Mutating the output mutates the input, as in eager.
    with torch.no_grad():
        flat.add_(1)
    torch.testing.assert_close(x.a.view(-1), flat.a)
    assert isinstance(outputs[3], TwoTensor)


def test_two_tensor_output_aliases_intermediate():
    def fn(x):
        y = x * 2
        return y.view(-1), y.t()

    outputs = check_against_eager(fn, lambda: (two(2, 3, requires_grad=True),), aot(fn))
    assert outputs[0]._base is outputs[1]._base


def test_nested_two_tensor():
    def make():
        inner = lambda: TwoTensor(plain(3, 2), plain(3, 2))  # noqa: E731
        return TwoTensor(inner(), inner()).requires_grad_(), plain(3, 2).requires_grad_()

    def fn(x, y):
        return (x * y).exp(), x.view(-1)

    outputs = check_against_eager(fn, make, aot(fn))
    assert isinstance(outputs[0].a, TwoTensor) and isinstance(outputs[0].b, TwoTensor)


def test_same_inner_tensor_twice():
    def fn(x, y):
        return x * y

    def make():
        a = plain(4)
        return TwoTensor(a, a), a

    check_against_eager(fn, make, aot(fn))


def test_aot_module_with_subclass_parameter():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(two(4))

        def forward(self, x):
            return (x * self.weight).sum()

    torch.manual_seed(0)
    model = Scale()
    reference = Scale()
    reference.load_state_dict(model.state_dict())
    compiled = aotforge.aot_module(model, nop)
    x = plain(4)
    out, expected = compiled(x), reference(x)
    assert_same(out.detach(), expected.detach(), "output")
    out.backward()
    expected.backward()
    assert_same(model.weight.grad, reference.weight.grad, "weight gradient")


def test_subclass_built_inside_the_function():
    def fn(x):
        return TwoTensor(x * 2, x + 1), x.sum()

    compiled = aot(fn)
    for _ in range(2):
        outputs = check_against_eager(fn, lambda: (plain(3),), compiled, calls=1)
        assert isinstance(outputs[0], TwoTensor)
        # No functional wrapper from the trace leaks into the result.
        assert type(outputs[0].a) is torch.Tensor and type(outputs[0].b) is torch.Tensor


def test_subclass_built_inside_from_subclass_input():
    def fn(x):
        return TwoTensor(x.a + x.b, x.a - x.b), x * 2

    with torch.no_grad():
        check_against_eager(fn, lambda: (two(3),), aot(fn))


# ----------------------------------------------------------------------------- constant metadata


class TaggedTensor(torch.Tensor):
    """A wrapper subclass whose flatten context carries a constant (a tag and a scale) that
    every op keeps; the values are the inner tensor's."""

    @staticmethod
    def __new__(cls, elem, tag: str, scale: float):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, device=elem.device, requires_grad=elem.requires_grad,
        )

    def __init__(self, elem, tag: str, scale: float):
        self.elem = elem
        self.tag = tag
        self.scale = scale

    def __repr__(self):
        return f"TaggedTensor({self.elem!r}, {self.tag!r}, {self.scale})"

    def __tensor_flatten__(self):
        return ["elem"], (self.tag, self.scale)

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return TaggedTensor(inner["elem"], *context)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        context = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, TaggedTensor))
        unwrap = lambda t: t.elem if isinstance(t, TaggedTensor) else t  # noqa: E731
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
        wrap = lambda t: TaggedTensor(t, context.tag, context.scale) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return return_and_correct_aliasing(func, args, kwargs, pytree.tree_map(wrap, out))


def test_subclass_with_constant_metadata():
    def fn(x, y):
        return (x * y).sin(), x.view(-1)

    def make(tag="a", scale=0.5):
        return TaggedTensor(plain(2, 3), tag, scale).requires_grad_(), plain(2, 3).requires_grad_()

    compiled = aot(fn)
    outputs = check_against_eager(fn, make, compiled)
    assert outputs[0].tag == "a" and outputs[0].scale == 0.5
    # Another constant is another trace (the context is part of the cache key).
    outputs = check_against_eager(fn, lambda: make("b", 2.0), compiled, calls=1)
    assert (outputs[0].tag, outputs[0].scale) == ("b", 2.0)
    assert len(compiled._aotforge_cache) == 2


# ----------------------------------------------------------------------------- tangents


def test_tangent_with_non_contiguous_inner_tensors_is_coerced():
    def fn(x):
        return x.sin()

    def run(function, gradient):
        torch.manual_seed(0)
        x = two(3, 4, requires_grad=True)
        function(x).backward(gradient)
        return x.grad

    base = torch.randn(4, 3, dtype=DOUBLE)
    gradient = TwoTensor(base.t(), base.t() * 2)  # non-contiguous inner tensors
    assert not gradient.a.is_contiguous()
    assert_same(run(aot(fn), gradient), run(fn, gradient), "gradient")


def test_plain_tangent_for_subclass_output_is_a_clear_error():
    compiled = aot(lambda x: x.sin())
    x = two(3, requires_grad=True)
    out = compiled(x)
    with pytest.raises(RuntimeError, match="gradient of output 0 is a Tensor.*compiled for a TwoTensor"):
        out.backward(torch.ones(3, dtype=DOUBLE))


def test_subclass_tangent_for_plain_output_is_a_clear_error():
    compiled = aot(lambda x, y: (x * y, y.sin()))
    x, y = two(3, requires_grad=True), plain(3).requires_grad_()
    _, out = compiled(x, y)
    with pytest.raises(RuntimeError, match="gradient of output 1 is a TwoTensor.*compiled for a Tensor"):
        out.backward(two(3))


# ----------------------------------------------------------------------------- rejected inputs


def test_sparse_input_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="layout torch.sparse_coo.*to_dense"):
        aot(lambda x: x * 2)(torch.eye(3).to_sparse())


def test_strided_nested_input_is_a_clear_error():
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.strided)
    with pytest.raises(NotImplementedError, match="layout=torch.jagged"):
        aot(lambda x: x * 2)(nested)


def test_two_tensor_through_torch_compile():
    def fn(x, y):
        return (x * y).cos(), x.view(-1)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aotforge_eager", fullgraph=True)
    outputs = check_against_eager(fn, lambda: (two(2, 3, requires_grad=True), plain(2, 3)), compiled)
    assert isinstance(outputs[0], TwoTensor)
