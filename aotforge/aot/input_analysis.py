"""Input transforms that run before tracing and are undone at runtime.

Each transform is one object with two halves: ``pre_compile(flat_fn, args)`` rewrites what
gets traced; ``post_compile(run)`` wraps the compiled callable so that it takes the user's
original flat arguments again.

* ``DedupeInputs``: ``f(x, x)`` is traced as ``f'(x)``; the same tensor object passed twice
  must be one graph input (two would let a mutation through one miss the other).
* ``SyntheticBases``: ``f(a, a.view(-1))`` where either is mutated is traced as
  ``f'(base)`` with each alias regenerated inside the graph as a view of ``base``, so that
  functionalization sees the aliasing and every alias observes the mutation, as in eager.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .functional import storage_ref
from .schemas import StridedLayout, ViewAndMutationMeta, symbol_bindings


class DedupeInputs:
    """Trace each tensor object once, however many times it is passed."""

    def __init__(self, flat_args: Sequence):
        first_position: dict[int, int] = {}
        self.keep: list[int] = []  # positions of the args that stay
        self.source: list[int] = []  # for each original position, its index among the kept
        for position, arg in enumerate(flat_args):
            key = id(arg) if isinstance(arg, torch.Tensor) else -1 - position
            if key not in first_position:
                first_position[key] = len(self.keep)
                self.keep.append(position)
            self.source.append(first_position[key])

    @staticmethod
    def needed(flat_args: Sequence) -> bool:
        ids = [id(a) for a in flat_args if isinstance(a, torch.Tensor)]
        return len(ids) != len(set(ids))

    def pre_compile(self, flat_fn: Callable, flat_args: Sequence) -> tuple[Callable, list]:
        source = self.source

        def deduped_fn(*kept):
            return flat_fn(*(kept[i] for i in source))

        return deduped_fn, [flat_args[i] for i in self.keep]

    def post_compile(self, run: Callable) -> Callable:
        keep = self.keep

        def deduped_run(args: list) -> list:
            return run([args[i] for i in keep])

        return deduped_run


def alias_groups(flat_args: Sequence, meta: ViewAndMutationMeta) -> list[list[int]]:
    """Groups of distinct tensor inputs that share storage, where one of them is mutated."""
    by_storage: dict = {}
    for position, arg in enumerate(flat_args):
        if isinstance(arg, torch.Tensor) and not arg.is_sparse:
            by_storage.setdefault(storage_ref(arg), []).append(position)
    groups = []
    for positions in by_storage.values():
        if len(positions) > 1 and any(
            meta.input_info[p].mutates_data or meta.input_info[p].mutates_metadata for p in positions
        ):
            groups.append(positions)
    return groups


def _synthetic_base(members: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor whose storage holds every member: their common autograd base if they have
    one (so gradients reach it), else a flat view over the whole storage."""
    first = members[0]
    root = first._base if first._base is not None else first
    if all((m._base if m._base is not None else m) is root for m in members):
        return root
    if any(m.requires_grad for m in members):
        raise NotImplementedError(
            "aotforge: inputs that share storage, are mutated and require grad must be views of "
            "one common base tensor (as made by view/slice ops); these are not. Pass the base "
            "tensor instead, or clone the inputs before the call."
        )
    if any(m.dtype != first.dtype for m in members):
        raise NotImplementedError(
            "aotforge: mutated inputs that alias each other with different dtypes are not "
            "supported; clone one of them before the call."
        )
    numel = first.untyped_storage().nbytes() // first.element_size()
    return first.as_strided((numel,), (1,), 0)


class SyntheticBases:
    """Replace each group of aliased inputs (one of them mutated) by one base input."""

    def __init__(self, groups: list[list[int]], fake_args: Sequence):
        self.groups = groups
        grouped = {p for g in groups for p in g}
        self.others = [p for p in range(len(fake_args)) if p not in grouped]
        self.num_args = len(fake_args)
        self.fake_args = list(fake_args)
        # Aliases whose metadata the function changes: (position, layout after); filled
        # while tracing, applied to the caller's tensors at runtime.
        self.metadata_mutations: dict[int, StridedLayout] = {}

    def pre_compile(self, flat_fn: Callable, flat_args: Sequence) -> tuple[Callable, list]:
        groups, others, num_args = self.groups, self.others, self.num_args
        metadata_mutations = self.metadata_mutations

        def synthetic_fn(*args):
            full: list = [None] * num_args
            for base, group in zip(args[: len(groups)], groups):
                for position in group:
                    alias = flat_args[position]
                    full[position] = base.as_strided(alias.size(), alias.stride(), alias.storage_offset())
            for position, value in zip(others, args[len(groups) :]):
                full[position] = value
            before = {p: StridedLayout.of(full[p]) for g in groups for p in g}
            outputs = flat_fn(*full)
            for position, layout in before.items():
                after = StridedLayout.of(full[position])
                if after != layout:
                    metadata_mutations[position] = after
            return outputs

        bases = [_synthetic_base([flat_args[p] for p in g]) for g in groups]
        return synthetic_fn, [*bases, *(flat_args[p] for p in others)]

    def post_compile(self, run: Callable) -> Callable:
        groups, others = self.groups, self.others
        metadata_mutations = list(self.metadata_mutations.items())
        fake_args = self.fake_args
        needs_bindings = any(not layout.is_static for _, layout in metadata_mutations)

        def synthetic_run(args: list) -> list:
            bases = [_synthetic_base([args[p] for p in g]) for g in groups]
            outputs = run([*bases, *(args[p] for p in others)])
            bindings = symbol_bindings(fake_args, args) if needs_bindings else {}
            for position, layout in metadata_mutations:
                with torch.no_grad():
                    args[position].as_strided_(*layout.evaluate(bindings))
            return outputs

        return synthetic_run


def apply_post_compile(run: Callable, transforms: Sequence) -> Callable:
    """Wrap ``run`` with each transform's runtime half, innermost (last applied) first."""
    for transform in reversed(transforms):
        run = transform.post_compile(run)
    return run
