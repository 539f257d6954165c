"""Behaviours PyTorch's own AOTAutograd suite (../shared/peer, issue 35) checks, each compared
with eager here: the graph's output layout (aliased outputs are graph outputs too), outputs
of multi-output views, a custom Function mutating a subclass input in forward and backward,
random ops with nested outputs through the C++ path, the source line of a kept mutation, and
the refusals that carry PyTorch's sentence for the same case."""
import pytest
import torch
from torch._C._autograd import CreationMeta, _get_creation_meta
from torch.testing._internal.two_tensor import TwoTensor

import aotforge
from aotforge import aot_function, aot_module_simplified, nop
from aotforge.aot.export import ExportError, aot_export_joint_simple, aot_export_module


def leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


# --- aliased outputs are graph outputs (PyTorch's layout); the runtime regenerates them ----

def _graph_outputs_seen(fn, *args):
    """Call aot_function(fn) with a forward compiler that records its graph's outputs."""
    seen = []

    def fw(gm, example_inputs):
        def run(*a):
            outs = gm(*a)
            seen.append(list(outs))
            return outs
        return run
    out = aot_function(fn, fw_compiler=fw, bw_compiler=nop)(*args)
    return out, seen[0]


@pytest.mark.parametrize("case", ["input", "intermediate", "output"])
def test_aliased_outputs_are_graph_outputs_at_their_user_positions(case):
    fns = {
        "input": lambda a: a.view(-1),
        "intermediate": lambda a: (lambda b: (b.view(-1), b.view(-1)))(a.clone()),
        "output": lambda a: (lambda b: (b, b.view(-1)))(a.add(10)),
    }
    fn = fns[case]
    x, x_ref = leaf(2, 2), None
    x_ref = x.detach().clone().requires_grad_(True)
    out, graph_outputs = _graph_outputs_seen(fn, x)
    ref = fn(x_ref)
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    for position, (o, r) in enumerate(zip(outs, refs)):
        # the graph's value at the user's position has the user output's shape ...
        assert graph_outputs[position].shape == r.shape
        # ... and the user gets eager's value; an aliased output eager's autograd view node
        torch.testing.assert_close(o, r)
        if r._is_view():
            assert o._is_view() and type(o.grad_fn).__name__ == type(r.grad_fn).__name__
    if case == "input":
        assert out._base is x  # a real view of the caller's tensor
    if case == "output":
        assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
    sum(o.sum() for o in outs).backward()
    sum(r.sum() for r in refs).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


# --- outputs of one multi-output view op: returned by the compiled Function, as eager's views --

def _unbind_input(a):
    return list(a.unbind(0))


def _unbind_intermediate(a):
    return list(torch.mul(a, 3).unbind(0))


def _split_intermediate(a):
    return torch.mul(a, 2).split(2)


def _unbind_and_base(a):
    out = torch.mul(a, 3)
    return *out.unbind(0), out


def _unbind_and_view_of_base(a):
    out = torch.mul(a, 3)
    return *out.unbind(0), out.view(out.shape)


def _compiled(fn, how):
    torch._dynamo.reset()
    return aot_function(fn, nop) if how == "nop" else torch.compile(fn, backend="aotforge")


_MULTI_OUTPUT_FNS = [_unbind_input, _unbind_intermediate, _split_intermediate, _unbind_and_base,
                     _unbind_and_view_of_base]


@pytest.mark.parametrize("how", ["nop", "aotforge"])
@pytest.mark.parametrize("fn", _MULTI_OUTPUT_FNS)
def test_multi_output_views_match_eager(fn, how):
    # As PyTorch's AOTAutograd: the compiled Function returns them (one backward node for all),
    # and they stay views, so autograd refuses in-place changes to them as eager does.
    x = leaf(4, 4)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = _compiled(fn, how)(x.clone()), fn(x_ref.clone())
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
        assert "CompiledFunctionBackward" in str(o.grad_fn)
    for o, r in zip(out, ref):
        if r._is_view() and _get_creation_meta(r) == CreationMeta.MULTI_OUTPUT_NODE:
            for t in (o, r):
                with pytest.raises(RuntimeError, match="output of a function that returns multiple views"):
                    t.mul_(1)
    sum(float(i + 1) * o.sum() for i, o in enumerate(out)).backward()
    sum(float(i + 1) * r.sum() for i, r in enumerate(ref)).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("how", ["nop", "aotforge"])
@pytest.mark.parametrize("fn", [_unbind_input, _unbind_and_base, _unbind_and_view_of_base])
def test_multi_output_views_see_a_later_change_of_what_they_alias(fn, how):
    # eager: changing the input, or the one output that may be changed in place, shows in the
    # multi-output views (reading them under no_grad), and their grad_fn then refuses
    x = leaf(3, 3)
    a, a_ref = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    a, a_ref = a.clone(), a_ref.clone()
    out, ref = _compiled(fn, how)(a), fn(a_ref)
    if fn is _unbind_input:
        with torch.no_grad():
            a.mul_(5)
            a_ref.mul_(5)
    else:
        out[-1].mul_(5)
        ref[-1].mul_(5)
    with torch.no_grad():
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r)
    with pytest.raises(RuntimeError, match="Such functions do not allow the output views"):
        out[0].grad_fn
    with pytest.raises(RuntimeError, match="Such functions do not allow the output views"):
        ref[0].grad_fn


def _mul_then_unbind(a):
    a.mul_(2)
    return a.unbind(0)


def _transpose_then_unbind(a):
    a.t_()
    return a.unbind(0)


@pytest.mark.parametrize("fn", [_mul_then_unbind, _transpose_then_unbind])
def test_multi_output_views_of_an_input_the_call_changes_match_eager(fn):
    # regenerated after the input's write-back (a view returned by the compiled Function
    # would be invalidated by it, or taken before a t_())
    x = leaf(3, 3)
    x_ref = x.detach().clone().requires_grad_(True)
    a, a_ref = x.clone(), x_ref.clone()
    out, ref = aot_function(fn, nop)(a), fn(a_ref)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
        assert o._base is a
    torch.testing.assert_close(a, a_ref)
    sum(float(i + 1) * o.sum() for i, o in enumerate(out)).backward()
    sum(float(i + 1) * r.sum() for i, r in enumerate(ref)).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_multi_output_views_with_another_alias_of_an_input_stay_views():
    def fn(a):
        return *a.unbind(0), a.view(a.shape)

    x = leaf(3, 3)
    out = aot_function(fn, nop)(x.clone())
    for o in out[:3]:  # regenerated as eager's views: autograd refuses in-place changes
        with pytest.raises(RuntimeError, match="output of a function that returns multiple views"):
            o.mul_(2)


# --- a custom Function that mutates a subclass input in forward and in backward --------------

class _MutatesInForwardAndBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dummy, inplace_tensor):
        inplace_tensor.add_(1)
        ctx.inplace_tensor = inplace_tensor
        return dummy.clone()

    @staticmethod
    def backward(ctx, grad_output):
        ctx.inplace_tensor.add_(1)
        return grad_output * 2, None


def _mutating_fn(dummy, inplace_tensor):
    return _MutatesInForwardAndBackward.apply(dummy, inplace_tensor)


def _two_tensor_inputs():
    torch.manual_seed(0)
    return (TwoTensor(torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)),
            TwoTensor(torch.zeros(2), torch.zeros(2)))


@pytest.mark.parametrize("how", ["aot_function", "torch.compile"])
def test_subclass_input_mutated_in_forward_and_backward_matches_eager(how):
    dummy, buf = _two_tensor_inputs()
    y = _mutating_fn(dummy, buf)
    ref_after_forward = buf.clone().detach()
    y.sum().backward()
    ref_after_backward, ref_grad = buf.clone().detach(), dummy.grad

    torch._dynamo.reset()
    compiled = (aot_function(_mutating_fn, nop) if how == "aot_function"
                else torch.compile(_mutating_fn, backend="aotforge_eager", fullgraph=True))
    dummy, buf = _two_tensor_inputs()
    y = compiled(dummy, buf)
    torch.testing.assert_close(buf.clone().detach(), ref_after_forward)
    y.sum().backward()
    torch.testing.assert_close(buf.clone().detach(), ref_after_backward)
    torch.testing.assert_close(dummy.grad, ref_grad)


# --- random ops whose graph node has nested outputs (run_and_save_rng_state) -----------------

def _rrelu_functional(x):
    noise = torch.ones_like(x)
    return torch.ops.aten.rrelu_with_noise_functional(x, noise, 0.2, 0.8, True)


def _rrelu_mutation(x):
    noise = torch.ones_like(x)
    return torch.ops.aten.rrelu_with_noise(x, noise, 0.2, 0.8, True), noise


@pytest.mark.parametrize("fn", [_rrelu_functional, _rrelu_mutation])
def test_rrelu_with_noise_through_the_compiler_matches_eager(fn):
    base = -torch.rand(4, 4, dtype=torch.float64) - 0.1
    torch._dynamo.reset()
    results = []
    for run in (fn, torch.compile(fn, backend="aotforge", fullgraph=True)):
        x = base.clone().requires_grad_(True)
        torch.manual_seed(7)
        y, noise = run(x)
        y.sum().backward()
        results.append((y.detach(), noise.detach(), x.grad))
    for actual, expected in zip(results[1], results[0]):
        torch.testing.assert_close(actual, expected)
    assert bool((results[1][1] < 1).all())  # the noise was drawn, not left at ones


# --- a kept mutation's copy_ carries the line of the op that made it -------------------------

def test_kept_mutation_copy_has_the_mutating_line():
    def fn(x):
        x_view = x[0]
        x_view.mul_(2)
        return (x + x,)

    traces = []

    def compiler(gm, _):
        traces.extend(n.meta.get("stack_trace") or "" for n in gm.graph.nodes
                      if n.target is torch.ops.aten.copy_.default)
        return gm

    x, x_ref = torch.randn(3, 4), None
    x_ref = x.clone()
    out = aot_function(fn, compiler, keep_inference_input_mutations=True)(x)
    ref = fn(x_ref)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(x, x_ref)
    assert traces and all("x_view.mul_(2)" in t for t in traces)


# --- refusals: PyTorch's sentence first, then ours ------------------------------------------

def test_fake_tensor_constant_is_an_assertion_and_a_value_error():
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    fake_x = fake_mode.from_tensor(torch.randn(4))
    fake_z = fake_mode.from_tensor(torch.randn(4))

    class ClosesOverFake(torch.nn.Module):
        def forward(self, x):
            return (x + fake_z,)

    for expected in (AssertionError, ValueError):
        with pytest.raises(expected, match="Unexpected fake buffer.*FakeTensor constant"):
            aot_module_simplified(ClosesOverFake(), (fake_x,), nop)


class _Holder(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(2))
        self.fn = fn

    def forward(self, *args):
        return self.fn(self.p, *args)


def _mutates_x(p, x, y):
    x.mul_(2)
    return (x + y,)


@pytest.mark.parametrize("what, call, sentence", [
    ("duplicated inputs", lambda m, i: aot_export_joint_simple(_mutates_x, [m.p, i, i], trace_joint=False),
     "Encountered duplicated inputs that are mutated in the graph"),
    ("aliased inputs", lambda m, i: aot_export_joint_simple(_mutates_x, [m.p, i, i.view(-1)], trace_joint=False),
     "Encountered aliased inputs that are mutated"),
    ("duplicated module inputs", lambda m, i: aot_export_module(_Holder(_mutates_x), [i, i], trace_joint=False),
     "Encountered duplicated inputs that are mutated in the graph"),
    ("metadata mutation", lambda m, i: aot_export_joint_simple(
        lambda p, x: (x.t_() * 2,), [m.p, torch.randn(2, 4)], trace_joint=False),
     "Found an input that received a metadata mutation"),
    ("mutated parameter", lambda m, i: aot_export_joint_simple(
        lambda p, x: (p.mul_(2) + x,), [m.p, i], trace_joint=False),
     "aot_export_joint_simple does not support input mutations. ViewAndMutationMeta"),
    ("mutated parameter, joint", lambda m, i: aot_export_joint_simple(
        lambda p, x: (p.mul_(2) + x,), [m.p, i], trace_joint=True),
     "Found a graph input that requires gradients, and received a mutation"),
    ("pytree input", lambda m, i: aot_export_joint_simple(lambda xs: (xs[0] + xs[1],), [[i, i]], trace_joint=False),
     "aot_export_joint_simple requires individual inputs not to be pytrees"),
    ("second output requires grad", lambda m, i: aot_export_module(
        _Holder(lambda p, x: ((p * x), (p * x).sum())), [i], trace_joint=True, output_loss_index=1),
     "Found an output of the forward that requires gradients, that was not"),
])
def test_export_refusals_start_with_pytorchs_sentence(what, call, sentence):
    module, inp = _Holder(_mutates_x), torch.randn(2)
    with pytest.raises(ExportError, match=sentence) as caught:
        call(module, inp)
    assert "aot_export" in str(caught.value).split(sentence, 1)[1]  # ours follows


def test_merged_aliased_inputs_with_different_bases_match_eager():
    """PyTorch's AOTAutograd refuses these (test_merge_view_inputs_error_*); aotforge merges
    inputs by storage, not by ._base, and gives eager's result (README: known limits)."""
    def fn(a, b):
        a.mul_(2)
        return a + b

    def different_bases():
        x, y = torch.randn(10), torch.randn(10)
        y.set_(x.untyped_storage(), 0, (10,), (1,))
        return x, [x[0:5], y[0:5]]

    def mixed_base_states():
        x, v2 = torch.randn(10), torch.empty(5)
        v2.set_(x.untyped_storage(), 0, (5,), (1,))
        return x, [x[0:5], v2]

    for make in (different_bases, mixed_base_states):
        torch.manual_seed(0)
        x_ref, args = make()
        expected = fn(*args)
        for compiled in (aot_function(fn, nop), torch.compile(fn, backend="aotforge_eager")):
            torch._dynamo.reset()
            torch.manual_seed(0)
            x, args = make()
            torch.testing.assert_close(compiled(*args), expected)
            torch.testing.assert_close(x, x_ref)


# --- dropout that does nothing returns its input, as eager's C++ kernel does -----------------

class _EvalDropoutThenInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        y = self.lin(x)
        h = self.drop(y)  # eval mode: h is y itself in eager
        h += 1
        return h + y


@pytest.mark.parametrize("backend", ["aotforge_eager", "aotforge"])
@pytest.mark.parametrize("grad", [False, True])
def test_eval_dropout_result_changed_in_place_changes_its_input_as_in_eager(backend, grad):
    # torch/_decomp's Python kernel for aten.dropout (which tracing runs) returns a clone there
    torch.manual_seed(0)
    model = _EvalDropoutThenInPlace().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        expected = model(x)
        actual = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(actual, expected)


def test_dropout_that_does_nothing_aliases_a_mutated_input_as_in_eager():
    def fn(x, p):
        y = torch.ops.aten.dropout.default(x, p, train=False)
        y.add_(1)
        return (y * 2,)

    for p in (0.1, 0.0):
        x, x_ref = torch.zeros(2, 3), torch.zeros(2, 3)
        out, ref = aot_function(lambda x: fn(x, p), nop)(x), fn(x_ref, p)
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(x, x_ref)  # the input changed, as in eager
    kernels = dict(torch.ops.aten.dropout.default.py_kernels)
    aot_function(lambda x: fn(x, 0.5), nop)(torch.zeros(2))
    assert dict(torch.ops.aten.dropout.default.py_kernels) == kernels  # torch's kernels are back
