"""A __torch_dispatch__ tensor subclass that cannot flatten itself is a clear error when passed
to a compiled function (issue 26: it failed with "invalid python storage"); subclasses that
flatten themselves still compile and equal eager."""
import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._pytree import tree_map

from aotforge import aot_function, aot_module, nop

D = torch.float64


class Wrapper(torch.Tensor):
    """A wrapper subclass with no __tensor_flatten__: its data lives in ``elem``."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device,
                                                   requires_grad=elem.requires_grad)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.elem if isinstance(t, Wrapper) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)


def _fn(t):
    return t.sin() * 2


@pytest.mark.parametrize("requires_grad", [False, True])
def test_unflattenable_dispatch_subclass_is_a_clear_error(requires_grad):
    x = Wrapper(torch.randn(3, dtype=D, requires_grad=requires_grad))
    assert torch.equal(_fn(x).elem, _fn(x.elem))  # eager works
    with pytest.raises(NotImplementedError, match="Wrapper, a tensor subclass with its own __torch_dispatch__ "
                                                  "but without __tensor_flatten__"):
        aot_function(_fn, nop)(x)


def test_unflattenable_dispatch_subclass_as_a_module_buffer_is_a_clear_error():
    model = torch.nn.Linear(3, 3).double()
    model.register_buffer("scale", Wrapper(torch.ones(3, dtype=D)))
    with pytest.raises(NotImplementedError, match="__tensor_flatten__"):
        aot_module(model, nop)(torch.randn(2, 3, dtype=D))


def test_flattenable_subclass_still_equals_eager():
    a, b = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    x = TwoTensor(a.clone(), b.clone())
    out = aot_function(_fn, nop)(x)
    expected = _fn(TwoTensor(a, b))
    assert type(out) is TwoTensor
    torch.testing.assert_close(out.a, expected.a)
    torch.testing.assert_close(out.b, expected.b)


def test_plain_parameters_are_not_mistaken_for_subclasses():
    model = torch.nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=D)
    torch.testing.assert_close(aot_module(model, nop, nop)(x), model(x))
