"""The eager contract beyond plain mutation and aliasing (issue 11): each case runs eagerly
and through aotforge (aot_function, aot_module, torch.compile(backend="aotforge_eager")) and
compares values, gradients, requires_grad, grad_fn kinds of views, inputs after the call and
aliasing."""
import pytest
import torch

from aotforge import aot_function, aot_module, nop
from aotforge.testing import Inputs, verify

D = torch.float64
C = torch.complex128


def leaf(*shape, dtype=D):
    return torch.randn(tuple(shape), dtype=dtype, requires_grad=True)


def plain(*shape, dtype=D):
    return torch.randn(tuple(shape), dtype=dtype)


def nonleaf(*shape, dtype=D):
    base = leaf(*shape, dtype=dtype)
    return Inputs((base * 1.0,), leaves=[base])


def _dynamo_compile(fn, mode):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aotforge_eager", fullgraph=True, dynamic=False)


def _aot_module_compile(fn, mode):
    """fn wrapped as the forward of a parameterless module, through aot_module."""

    class Wrapper(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    return aot_module(Wrapper(), nop, nop, keep_inference_input_mutations=(mode == "inference_keep_mutations"))


COMPILERS = {"aot_function": None, "aot_module": _aot_module_compile, "torch_compile": _dynamo_compile}


def _verify(fn, make, how, **kwargs):
    if COMPILERS[how] is not None:
        kwargs["compile"] = COMPILERS[how]
    verify(fn, make, **kwargs)


# --- views that change what the bytes mean ---------------------------------------------------
VIEW_CASES = {
    "conj_of_input": (lambda z: z.conj(), lambda: nonleaf(3, 2, dtype=C)),
    "conj_view_of_input": (lambda z: z.view(-1).conj(), lambda: nonleaf(3, 2, dtype=C)),
    "conj_of_intermediate": (lambda z: (z * 2).conj(), lambda: nonleaf(3, dtype=C)),
    "neg_view_of_input": (lambda x: x._neg_view(), lambda: nonleaf(3, 2)),
    "view_as_complex_input": (lambda x: torch.view_as_complex(x), lambda: nonleaf(3, 2)),
    "view_as_complex_intermediate": (lambda x: torch.view_as_complex(x.sin()), lambda: nonleaf(3, 2)),
    "view_as_real_input": (lambda z: torch.view_as_real(z), lambda: nonleaf(4, dtype=C)),
    "view_as_real_of_conj": (lambda z: torch.view_as_real(z.conj().resolve_conj()), lambda: nonleaf(4, dtype=C)),
    "real_and_imag": (lambda z: (z.real, z.imag), lambda: nonleaf(4, dtype=C)),
    "real_of_intermediate": (lambda z: (z * 3).real, lambda: nonleaf(4, dtype=C)),
    "view_int32_input": (lambda x: x.view(torch.int32), lambda: (plain(3, 2),)),
    "view_int32_intermediate": (lambda x: (x * 2).view(torch.int32), lambda: (plain(3, 2),)),
    "view_dtype_of_grad_input": (lambda x: (x.view(torch.int64), x * 2), lambda: nonleaf(4)),
    "ifft": (lambda z: torch.fft.ifft(z), lambda: nonleaf(8, dtype=C)),
    "ihfft": (lambda x: torch.fft.ihfft(x), lambda: nonleaf(8)),
    "ihfft2": (lambda x: torch.fft.ihfft2(x), lambda: nonleaf(4, 6)),
    "transpose_view_grad_fn": (lambda x: (x.t(), x.diagonal(), x[:, :1].expand(3, 4)), lambda: nonleaf(3, 3)),
    "unsqueeze_of_intermediate": (lambda x: (x.exp().unsqueeze(0), x.exp().permute(1, 0)), lambda: nonleaf(2, 3)),
}


@pytest.mark.parametrize("how", sorted(COMPILERS))
@pytest.mark.parametrize("name", sorted(VIEW_CASES))
def test_views_that_change_meaning(name, how):
    fn, make = VIEW_CASES[name]
    _verify(fn, make, how)


def test_conj_output_is_conjugated_and_keeps_view_autograd():
    z = leaf(3, dtype=C)
    out = aot_function(lambda t: t.view(3).conj(), nop)(z)
    expected = z.view(3).conj()
    assert out.is_conj() and torch.equal(out.resolve_conj(), expected.resolve_conj())
    assert type(out.grad_fn).__name__ == type(expected.grad_fn).__name__ == "ConjBackward0"
    assert out._base is z  # a real view of the caller's tensor


# --- custom autograd.Function returning its input ----------------------------------------------
class HalfGradIdentity(torch.autograd.Function):
    """Returns its input unchanged; its backward halves the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class HalfGradFlatView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.view(-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.view(ctx.shape) * 0.5


CUSTOM_CASES = {
    "returns_input": (lambda x: HalfGradIdentity.apply(x), lambda: nonleaf(2, 3)),
    "returns_leaf_input": (lambda x: HalfGradIdentity.apply(x) * 3, lambda: (leaf(2, 3),)),
    "returns_view_of_input": (lambda x: HalfGradFlatView.apply(x), lambda: nonleaf(2, 3)),
    "returns_intermediate": (lambda x: HalfGradIdentity.apply(x.sin()), lambda: nonleaf(2, 3)),
    "input_and_its_custom_alias": (lambda x: (HalfGradIdentity.apply(x), x.t()), lambda: nonleaf(2, 3)),
}


@pytest.mark.parametrize("how", sorted(COMPILERS))
@pytest.mark.parametrize("name", sorted(CUSTOM_CASES))
def test_custom_function_returning_its_input_keeps_its_backward(name, how):
    fn, make = CUSTOM_CASES[name]
    # Under no_grad Dynamo inlines the Function's forward, so the graph aotforge receives
    # returns the input object itself; that is Dynamo's rewrite, checked in training only.
    modes = ("train",) if how == "torch_compile" and name in ("returns_input", "input_and_its_custom_alias") else None
    _verify(fn, make, how, **({"modes": modes} if modes else {}))


def test_custom_function_returning_its_input_gradient_value():
    x = leaf(3)
    out = aot_function(lambda t: HalfGradIdentity.apply(t), nop)(x)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 0.5, dtype=D))
    assert out._base is x  # still an alias of the input, as in eager


# --- outputs made under no_grad, requires_grad_() on outputs -----------------------------------
def _all_outputs_under_no_grad(x):
    with torch.no_grad():
        y = x * 2
    return y


def _view_under_no_grad(x):
    with torch.no_grad():
        y = x.view(-1)
    return y, x * 2


def _select_under_no_grad(x):
    with torch.no_grad():
        y = x[0]
    return y


def _intermediate_and_view_under_no_grad(x):
    with torch.no_grad():
        y = x * 2
    return y.view(-1), y


def _requires_grad_on_view_of_plain(p):
    y = p.view(-1)
    y.requires_grad_(True)
    return y


def _requires_grad_on_view_used(x, p):
    y = p[0]
    y.requires_grad_(True)
    return y * x, y


NO_GRAD_CASES = {
    "all_outputs_under_no_grad": (_all_outputs_under_no_grad, lambda: (leaf(3),)),
    "view_under_no_grad": (_view_under_no_grad, lambda: (leaf(3),)),
    "select_under_no_grad": (_select_under_no_grad, lambda: (leaf(2, 3),)),
    "intermediate_and_view_under_no_grad": (_intermediate_and_view_under_no_grad, lambda: nonleaf(3)),
    "requires_grad_on_view_of_plain": (_requires_grad_on_view_of_plain, lambda: (plain(3),)),
    "requires_grad_on_view_used": (_requires_grad_on_view_used, lambda: (leaf(3), plain(2, 3))),
}


@pytest.mark.parametrize("how", sorted(COMPILERS))
@pytest.mark.parametrize("name", sorted(NO_GRAD_CASES))
def test_outputs_made_under_no_grad_and_requires_grad_(name, how):
    fn, make = NO_GRAD_CASES[name]
    if how == "torch_compile" and name.startswith("requires_grad_on"):
        # Dynamo itself refuses to return a tensor that had requires_grad_() called on it.
        with pytest.raises(torch._dynamo.exc.Unsupported, match="requires_grad_"):
            _dynamo_compile(fn, "train")(*make())
        return
    _verify(fn, make, how)
