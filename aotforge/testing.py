"""``verify``: run a function eagerly and through aotforge and check that a user could not
tell the difference. Eager PyTorch is the oracle; every test of aotforge goes through here.

What is compared, for each mode (training, inference with and without kept mutations):
outputs (values, dtype, shape, stride, requires_grad, is_leaf, grad_fn presence), the inputs
after the call (values, shape, stride, offset), which outputs share storage with which inputs
and outputs, gradients of every leaf, and what mutating each output afterwards does.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from .aot import aot_function
from .aot.boxing import nop

MODES = ("train", "inference", "inference_keep_mutations")


@dataclasses.dataclass
class Inputs:
    """Arguments for one call, plus leaves (not among the args) whose gradients to compare,
    e.g. the leaf a non-leaf input was computed from."""

    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    leaves: Sequence[torch.Tensor] = ()


def default_compile(fn: Callable, mode: str) -> Callable:
    return aot_function(
        fn, nop, nop, keep_inference_input_mutations=(mode == "inference_keep_mutations")
    )


def _fresh_inputs(make_inputs: Callable) -> Inputs:
    torch.manual_seed(0)
    made = make_inputs()
    if isinstance(made, Inputs):
        return made
    if isinstance(made, tuple):
        return Inputs(made)
    return Inputs((made,))


def _leaves(inputs: Inputs) -> list[torch.Tensor]:
    found = [t for t in pytree.tree_leaves((inputs.args, inputs.kwargs)) if isinstance(t, torch.Tensor)]
    result = [t for t in found if t.is_leaf and t.requires_grad]
    result += [t for t in inputs.leaves if all(t is not r for r in result)]
    return result


def _input_tensors(inputs: Inputs) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves((inputs.args, inputs.kwargs)) if isinstance(t, torch.Tensor)]


@dataclasses.dataclass
class Observation:
    outputs: Any = None
    error: Optional[BaseException] = None
    grads: list = dataclasses.field(default_factory=list)
    inputs_after: list = dataclasses.field(default_factory=list)
    aliasing: list = dataclasses.field(default_factory=list)
    after_output_mutation: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TensorSummary:
    """An output as the user saw it right after the call."""

    value: torch.Tensor
    stride: tuple
    requires_grad: bool
    is_leaf: Any  # bool, or the error reading it raised
    has_grad_fn: Any
    is_conj: bool = False
    is_neg: bool = False
    # For outputs that are views: the kind of their grad_fn (ViewBackward0, SplitBackward0...),
    # which decides what autograd allows on them later (in-place ops on multi-output views).
    view_grad_fn: Any = None


def _output_summary(value):
    if not isinstance(value, torch.Tensor):
        return value
    return TensorSummary(
        value.detach().clone(),
        value.stride(),
        value.requires_grad,
        _read(lambda: value.is_leaf),
        _read(lambda: value.grad_fn is not None),
        value.is_conj(),
        value.is_neg(),
        _read(lambda: _view_grad_fn_kind(value)),
    )


def _view_grad_fn_kind(value: torch.Tensor):
    """The grad_fn class name of a view made by a view op (a custom autograd.Function's
    node is the user's, and a compiled function has its own: not compared)."""
    grad_fn = value.grad_fn
    if not value._is_view() or grad_fn is None:
        return None
    if isinstance(grad_fn, torch.autograd.function.BackwardCFunction):
        # the compiled Function returns outputs of multi-output views itself (PyTorch's rule)
        return _COMPILED_FUNCTION_NODE if type(grad_fn).__name__ == _COMPILED_FUNCTION_NODE else None
    return type(grad_fn).__name__


_COMPILED_FUNCTION_NODE = "CompiledFunctionBackward"


def _read(attribute: Callable[[], Any]) -> Any:
    """An autograd attribute, or the error reading it raised (eager forbids reading them for
    views whose base was changed in place; the compiled outputs must behave the same)."""
    try:
        return attribute()
    except RuntimeError as error:
        return f"raises {type(error).__name__}"


def _storage(t: torch.Tensor):
    return t.untyped_storage().data_ptr()


def _snapshot(t: torch.Tensor) -> tuple:
    return (t.detach().clone(), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def _observe(fn: Callable, make_inputs: Callable, mode: str, mutate_outputs: bool) -> Observation:
    obs = Observation()
    inputs = _fresh_inputs(make_inputs)
    tensors = _input_tensors(inputs)
    try:
        if mode == "train":
            outputs = fn(*inputs.args, **inputs.kwargs)
        else:
            with torch.no_grad():
                outputs = fn(*inputs.args, **inputs.kwargs)
    except Exception as error:  # eager's rejections must be ours too
        obs.error = error
        return obs
    obs.outputs = pytree.tree_map(_output_summary, outputs)
    flat_outputs = pytree.tree_leaves(outputs)
    obs.inputs_after = [_snapshot(t) for t in tensors]
    input_storages = [_storage(t) for t in tensors]
    out_tensors = [o for o in flat_outputs if isinstance(o, torch.Tensor)]
    out_storages = [_storage(o) for o in out_tensors]
    obs.aliasing = [
        (
            [j for j, s in enumerate(input_storages) if s == storage],
            [j for j, s in enumerate(out_storages) if s == storage],
        )
        for storage in out_storages
    ]
    if mode == "train":
        obs.grads = _gradients(out_tensors, tensors, _leaves(inputs))
    if mutate_outputs:
        obs.after_output_mutation = _mutate_outputs(out_tensors, tensors)
    return obs


def _gradients(outputs, inputs, leaves) -> list:
    """Backpropagate a weighted sum of every differentiable output and of every non-leaf input
    (whose value a mutation may have changed) and return each leaf's gradient."""
    generator = torch.Generator().manual_seed(1)
    terms = []
    for value in [*outputs, *(t for t in inputs if not t.is_leaf)]:
        if value.requires_grad and value.is_floating_point():
            weight = torch.randn(value.shape, generator=generator, dtype=torch.float64)
            terms.append((value * weight.to(value.dtype)).sum())
        elif value.requires_grad and value.is_complex():
            weight = torch.randn(value.shape, generator=generator, dtype=torch.complex128)
            terms.append((value * weight.to(value.dtype)).real.sum())
    for leaf in leaves:
        leaf.grad = None
    if terms:
        torch.stack([t.to(torch.float64) for t in terms]).sum().backward()
    return [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves]


def _mutate_outputs(outputs, inputs) -> list:
    """Add one to each output in turn; record what the inputs and outputs look like after."""
    results = []
    for out in outputs:
        if out.dtype == torch.bool or out.numel() == 0:
            continue
        try:
            with torch.no_grad():
                out.add_(1)
            results.append([t.detach().clone() for t in (*inputs, *outputs)])
        except Exception as error:
            results.append(type(error))
    return results


def _assert_same_tensor(actual, expected, what, rtol, atol, check_stride=True):
    assert isinstance(actual, torch.Tensor), f"{what}: expected a tensor, got {type(actual)}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != eager {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != eager {expected.dtype}"
    if check_stride:
        assert actual.stride() == expected.stride(), f"{what}: stride {actual.stride()} != eager {expected.stride()}"
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def compare(actual: Observation, expected: Observation, mode: str, rtol: float, atol: float, check_output_strides: bool):
    if expected.error is not None:
        assert actual.error is not None, f"[{mode}] eager raised {expected.error!r}, aotforge did not"
        assert type(actual.error) is type(expected.error) or isinstance(actual.error, RuntimeError), (
            f"[{mode}] eager raised {type(expected.error).__name__}, aotforge raised "
            f"{type(actual.error).__name__}: {actual.error}"
        )
        return
    if actual.error is not None:
        raise AssertionError(f"[{mode}] aotforge raised but eager did not") from actual.error
    flat_actual, spec_actual = pytree.tree_flatten(actual.outputs)
    flat_expected, spec_expected = pytree.tree_flatten(expected.outputs)
    assert spec_actual == spec_expected, f"[{mode}] output structure {spec_actual} != eager {spec_expected}"
    for i, (a, e) in enumerate(zip(flat_actual, flat_expected)):
        what = f"[{mode}] output {i}"
        if isinstance(e, TensorSummary):
            assert isinstance(a, TensorSummary), f"{what}: expected a tensor, got {a!r}"
            _assert_same_tensor(a.value, e.value, what, rtol, atol, check_stride=False)
            if check_output_strides:
                assert a.stride == e.stride, f"{what}: stride {a.stride} != eager {e.stride}"
            assert a.requires_grad == e.requires_grad, f"{what}: requires_grad {a.requires_grad} != eager {e.requires_grad}"
            assert a.is_leaf == e.is_leaf, f"{what}: is_leaf {a.is_leaf} != eager {e.is_leaf}"
            assert a.has_grad_fn == e.has_grad_fn, f"{what}: grad_fn presence {a.has_grad_fn} != eager {e.has_grad_fn}"
            assert (a.is_conj, a.is_neg) == (e.is_conj, e.is_neg), (
                f"{what}: (is_conj, is_neg) {(a.is_conj, a.is_neg)} != eager {(e.is_conj, e.is_neg)}"
            )
            # Eager regenerates a view's grad_fn as AsStridedBackward0 after an in-place
            # change of its base (an implementation detail, same gradients): not compared.
            # A compiled Function's own node (multi-output views it returns, as PyTorch's
            # AOTAutograd does) stands in for eager's view node: same gradient, and autograd
            # still refuses in-place changes to them.
            if e.view_grad_fn not in (None, "AsStridedBackward0") and a.view_grad_fn != _COMPILED_FUNCTION_NODE:
                assert a.view_grad_fn == e.view_grad_fn, f"{what}: grad_fn {a.view_grad_fn} != eager {e.view_grad_fn}"
        else:
            assert a == e, f"{what}: {a!r} != eager {e!r}"
    for i, (a, e) in enumerate(zip(actual.inputs_after, expected.inputs_after)):
        what = f"[{mode}] input {i} after the call"
        assert a[1:] == e[1:], f"{what}: (shape, stride, offset, dtype) {a[1:]} != eager {e[1:]}"
        torch.testing.assert_close(a[0], e[0], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    assert actual.aliasing == expected.aliasing, (
        f"[{mode}] aliasing (inputs, outputs) shared per output {actual.aliasing} != eager {expected.aliasing}"
    )
    for i, (a, e) in enumerate(zip(actual.grads, expected.grads)):
        what = f"[{mode}] gradient of leaf {i}"
        assert (a is None) == (e is None), f"{what}: {'missing' if a is None else 'present'}, eager differs"
        if e is not None:
            _assert_same_tensor(a, e, what, rtol, atol, check_stride=False)
    assert len(actual.after_output_mutation) == len(expected.after_output_mutation)
    for i, (a, e) in enumerate(zip(actual.after_output_mutation, expected.after_output_mutation)):
        what = f"[{mode}] after mutating output {i}"
        if isinstance(e, type):
            assert isinstance(a, type), f"{what}: eager raised {e.__name__}, aotforge did not"
            continue
        assert not isinstance(a, type), f"{what}: aotforge raised {a}, eager did not"
        for j, (x, y) in enumerate(zip(a, e)):
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"{what}, tensor {j}: {m}")


def verify(
    fn: Callable,
    make_inputs: Callable,
    *,
    modes: Sequence[str] = MODES,
    compile: Callable[[Callable, str], Callable] = default_compile,
    rtol: float = 1e-7,
    atol: float = 1e-7,
    calls: int = 2,
    mutate_outputs: bool = True,
    check_output_strides: bool = True,
) -> None:
    """Check that ``compile(fn, mode)`` behaves exactly like ``fn`` for ``make_inputs()``.

    ``make_inputs`` builds fresh arguments on each call (seeded, so eager and compiled see the
    same values): a tuple of arguments, or an ``Inputs``. The compiled function is called
    ``calls`` times per mode, so that cached (second-call) paths are checked too.
    """
    for mode in modes:
        expected = _observe(fn, make_inputs, mode, mutate_outputs)
        compiled = compile(fn, mode)
        for _ in range(calls):
            actual = _observe(compiled, make_inputs, mode, mutate_outputs)
            compare(actual, expected, mode, rtol, atol, check_output_strides)


def verify_module(
    make_module: Callable[[], torch.nn.Module],
    compile_module: Callable[[torch.nn.Module], Callable],
    make_input: Callable[[], Any],
    *,
    steps: int = 3,
    lr: Optional[float] = None,
    rtol: float = 1e-7,
    atol: float = 1e-7,
) -> None:
    """Train two copies of a module side by side, one eagerly and one through
    ``compile_module``, and compare outputs, every buffer and parameter, and every gradient
    after each step (with an SGD step of ``lr`` between steps if given)."""
    torch.manual_seed(0)
    model = make_module()
    reference = make_module()
    reference.load_state_dict(model.state_dict())
    compiled = compile_module(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in (model, reference)] if lr else []
    for step in range(steps):
        x = make_input()
        for opt in optimizers:
            opt.zero_grad()
        out, expected = compiled(x), reference(x)
        torch.testing.assert_close(out, expected, rtol=rtol, atol=atol, msg=lambda m: f"step {step} output: {m}")
        if not torch.is_grad_enabled() or not expected.requires_grad:
            continue
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for opt in optimizers:
            opt.step()
        for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"step {step}, {name}: {m}")
        for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol, msg=lambda m: f"step {step}, {name}.grad: {m}")


# --- training loops (CUDA graphs' tests: the loops users write, against eager) -----------------

LOOP_PATTERNS = ("plain", "accumulate", "repeat_backward", "append", "eval")


def training_loop(pattern: str, model: torch.nn.Module, run: Callable, batches: Sequence[torch.Tensor],
                  optimizer: torch.optim.Optimizer) -> tuple[list, list, list, list]:
    """Run one of the loops users write, with ``run`` (the model, eager or compiled); returns
    (outputs the loop kept, parameters, gradients, buffers) to compare with eager's.

    plain: step and ``zero_grad`` every batch, keeping each loss; accumulate: 4 micro-batches
    per step; repeat_backward: ``backward()`` only, gradients never reset; append: keep
    ``run(x).detach()``; eval: a training step, then ``no_grad`` evaluation in eval mode."""
    kept = []
    for step, x in enumerate(batches):
        if pattern == "plain":
            loss = run(x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            kept.append(loss)  # a later replay must not change it
        elif pattern == "accumulate":
            loss = run(x) / 4
            loss.backward()
            if step % 4 == 3:
                optimizer.step()
                optimizer.zero_grad()
        elif pattern == "repeat_backward":
            run(x).backward()
        elif pattern == "append":
            kept.append(run(x).detach())
        elif pattern == "eval":
            run(x).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            model.eval()
            with torch.no_grad():
                kept.append(run(x + 1))
            model.train()
        else:
            raise ValueError(f"unknown loop pattern {pattern!r}; known: {LOOP_PATTERNS}")
    return kept, list(model.parameters()), [p.grad for p in model.parameters()], list(model.buffers())


def assert_same_loops(got: tuple, expected: tuple, rtol: float, atol: float) -> None:
    for got_group, want_group in zip(got, expected):
        assert len(got_group) == len(want_group)
        for have, want in zip(got_group, want_group):
            if want is None:
                assert have is None
            else:
                torch.testing.assert_close(have, want, rtol=rtol, atol=atol)
