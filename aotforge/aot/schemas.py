"""The plain-data records one compile produces, read by every later stage.

``ViewAndMutationMeta`` says, per input, how the function mutated it, and per output, what it
aliases. The wrappers, the partitioner and export read it; nothing re-derives it.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Optional, Sequence

import sympy
import torch


class OutputKind(enum.Enum):
    """What a user output is, with respect to aliasing."""

    NOT_ALIAS = "not an alias"  # a fresh tensor (or a non-tensor value)
    IS_INPUT = "is an input"  # the input object itself, returned as it is
    ALIAS_OF_INPUT = "alias of input"  # a view of an input's storage
    ALIAS_OF_INTERMEDIATE = "alias of intermediate"  # a view of a tensor made inside


@dataclasses.dataclass(frozen=True)
class StridedLayout:
    """Size, stride and storage offset of a view, as ints or sympy expressions over the
    symbols of the traced inputs' shapes (dynamic shapes)."""

    size: tuple
    stride: tuple
    storage_offset: Any

    @staticmethod
    def of(tensor: torch.Tensor) -> "StridedLayout":
        return StridedLayout(
            tuple(_to_expr(s) for s in tensor.size()),
            tuple(_to_expr(s) for s in tensor.stride()),
            _to_expr(tensor.storage_offset()),
        )

    @functools.cached_property
    def is_static(self) -> bool:
        return all(isinstance(v, int) for v in (*self.size, *self.stride, self.storage_offset))

    def evaluate(self, bindings: dict) -> tuple[list[int], list[int], int]:
        """Concrete (size, stride, offset) for one call, given the symbols' values."""
        if self.is_static:  # the common case, on every call: no sympy
            return list(self.size), list(self.stride), self.storage_offset
        return (
            [_evaluate(v, bindings) for v in self.size],
            [_evaluate(v, bindings) for v in self.stride],
            _evaluate(self.storage_offset, bindings),
        )


def _to_expr(value) -> Any:
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr) if isinstance(expr, int) or expr.is_number else expr
    return int(value)


def _evaluate(value, bindings: dict) -> int:
    if isinstance(value, int):
        return value
    result = sympy.sympify(value.xreplace(bindings))
    if not result.is_number:
        raise RuntimeError(
            f"aotforge: cannot evaluate the symbolic size {value} for this call "
            f"(unbound symbols {sorted(map(str, result.free_symbols))})"
        )
    return int(result)


@dataclasses.dataclass(frozen=True)
class InputInfo:
    """How the traced function treated one flat input."""

    is_tensor: bool
    requires_grad: bool = False
    # requires_grad of the value after the call (``buf.copy_(w * 2)`` makes buf require grad)
    requires_grad_after: bool = False
    mutates_data: bool = False
    mutates_metadata: bool = False
    # Every data mutation happened under no_grad/inference mode: replay it under no_grad.
    mutations_under_no_grad: bool = False
    # Every data mutation went through a .detach()ed alias: autograd must not see it.
    mutations_hidden_from_autograd: bool = False
    # Inference graphs may keep the copy_ into the input (keep_inference_input_mutations).
    mutation_kept_in_graph: bool = False
    # The layout after a metadata mutation (t_, unsqueeze_, as_strided_, ...), or after set_().
    layout_after: Optional[StridedLayout] = None
    # set_(): the input now uses another tensor's storage. If that is another input's storage,
    # swapped_to_input is that input's index and layout_after's offset is relative to it;
    # otherwise (an intermediate) the graph returns the new value, which the input takes.
    storage_swapped: bool = False
    swapped_to_input: Optional[int] = None
    # resize_storage_bytes_ (FSDP): the input's storage size in bytes before and after the
    # call, when it changed (one of them is 0).
    storage_nbytes_before: Optional[int] = None
    storage_nbytes_after: Optional[int] = None

    @property
    def mutation_returned_by_graph(self) -> bool:
        """The graph returns the updated value, and the epilogue copies it into the input (or,
        after set_() to an intermediate, points the input at it)."""
        return (self.mutates_data and not self.mutation_kept_in_graph) or (
            self.storage_swapped and self.swapped_to_input is None
        )

    @property
    def storage_freed(self) -> bool:
        """The call resized the input's storage to 0 bytes (its data is gone afterwards)."""
        return self.storage_nbytes_after == 0

    @property
    def mutation_visible_to_autograd(self) -> bool:
        return (
            self.mutates_data
            and not self.mutations_under_no_grad
            and not self.mutations_hidden_from_autograd
        )


@dataclasses.dataclass(frozen=True)
class OutputInfo:
    """What one flat user output is."""

    kind: OutputKind
    is_tensor: bool
    requires_grad: bool = False
    # IS_INPUT / ALIAS_OF_INPUT: the flat input index it aliases.
    # ALIAS_OF_INTERMEDIATE: index into meta.intermediate_bases' outputs (see base_is_output).
    base_index: Optional[int] = None
    # ALIAS_OF_INTERMEDIATE only: True if the base is itself a user output (base_index is then
    # the user output's index), False if the graph returns the base as an extra output.
    base_is_user_output: bool = False
    layout: Optional[StridedLayout] = None
    # The layout the base had at trace time; a compiled base with another layout is an error.
    base_layout: Optional[StridedLayout] = None
    # Made by a multi-output view op (split, unbind, chunk): eager forbids in-place changes
    # to such views under grad mode, and so must the regenerated view (or, for a NOT_ALIAS
    # output the compiled Function returns, the view of it that the Function returns).
    multi_output_view: bool = False
    # NOT_ALIAS only: a view of an intermediate that the graph returns as a fresh tensor
    # (aten._unsafe_view) because aliases of one multi-output view op around it are returned
    # by the compiled Function itself (metadata._hidden_multi_output_aliases). Trace time only.
    hides_alias: bool = False
    # NOT_ALIAS only: a multi-output view that the compiled Function returns itself, whose
    # storage another user output (this index) shares and may legally change in place later
    # (the intermediate base, or the one ordinary view of it). Inside the Function's forward it
    # is rebuilt as a view of that output, so that such a change shows in it, as in eager.
    view_of_output: Optional[int] = None


@dataclasses.dataclass
class ViewAndMutationMeta:
    """Everything the runtime needs to reproduce eager's side effects around a functional
    graph. The graph returns, in order::

        (*updated values of mutated inputs, *user outputs, *intermediate bases)

    Every user output is a graph output, aliases too, as in PyTorch's layout (compilers and
    tools written for it index the graph's outputs by user output). The runtime regenerates
    an aliased output from its base instead (a real view of the caller's tensor), so it drops
    the graph's value of it at once (``regenerated_graph_outputs``): from there on it works
    with ``(*updated inputs, *fresh user outputs, *intermediate bases)``.
    """

    input_info: list[InputInfo]
    output_info: list[OutputInfo]
    num_intermediate_bases: int
    # For each intermediate base, whether it requires grad.
    intermediate_base_requires_grad: list[bool]
    is_training: bool = False

    @property
    def mutated_input_indices(self) -> list[int]:
        return [i for i, info in enumerate(self.input_info) if info.mutation_returned_by_graph]

    @property
    def fresh_output_indices(self) -> list[int]:
        return [i for i, o in enumerate(self.output_info) if o.kind is OutputKind.NOT_ALIAS]

    @property
    def num_graph_outputs(self) -> int:
        return (
            len(self.mutated_input_indices)
            + len(self.output_info)
            + self.num_intermediate_bases
        )

    @property
    def regenerated_graph_outputs(self) -> list[int]:
        """Positions among the graph's outputs of the user outputs the runtime regenerates
        from their bases (aliases of inputs or intermediates, inputs returned as they are)."""
        num_mutated = len(self.mutated_input_indices)
        return [num_mutated + i for i, o in enumerate(self.output_info) if o.kind is not OutputKind.NOT_ALIAS]

    def graph_output_requires_grad(self) -> list[bool]:
        """Which graph outputs are differentiable (and so get a tangent in the joint). Aliased
        outputs never are: their gradient flows through the view regenerated from the base."""
        result = []
        for i in self.mutated_input_indices:
            info = self.input_info[i]
            result.append(info.requires_grad_after and info.mutation_visible_to_autograd)
        for o in self.output_info:
            result.append(o.kind is OutputKind.NOT_ALIAS and o.requires_grad)
        result.extend(self.intermediate_base_requires_grad)
        return result

    def runtime_outputs_picker(self) -> Callable[[Sequence], list]:
        """``graph outputs -> the graph's outputs without those of regenerated user outputs``,
        the positions worked out once (the runtime calls it every step)."""
        dropped = frozenset(self.regenerated_graph_outputs)
        if not dropped:
            return list
        return lambda graph_outputs: [o for i, o in enumerate(graph_outputs) if i not in dropped]

    def describe(self) -> str:
        lines = ["inputs:"]
        for i, info in enumerate(self.input_info):
            flags = [f.name for f in dataclasses.fields(info) if getattr(info, f.name) is True]
            lines.append(f"  [{i}] {', '.join(flags) or '-'}")
        lines.append("outputs:")
        for i, out in enumerate(self.output_info):
            extra = "" if out.base_index is None else f" (base {out.base_index})"
            lines.append(f"  [{i}] {out.kind.value}{extra}, requires_grad={out.requires_grad}")
        lines.append(f"intermediate bases: {self.num_intermediate_bases}")
        return "\n".join(lines)


@dataclasses.dataclass
class AOTConfig:
    """What a caller chose for one aot_function/aot_module compile."""

    fw_compiler: Callable
    bw_compiler: Callable
    inference_compiler: Callable
    partition_fn: Callable
    decompositions: dict
    num_params_buffers: int = 0
    keep_inference_input_mutations: bool = False
    dynamic: bool = False
    # Indices of inputs whose storage lives as long as the module (parameters, buffers).
    static_input_indices: Sequence[int] = ()
    name: str = "function"
    # Compile the backward graph right after the forward instead of at the first backward
    # call: a compiler that builds kernels in the background then builds both graphs' at once.
    compile_backward_now: bool = False


@dataclasses.dataclass(frozen=True)
class TracedSizes:
    """What ``symbol_bindings`` reads of a traced input, for a runtime rebuilt from plain data
    (aot/cache.py) without fake tensors: a tensor's sizes, strides and storage offset (ints
    or sympy expressions), or a SymInt input's expression (``symint``)."""

    values: tuple
    symint: bool = False


def symbol_bindings(fake_args: Sequence, real_args: Sequence) -> dict:
    """Map each size symbol of the traced fake inputs to its value in this call's inputs."""
    bindings: dict = {}
    for fake, real in zip(fake_args, real_args):
        if isinstance(fake, TracedSizes):
            reals = (real,) if fake.symint else (*real.size(), *real.stride(), real.storage_offset())
            for traced, value in zip(fake.values, reals):
                if isinstance(traced, sympy.Symbol):
                    bindings[traced] = int(value)
            continue
        if not isinstance(fake, torch.Tensor):
            if isinstance(fake, torch.SymInt) and isinstance(fake.node.expr, sympy.Symbol):
                bindings[fake.node.expr] = int(real)
            continue
        for fake_dim, real_dim in zip(
            (*fake.size(), *fake.stride(), fake.storage_offset()),
            (*real.size(), *real.stride(), real.storage_offset()),
        ):
            if isinstance(fake_dim, torch.SymInt) and isinstance(fake_dim.node.expr, sympy.Symbol):
                bindings[fake_dim.node.expr] = int(real_dim)
    return bindings
