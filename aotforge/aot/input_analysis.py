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
from .subclasses import inner_leaves, is_subclass
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
    """Groups of distinct tensor inputs that overlap in memory, where one of them is mutated.

    Views of one storage that touch disjoint elements (``x[0:2]`` and ``x[2:4]``) do not
    alias: a mutation of one never shows in the other, so they stay separate inputs."""
    by_storage: dict = {}
    for position, arg in enumerate(flat_args):
        if isinstance(arg, torch.Tensor) and not arg.is_sparse:
            by_storage.setdefault(storage_ref(arg), []).append(position)
    groups = []
    for positions in by_storage.values():
        for group in _overlapping_components([flat_args[p] for p in positions], positions):
            if len(group) > 1 and any(
                meta.input_info[p].mutates_data or meta.input_info[p].mutates_metadata for p in group
            ):
                groups.append(group)
    return groups


def _overlapping_components(tensors: Sequence[torch.Tensor], positions: Sequence[int]) -> list[list[int]]:
    """``positions`` split into groups connected by overlapping memory."""
    component = list(range(len(tensors)))

    def root(i: int) -> int:
        while component[i] != i:
            i = component[i]
        return i

    for i in range(len(tensors)):
        for j in range(i + 1, len(tensors)):
            if root(i) != root(j) and _may_overlap(tensors[i], tensors[j]):
                component[root(j)] = root(i)
    groups: dict[int, list[int]] = {}
    for i, position in enumerate(positions):
        groups.setdefault(root(i), []).append(position)
    return list(groups.values())


# Exact overlap tests enumerate element offsets; beyond this many elements, assume overlap.
_EXACT_OVERLAP_LIMIT = 1 << 16


def _may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """False only if ``a`` and ``b`` (views of one storage) certainly touch no common element;
    for tensor subclasses, the outer layouts and every pair of inner tensors sharing storage."""
    if _layouts_may_overlap(a, b):
        return True
    if is_subclass(a) or is_subclass(b):
        leaves_a, leaves_b = inner_leaves(a), inner_leaves(b)
        return any(
            storage_ref(x) == storage_ref(y) and _layouts_may_overlap(x, y) for x in leaves_a for y in leaves_b
        )
    return False


def _layouts_may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    layouts = []
    for t in (a, b):
        values = (*t.shape, *t.stride(), t.storage_offset())
        if not all(isinstance(v, int) for v in values) or any(s < 0 for s in t.stride()):
            return True  # symbolic or negative strides: be conservative
        if t.numel() == 0:
            return False
        layouts.append((list(t.shape), list(t.stride()), t.storage_offset()))
    spans = [(offset, offset + sum((n - 1) * s for n, s in zip(size, stride))) for size, stride, offset in layouts]
    if spans[0][1] < spans[1][0] or spans[1][1] < spans[0][0]:
        return False
    if a.numel() > _EXACT_OVERLAP_LIMIT or b.numel() > _EXACT_OVERLAP_LIMIT:
        return True
    offsets = [_element_offsets(*layout) for layout in layouts]
    return bool(torch.isin(offsets[0], offsets[1]).any())


def _element_offsets(size: list, stride: list, offset: int) -> torch.Tensor:
    result = torch.tensor([offset], dtype=torch.int64)
    for n, s in zip(size, stride):
        result = (result[:, None] + torch.arange(n, dtype=torch.int64)[None, :] * s).reshape(-1)
    return result


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
