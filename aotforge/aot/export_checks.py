"""What export refuses about a function's inputs, checked once the metadata is collected.

An exported graph's calling convention has no place for some side effects that aot_function
replays at runtime: metadata mutations of inputs, data mutations of inputs a joint
differentiates, storage changes, and mutations of inputs that share memory with another input
(duplicated, or views of one base). Each refusal starts with the sentence PyTorch's export
raises for the same case (callers and PyTorch's own tests match on it), then says in our words
which input it is and what to do instead. The checks run in PyTorch's order, so a function
with several of these problems is refused for the same one.
"""
from __future__ import annotations

from typing import Sequence

from .export_errors import ExportError
from .input_analysis import alias_groups
from .schemas import ViewAndMutationMeta

METADATA_MUTATION = (
    "Found an input that received a metadata mutation, through e.g. a call to `.resize_()` or "
    "`.transpose_()`. This is currently banned in the aot_export workflow."
)
MUTATION_REQUIRING_GRAD = (
    "Found a graph input that requires gradients, and received a mutation. This is currently "
    "banned in the aot_export workflow."
)
DUPLICATED_MUTATED = "Encountered duplicated inputs that are mutated in the graph you are trying to export."
ALIASED_MUTATED = "Encountered aliased inputs that are mutated in the graph you are trying to export."


def refuse_storage_changes(info, description: str, who: str) -> None:
    """set_() and storage resizes of inputs: aot_function replays them; a signature cannot."""
    if info.storage_swapped or info.storage_nbytes_after is not None:
        what = "set_()s" if info.storage_swapped else "resizes the storage of"
        raise ExportError(
            f"{who}: the function {what} {description}; an exported graph cannot express a "
            "storage change of an input. Do it outside the exported function, or compile with "
            "aot_function / torch.compile, which replay it."
        )


def check_module_inputs(
    fake_args: Sequence, meta: ViewAndMutationMeta, descriptions: list[str], trace_joint: bool
) -> None:
    """aot_export_module's refusals (its graph returns data mutations as extra outputs)."""
    for info, description in zip(meta.input_info, descriptions):
        refuse_storage_changes(info, description, "aot_export_module")
        if info.mutates_metadata:
            raise ExportError(
                f"{METADATA_MUTATION} aot_export_module: the forward changes the metadata (shape, "
                f"strides or offset, as t_, unsqueeze_, resize_ or as_strided_ do) of {description}. "
                "Export cannot express that; use the out-of-place op (x = x.t()) instead."
            )
        if trace_joint and info.mutates_data and info.requires_grad:
            raise ExportError(
                f"{MUTATION_REQUIRING_GRAD} aot_export_module: the forward mutates {description} in "
                "place, and it requires grad. A joint export cannot mutate what it differentiates: "
                "use an out-of-place op, or call requires_grad_(False) on it before exporting."
            )
        if trace_joint and info.mutates_data and info.requires_grad_after:
            raise ExportError(
                f"aot_export_module: the forward writes a value that requires grad into "
                f"{description}, so it would start requiring grad. Write a detached value "
                "(buf.copy_(value.detach())) instead."
            )
    _refuse_shared_memory(fake_args, meta, descriptions, "aot_export_module")


def check_simple_inputs(fake_args: Sequence, meta: ViewAndMutationMeta, trace_joint: bool) -> None:
    """aot_export_joint_simple's refusals: its graph keeps func's convention, so no input
    may be mutated at all; the more specific refusals come first, as in PyTorch."""
    who = "aot_export_joint_simple"
    descriptions = [f"input {index}" for index in range(len(meta.input_info))]
    for info, description in zip(meta.input_info, descriptions):
        refuse_storage_changes(info, description, who)
    for info, description in zip(meta.input_info, descriptions):
        if info.mutates_metadata:
            raise ExportError(f"{METADATA_MUTATION} {who}: func mutates the metadata (t_, unsqueeze_, "
                              f"...) of {description}. {_NO_MUTATIONS}")
    for info, description in zip(meta.input_info, descriptions):
        if trace_joint and info.mutates_data and info.requires_grad:
            raise ExportError(f"{MUTATION_REQUIRING_GRAD} {who}: func mutates {description}, which "
                              f"requires grad. {_NO_MUTATIONS}")
    _refuse_shared_memory(fake_args, meta, descriptions, who)
    mutated = [index for index, info in enumerate(meta.input_info) if info.mutates_data]
    if mutated:
        raise ExportError(
            f"{who} does not support input mutations. ViewAndMutationMeta(inputs whose data is "
            f"mutated: {mutated}). {who}: func mutates the data (an in-place op) of "
            f"{descriptions[mutated[0]]}. {_NO_MUTATIONS}"
        )


_NO_MUTATIONS = (
    "It must not mutate inputs: compute on a copy (x = x.clone()) or use aot_export_module, "
    "whose graph returns updated inputs as extra outputs."
)


def _refuse_shared_memory(fake_args: Sequence, meta: ViewAndMutationMeta, descriptions: list[str], who: str) -> None:
    """Inputs that overlap in memory, one of them mutated: an exported graph takes each input
    separately (aot_function dedupes them or merges them into one base instead)."""
    for group in alias_groups(fake_args, meta):
        names = ", ".join(descriptions[i] for i in group)
        duplicated = all(fake_args[i] is fake_args[group[0]] for i in group)
        raise ExportError(
            f"{DUPLICATED_MUTATED if duplicated else ALIASED_MUTATED} {who}: {names} "
            f"{'are the same tensor' if duplicated else 'share memory'} and one of them is mutated; "
            "the exported graph takes each input separately and cannot express that. Pass a "
            ".clone() of one."
        )
