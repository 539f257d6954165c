"""Code whose shapes or control flow depend on tensor values cannot be traced ahead of time:
aot_function says so in its own words, with the user's line and what to do (issues 26, 27).
The same code through torch.compile(backend="aotforge") runs and equals eager."""
import pytest
import torch

from aotforge import aot_function, nop

D = torch.float64


def _masked_sum(x):
    return x[x > 0].sum()


def _nonzero(x):
    return x.nonzero()


def _branch_on_value(x):
    if x.sum() > 0:
        return x * 2
    return x - 1


def _size_from_value(x):
    return torch.zeros(int(x.abs().max().item()) + 1, dtype=x.dtype) + x.sum()


CASES = {
    _masked_sum: "output shape depends on tensor values",
    _nonzero: "output shape depends on tensor values",
    _branch_on_value: "reads a tensor's value in Python",
    _size_from_value: "reads a tensor's value in Python",
}


@pytest.mark.parametrize("fn", list(CASES), ids=lambda fn: fn.__name__)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_data_dependent_code_is_a_clear_error(fn, requires_grad):
    x = torch.randn(6, dtype=D, requires_grad=requires_grad)
    with pytest.raises(NotImplementedError) as error:
        aot_function(fn, nop)(x)
    message = str(error.value)
    assert CASES[fn] in message
    assert f"{fn.__name__} (at {__file__}:" in message  # the user's line
    assert 'torch.compile(..., backend="aotforge")' in message


@pytest.mark.parametrize("fn", list(CASES), ids=lambda fn: fn.__name__)
def test_torch_compile_runs_data_dependent_code_like_eager(fn):
    torch._dynamo.reset()
    x = torch.randn(6, dtype=D, requires_grad=True)
    expected = fn(x)
    out = torch.compile(fn, backend="aotforge")(x)
    torch.testing.assert_close(out, expected)
    if out.requires_grad:
        torch.testing.assert_close(torch.autograd.grad(out.sum(), x), torch.autograd.grad(expected.sum(), x))


def test_the_suggested_static_shape_rewrite_equals_eager():
    x = torch.randn(6, dtype=D, requires_grad=True)
    compiled = aot_function(lambda t: torch.where(t > 0, t, 0).sum(), nop)
    out, expected = compiled(x), _masked_sum(x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out, x), torch.autograd.grad(expected, x))
