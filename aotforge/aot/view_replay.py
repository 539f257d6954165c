"""Regenerate an aliased output by replaying the view ops eager applied to its base.

Functionalization records, for every view it sees, a ``ViewMeta`` (the op and its
arguments); a view of a view carries its base's records followed by its own. The ops between
an output's base and the output are what eager ran, so replaying them on the real base at
runtime gives the same tensor eager gave: the same conj/neg bits and dtype (``conj()``,
``view_as_complex``, ``view(torch.int32)``, ``.real``), and the same autograd view chain
(``ViewBackward0``, ``SplitBackward0`` with its multi-output rule), which ``as_strided`` cannot
express.

``as_strided`` remains the fallback only where it is exactly equivalent: a same-dtype view
without conj/neg bits, when the ops cannot be read back (older torch, or a view whose first
op is an in-place view op such as ``t_``, whose replay would change the base itself).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch

from torch._C._autograd import CreationMeta, _get_creation_meta

from .schemas import StridedLayout, _evaluate, _to_expr
from .subclasses import is_subclass

_functionalization = getattr(torch._C, "_functionalization", None)
_get_sequence = getattr(_functionalization, "get_view_meta_sequence", None)
_apply_sequence = getattr(_functionalization, "apply_view_meta_sequence", None)


@dataclasses.dataclass(frozen=True)
class ViewStep:
    """One recorded view op: the ViewMeta class name and its arguments, with sizes as ints or
    sympy expressions over the traced inputs' size symbols (plain data, so it can be stored)."""

    kind: str
    arguments: tuple

    @property
    def is_static(self) -> bool:
        return not any(_is_symbolic(a) for a in _leaves(self.arguments))


@dataclasses.dataclass(frozen=True)
class ViewReplay:
    """How to rebuild one aliased output from its base.

    ``steps`` is None when the ops could not be read; ``layout``, ``dtype``, ``is_conj`` and
    ``is_neg`` describe the output eager returned, for the as_strided fallback and its checks.
    """

    steps: Optional[tuple[ViewStep, ...]]
    layout: StridedLayout
    dtype: torch.dtype
    is_conj: bool
    is_neg: bool
    requires_grad: bool
    # Eager made the view under no_grad: it has no grad_fn (and in-place changes to it are
    # restricted), so it is replayed under no_grad too.
    made_under_no_grad: bool = False
    # A tensor-subclass output: autograd's record of the view ops applied to the subclass
    # itself (its inner tensors' ops may differ: a DTensor's local views use local sizes).
    view_function: Optional[Callable] = dataclasses.field(default=None, compare=False)

    def apply(self, base: torch.Tensor, bindings: dict, *, patch_requires_grad: bool = True) -> torch.Tensor:
        with torch.no_grad() if self.made_under_no_grad else contextlib.nullcontext():
            if self.view_function is not None:
                view = self.view_function(base)
            elif self.steps is not None:
                view = _replay_steps(base, self.steps, bindings)
            else:
                view = self._as_strided(base, bindings)
        if not patch_requires_grad:
            return view
        # requires_grad as eager had it: a detached view, or requires_grad_() on a view of a
        # tensor that did not require grad.
        if view.requires_grad and not self.requires_grad:
            view = view.detach()
        elif self.requires_grad and not view.requires_grad:
            view.requires_grad_(True)
        return view

    def _as_strided(self, base: torch.Tensor, bindings: dict) -> torch.Tensor:
        if (base.dtype, base.is_conj(), base.is_neg()) != (self.dtype, self.is_conj, self.is_neg):
            raise NotImplementedError(
                "aotforge: an output aliases an input or intermediate through a view that "
                f"changes its dtype or conj/neg bit ({base.dtype} -> {self.dtype}), and this "
                "torch cannot record the view ops to replay it. Return a copy (.clone()) "
                "instead, or upgrade torch."
            )
        size, stride, offset = self.layout.evaluate(bindings)
        if list(base.size()) == size and list(base.stride()) == stride and base.storage_offset() == offset:
            return base.view(base.shape)  # same layout: a plain alias keeps view autograd simple
        return base.as_strided(size, stride, offset)


def record_view_replay(output: torch.Tensor, base: Optional[torch.Tensor]) -> ViewReplay:
    """The replay of ``output`` (a FunctionalTensor) from ``base`` (the FunctionalTensor it
    was viewed from, or None for an input's own functional storage)."""
    steps = None if is_subclass(output) else _relative_steps(output, base)
    return ViewReplay(
        steps=steps,
        layout=StridedLayout.of(output),
        dtype=output.dtype,
        is_conj=output.is_conj(),
        is_neg=output.is_neg(),
        requires_grad=bool(output.requires_grad),
        made_under_no_grad=output._is_view() and _get_creation_meta(output) == CreationMeta.NO_GRAD_MODE,
        view_function=_subclass_view_function(output, base),
    )


def _subclass_view_function(output: torch.Tensor, base: Optional[torch.Tensor]) -> Optional[Callable]:
    """For a subclass output that autograd recorded as a view of ``base``: replay its view
    ops on a new base (``Tensor._view_func_unsafe``: the checked ``_view_func`` compares the
    new base with the traced one, a fake tensor). None where that does not apply (plain
    tensors, another base, symbolic sizes: the replay would reuse the traced SymInts)."""
    if not is_subclass(output) or base is None or not output._is_view() or output._base is not base:
        return None
    if not all(isinstance(s, int) for s in (*output.size(), *output.stride())):
        return None
    return getattr(output, "_view_func_unsafe", None)


def _relative_steps(output, base) -> Optional[tuple[ViewStep, ...]]:
    if _get_sequence is None or _apply_sequence is None:
        return None
    try:
        sequence = list(_get_sequence(output.elem))
        base_sequence = list(_get_sequence(base.elem)) if base is not None else []
    except (RuntimeError, AttributeError, TypeError):
        return None
    # The base's records are a prefix of the output's (the same objects): drop them.
    if len(base_sequence) > len(sequence) or any(
        a is not b for a, b in zip(base_sequence, sequence)
    ):
        return None
    relative = sequence[len(base_sequence):]
    steps = []
    for position, meta in enumerate(relative):
        kind = type(meta).__name__
        # An in-place view op (t_, unsqueeze_, as_strided_) applied first would change the
        # base itself; after another view it changes only that fresh view, as eager's did.
        if kind.endswith("__ViewMeta") and position == 0:
            return None
        steps.append(ViewStep(kind, _to_plain(meta.as_tuple())))
    return tuple(steps)


# Multi-output view ops, by ViewMeta kind. Eager's outputs of these carry the op's own grad_fn
# (SplitBackward0, UnbindBackward0). Up to torch 2.14 apply_view_meta_sequence replays the
# op; from 2.15 it rebuilds only the one output, as a slice or select (another grad_fn kind,
# the same gradient), so aotforge replays these by running the op itself.
_MULTI_OUTPUT_VIEWS = {
    "split_Tensor_ViewMeta": torch.ops.aten.split.Tensor,
    "split_with_sizes_ViewMeta": torch.ops.aten.split_with_sizes.default,
    "unbind_int_ViewMeta": torch.ops.aten.unbind.int,
}
# Their arguments: (has_symbolic_inputs, out_index, reapply_views, inverse_return_mode,
# *the op's arguments after the tensor), as torch 2.13 to 2.15 lay them out.
_OUT_INDEX, _OP_ARGUMENTS = 1, 4


def _replay_steps(base: torch.Tensor, steps: tuple[ViewStep, ...], bindings: dict) -> torch.Tensor:
    view, pending = base, []
    for step in steps:
        op = _MULTI_OUTPUT_VIEWS.get(step.kind)
        if op is None:
            pending.append(_view_meta(step, bindings))
            continue
        if pending:
            view, pending = _apply_sequence(view, pending), []
        arguments = _from_plain(step.arguments, bindings)
        view = op(view, *arguments[_OP_ARGUMENTS:])[arguments[_OUT_INDEX]]
    return _apply_sequence(view, pending) if pending else view


def _view_meta(step: ViewStep, bindings: dict) -> Any:
    arguments = _from_plain(step.arguments, bindings)
    return getattr(_functionalization, step.kind)(arguments)


# ViewMeta arguments hold SymInts (dynamic shapes) and InverseReturnMode enums; store them as
# sympy expressions and ("mode", value) pairs so the record is plain data.
_MODE = "InverseReturnMode"


def _to_plain(value):
    if isinstance(value, (tuple, list)):
        return type(value)(_to_plain(v) for v in value)
    if isinstance(value, torch.SymInt):
        return _to_expr(value)
    if isinstance(value, _functionalization.InverseReturnMode):
        return (_MODE, int(value))
    return value


def _from_plain(value, bindings: dict):
    if isinstance(value, tuple) and len(value) == 2 and value[0] == _MODE:
        return _functionalization.InverseReturnMode(value[1])
    if isinstance(value, (tuple, list)):
        return type(value)(_from_plain(v, bindings) for v in value)
    if _is_symbolic(value):
        return _evaluate(value, bindings)
    return value


def _is_symbolic(value) -> bool:
    return hasattr(value, "free_symbols") and not isinstance(value, (int, float, bool))


def _leaves(value):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value
