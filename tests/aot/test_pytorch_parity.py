"""Behaviours PyTorch's own AOTAutograd suite checks (issue #26), each compared with eager:
functionalization switched off, set_() and storage resizes on inputs (FSDP's traced path),
torch.cond, export of a module without inputs, a backward that mutates its incoming
gradient, and what is refused with a clear error instead of a wrong answer or a crash."""
from __future__ import annotations

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from aotforge import aot_export_module, aot_function, nop
from aotforge.partition import default_partition, min_cut_rematerialization_partition


def _graphs():
    cell = {}

    def grab(name):
        def compiler(gm, example_inputs):
            cell[name] = gm
            return gm
        return compiler

    return cell, grab("forward"), grab("backward")


# ----------------------------------------------------------------- disable_functionalization


class _FwBwMutation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        torch._foreach_mul_([b], [2])  # an input mutation with no users
        x = b + 1
        torch._foreach_mul_([x], [3])  # an intermediate mutation with no users
        ctx.save_for_backward(x)
        return x * a

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        torch._foreach_mul_([x], [4])  # a mutation in the backward
        return grad_output * x, grad_output * x


def _no_functionalization_fn(a, b):
    return _FwBwMutation.apply(a, b).sin_().clone()


@pytest.mark.parametrize("partition", [default_partition, min_cut_rematerialization_partition])
def test_disable_functionalization_keeps_in_place_ops_without_users(partition):
    def inputs():
        return [torch.rand(3, 3, dtype=torch.float64, requires_grad=True), torch.rand(3, 3, dtype=torch.float64)]

    ref, test = inputs(), inputs()
    test = [t.detach().clone().requires_grad_(r.requires_grad) for t, r in zip(ref, test)]
    graphs, fw, bw = _graphs()
    compiled = aot_function(_no_functionalization_fn, fw, bw, partition_fn=partition, disable_functionalization=True)
    expected, actual = _no_functionalization_fn(*ref), compiled(*test)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(test[1], ref[1])  # the mutated input
    expected.sum().backward()
    actual.sum().backward()
    torch.testing.assert_close(test[0].grad, ref[0].grad)
    forward_ops = [str(n.target) for n in graphs["forward"].graph.nodes]
    assert forward_ops.count("aten._foreach_mul_.ScalarList") == 2
    assert "aten._foreach_mul_.ScalarList" in [str(n.target) for n in graphs["backward"].graph.nodes]


@pytest.mark.parametrize("requires_grad", [False, True])
def test_disable_functionalization_in_place_on_input_and_intermediate(requires_grad):
    def f(a):
        b = a * 2
        b.add_(1)  # no user but the return below reads b
        a.mul_(3)
        return b + a

    ref = torch.rand(4, dtype=torch.float64, requires_grad=requires_grad).clone()
    test = ref.detach().clone().requires_grad_(requires_grad).clone()
    expected = f(ref)
    actual = aot_function(f, nop, disable_functionalization=True)(test)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(test, ref)


# ----------------------------------------------------------------------- storage resizes


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("keep_mutations", [False, True])
def test_zero_byte_input_storage_grown_inside_the_function(requires_grad, keep_mutations):
    def f(a):
        torch.ops.inductor.resize_storage_bytes_(a, a.numel() * a.element_size())
        with torch.no_grad():
            a.copy_(torch.arange(8, dtype=a.dtype))
        return a * 2 + 1

    def empty_input():
        t = torch.zeros(8, dtype=torch.float64, requires_grad=requires_grad)
        t.untyped_storage().resize_(0)
        return t

    ref, test = empty_input(), empty_input()
    expected = f(ref)
    actual = aot_function(f, nop, keep_inference_input_mutations=keep_mutations)(test)  # used to segfault
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(test, ref)
    assert test.untyped_storage().nbytes() == ref.untyped_storage().nbytes() == 64
    if requires_grad:
        expected.sum().backward()
        actual.sum().backward()
        torch.testing.assert_close(test.grad, ref.grad)


def test_input_storage_freed_inside_the_function():
    def f(a):
        out = a.sin()
        torch.ops.inductor.resize_storage_bytes_(a, 0)
        return out

    ref, test = torch.rand(8, dtype=torch.float64), None
    test = ref.clone()
    expected = f(ref)
    actual = aot_function(f, nop)(test)
    torch.testing.assert_close(actual, expected)
    assert test.untyped_storage().nbytes() == ref.untyped_storage().nbytes() == 0


def test_reading_a_freed_input_storage_is_refused_before_it_runs():
    # eager reads freed memory here (a segfault); aotforge refuses at compile time
    freed = torch.zeros(8)
    freed.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="input 0 has a freed storage"):
        aot_function(lambda x: x + 1, nop)(freed)


def test_resize_between_two_nonzero_sizes_is_refused():
    def f(a):
        torch.ops.inductor.resize_storage_bytes_(a, 16)
        return a[:2] + 1

    with pytest.raises(NotImplementedError, match="only resizes from or to 0 bytes"):
        aot_function(f, nop)(torch.rand(8))


# ------------------------------------------------------------------------------- set_()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_set_input_to_a_new_tensor(requires_grad):
    def f(a):
        b = torch.arange(9, dtype=a.dtype).reshape(3, 3)
        with torch.no_grad():
            a.set_(b)
        return a * b

    base_ref = torch.ones(3, 3, dtype=torch.float64, requires_grad=requires_grad)
    base_test = base_ref.detach().clone().requires_grad_(requires_grad)
    ref, test = base_ref.add(1), base_test.add(1)
    expected = f(ref)
    actual = aot_function(f, nop)(test)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(test, ref)
    if requires_grad:
        expected.sum().backward()
        actual.sum().backward()
        torch.testing.assert_close(base_test.grad, base_ref.grad)


@pytest.mark.parametrize("keep_mutations", [False, True])
def test_set_input_to_another_input_keeps_them_aliased(keep_mutations):
    def f(a, b):
        with torch.no_grad():
            a.set_(b)
            b.mul_(2)
        return a + b

    ref = [torch.ones(3, 3, dtype=torch.float64), torch.rand(3, 3, dtype=torch.float64)]
    test = [t.clone() for t in ref]
    expected = f(*ref)
    actual = aot_function(f, nop, keep_inference_input_mutations=keep_mutations)(*test)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(test, ref)
    # as in eager, a now lives in b's storage: a later change of b shows in a
    assert test[0].untyped_storage().data_ptr() == test[1].untyped_storage().data_ptr()
    test[1].add_(1)
    ref[1].add_(1)
    torch.testing.assert_close(test[0], ref[0])


def test_set_input_to_a_slice_of_another_input():
    def f(a, b):
        with torch.no_grad():
            a.set_(b[1:].view(2, 3))
        return a * 2

    ref = [torch.ones(2, 3, dtype=torch.float64), torch.rand(3, 3, dtype=torch.float64)]
    test = [t.clone() for t in ref]
    torch.testing.assert_close(aot_function(f, nop)(*test), f(*ref))
    assert (test[0].shape, test[0].stride(), test[0].storage_offset()) == (ref[0].shape, ref[0].stride(), ref[0].storage_offset())
    assert test[0].untyped_storage().data_ptr() == test[1].untyped_storage().data_ptr()


def test_set_then_free_the_old_storage_as_fsdp_does():
    def f(a):
        with torch.no_grad():
            torch.ops.inductor.resize_storage_bytes_(a, 0)
            a.set_(torch.ones(2, dtype=a.dtype))
        return a + 1

    ref, test = torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    ref_old, test_old = ref.view(-1), test.view(-1)  # an alias of the old storage
    torch.testing.assert_close(aot_function(f, nop)(test), f(ref))
    torch.testing.assert_close(test, ref)
    assert test_old.untyped_storage().nbytes() == ref_old.untyped_storage().nbytes() == 0


def test_set_with_a_mutation_autograd_records_is_refused_like_pytorch():
    def f(a, b):
        with torch.no_grad():
            a.set_(b)
        a.mul_(2)
        return a + b

    inputs = [torch.ones(3, 3, requires_grad=True).add(1), torch.ones(3, 3, requires_grad=True).add(1)]
    with pytest.raises(AssertionError, match="but the input has other mutations that we cannot"):
        aot_function(f, nop)(*inputs)


def test_mutation_of_the_old_storage_before_set_is_refused():
    def f(a, b):
        with torch.no_grad():
            a.mul_(2)
            a.set_(b)
        return a + 1

    with pytest.raises(NotImplementedError, match="changed in place and then set_"):
        aot_function(f, nop)(torch.ones(3), torch.ones(3))


# ------------------------------------------------------------------ torch.cond, export


def test_torch_cond_in_aot_function():
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x.cos(), lambda x: x.sin(), [x])

    for sign in (1.0, -1.0):
        ref = (sign * torch.rand(3, dtype=torch.float64)).requires_grad_()
        test = ref.detach().clone().requires_grad_()
        expected, actual = f(ref), aot_function(f, nop)(test)
        torch.testing.assert_close(actual, expected)
        expected.sum().backward()
        actual.sum().backward()
        torch.testing.assert_close(test.grad, ref.grad)


def test_torch_cond_in_aot_export_module():
    class M(torch.nn.Module):
        def forward(self, x):
            def true_fn(x):
                y = x + 4
                y.add_(5)
                return x.cos()

            def false_fn(x):
                return x.sin()

            a = torch.cond(x.sum() > 4, true_fn, false_fn, [x])
            return (a + 3,)

    for x in (torch.full((3, 4), 1.0), torch.full((3, 4), -1.0)):
        gm, _ = aot_export_module(M(), (x,), trace_joint=False)
        torch.testing.assert_close(gm(x)[0], M()(x)[0])


def test_export_of_a_module_without_inputs():
    class NoInputs(torch.nn.Module):
        def forward(self):
            n = torch.full((), 5).item()
            return (torch.full((n,), 2),)

    class ParameterOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(3, dtype=torch.float64))

        def forward(self):
            return ((self.w * 2).sum(),)

    gm, _ = aot_export_module(NoInputs(), (), trace_joint=False, dynamic_shapes=True)
    torch.testing.assert_close(gm()[0], NoInputs()()[0])
    module = ParameterOnly()
    gm, signature = aot_export_module(module, (), trace_joint=True, output_loss_index=0)
    loss, grad = gm(module.w.detach())
    module().__getitem__(0).backward()
    torch.testing.assert_close(loss, module()[0].detach())
    torch.testing.assert_close(grad, module.w.grad)


def test_inductor_decomposition_table_is_accepted():
    inductor_decomposition = pytest.importorskip("torch._inductor.decomposition")

    def f(x):
        return (x + 1).view(-1)

    ref = torch.rand(3, 3, dtype=torch.float64, requires_grad=True)
    test = ref.detach().clone().requires_grad_()
    compiled = aot_function(f, nop, decompositions=inductor_decomposition.decompositions)
    expected, actual = f(ref), compiled(test)
    expected.mul_(2)
    actual.mul_(2)
    torch.testing.assert_close(actual, expected)


# ------------------------------------------------------------- custom backward mutations


class _MutatesItsGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad_output):
        grad_output.mul_(2)
        return grad_output.clone()


@pytest.mark.parametrize("explicit_gradient", [False, True])
def test_backward_that_mutates_its_incoming_gradient(explicit_gradient):
    def f(a, b):
        return _MutatesItsGradient.apply(a * b)

    def run(fn):
        a = torch.full((3,), 2.0, dtype=torch.float64, requires_grad=True)
        b = torch.full((3,), 3.0, dtype=torch.float64, requires_grad=True)
        out = fn(a, b)
        gradient = torch.ones(3, dtype=torch.float64)
        if explicit_gradient:
            out.backward(gradient)  # eager's backward changes the caller's gradient too
        else:
            out.mul(2).sum().backward()
        return a.grad, b.grad, gradient

    torch.testing.assert_close(run(aot_function(f, nop)), run(f))


class _MutatesASavedBuffer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buffer):
        ctx.buffer = buffer
        return x.clone()

    @staticmethod
    def backward(ctx, grad_output):
        with torch.no_grad():
            ctx.buffer.mul_(2)
        return grad_output * 2, None


def test_backward_that_mutates_a_subclass_input_matches_eager():
    # refused before issue 35; now supported (tests/aot/test_peer_parity.py has more cases)
    def f(a, buffer):
        return _MutatesASavedBuffer.apply(a, buffer) * 3

    def run(fn):
        a = torch.ones(3, dtype=torch.float64, requires_grad=True)
        buffer = TwoTensor(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        out = fn(a, buffer)
        after_forward = (buffer.a.clone(), buffer.b.clone())
        out.sum().backward()
        return after_forward, (buffer.a, buffer.b), a.grad

    torch.testing.assert_close(run(aot_function(f, nop)), run(f))


def test_backward_that_mutates_a_plain_input_matches_eager():
    def f(a, buffer):
        return _MutatesASavedBuffer.apply(a, buffer) * 3

    def run(fn):
        a = torch.ones(3, dtype=torch.float64, requires_grad=True)
        buffer = torch.ones(3, dtype=torch.float64)
        out = fn(a, buffer)
        after_forward = buffer.clone()
        out.sum().backward()
        return after_forward, buffer, a.grad

    torch.testing.assert_close(run(aot_function(f, nop)), run(f))


# ------------------------------------------------------------ inputs sharing one storage


def _mutate_both(a, b):
    a.mul_(3)
    b.mul_(2)
    return a.clone().view(-1) + b.clone().view(-1)


@pytest.mark.parametrize("subclass", [False, True])
@pytest.mark.parametrize(
    "views, overlapping",
    [
        (lambda x: (x[0:2], x[2:4]), False),  # disjoint rows
        (lambda x: (x[:, 0:2], x[:, 2:4]), False),  # interleaved columns
        (lambda x: (x.view(-1).as_strided((2, 2), (5, 1), 0), x.view(-1).as_strided((2, 2), (5, 1), 2)), False),
        (lambda x: (x[0:2], x[1:3]), True),  # a real alias
    ],
)
def test_inputs_sharing_a_storage_one_mutated(subclass, views, overlapping):
    def inputs():
        x = torch.arange(16, dtype=torch.float64).reshape(4, 4)
        if subclass:
            x = TwoTensor(x, x.clone() * 10)
        return x, views(x)

    ref_base, ref = inputs()
    test_base, test = inputs()
    graphs, fw, _ = _graphs()
    if subclass and overlapping:  # true aliasing of subclass inputs stays refused, clearly
        with pytest.raises(NotImplementedError, match="share storage"):
            aot_function(_mutate_both, fw)(*test)
        return
    actual = aot_function(_mutate_both, fw)(*test)
    torch.testing.assert_close(actual, _mutate_both(*ref))
    torch.testing.assert_close(test_base, ref_base)
    if not overlapping and not subclass:  # no synthetic base: the views stayed two inputs
        assert len(graphs["forward"].graph.find_nodes(op="placeholder")) == 2


# ------------------------------------------------------- source lines under torch.compile


def test_aot_module_simplified_under_torch_compile_keeps_user_stack_traces():
    from aotforge import aot_module_simplified

    seen = {}

    def grab(kind):
        def compiler(gm, example_inputs):
            seen[kind] = [n.meta.get("stack_trace") for n in gm.graph.nodes if n.op == "call_function"]
            return gm
        return compiler

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=grab("forward"), bw_compiler=grab("backward"))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4, dtype=torch.float64)

        def forward(self, x):
            return (self.linear(x).relu() * 2).sum()  # the line every node should name

    torch._dynamo.reset()
    model = Model()
    x = torch.rand(3, 4, dtype=torch.float64)
    expected = model(x)
    actual = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(actual, expected)
    actual.backward()
    torch._dynamo.reset()
    for kind in ("forward", "backward"):
        assert seen[kind] and all(trace and "the line every node should name" in trace for trace in seen[kind]), kind


def test_export_refuses_storage_changes_of_inputs():
    from aotforge.aot import ExportError, aot_export_joint_simple

    def swaps(x, y):
        with torch.no_grad():
            x.set_(y * 2)
        return (x + 1,)

    with pytest.raises(ExportError, match="set_"):
        aot_export_joint_simple(swaps, [torch.ones(3), torch.ones(3)], trace_joint=False)

    class Frees(torch.nn.Module):
        def forward(self, x):
            out = x.sin()
            torch.ops.inductor.resize_storage_bytes_(x, 0)
            return (out,)

    with pytest.raises(ExportError, match="resizes the storage"):
        aot_export_module(Frees(), [torch.ones(3)], trace_joint=False)
