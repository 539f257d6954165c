"""Thin helpers over PyTorch's functionalization (FunctionalTensorMode / FunctionalTensor).

Under functionalization every mutation becomes an out-of-place op plus a record that the
mutated tensor changed; these helpers wrap tensors, unwrap them and read those records.
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "FunctionalTensor",
    "FunctionalTensorMode",
    "to_functional",
    "from_functional",
    "has_data_mutation",
    "has_metadata_mutation",
    "mutations_under_no_grad",
    "mutations_hidden_from_autograd",
    "storage_ref",
    "below_functionalization",
]


def to_functional(value):
    """Wrap a tensor into a FunctionalTensor (keeping requires_grad); pass others through."""
    if isinstance(value, torch.Tensor):
        return FunctionalTensor.to_functional(value)
    return value


def from_functional(value):
    """The plain tensor behind a FunctionalTensor, with all pending updates applied."""
    if isinstance(value, FunctionalTensor):
        torch._sync(value)
        return torch._from_functional_tensor(value.elem)
    return value


def has_data_mutation(value) -> bool:
    if not isinstance(value, FunctionalTensor):
        return False
    torch._sync(value)
    return torch._functionalize_has_data_mutation(value.elem)


def has_metadata_mutation(value, original: torch.Tensor) -> bool:
    """True if the tensor's size, stride or offset changed (mutations that cancel out, like
    ``t_`` twice, do not count)."""
    if not isinstance(value, FunctionalTensor):
        return False
    if not torch._functionalize_has_metadata_mutation(value.elem):
        return False
    after = torch._from_functional_tensor(value.elem)
    return (
        after.shape != original.shape
        or after.stride() != original.stride()
        or after.storage_offset() != original.storage_offset()
    )


def mutations_under_no_grad(value) -> bool:
    return torch._functionalize_are_all_mutations_under_no_grad_or_inference_mode(value.elem)


def mutations_hidden_from_autograd(value) -> bool:
    return torch._functionalize_are_all_mutations_hidden_from_autograd(value.elem)


def storage_ref(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def below_functionalization() -> contextlib.AbstractContextManager:
    """Exclude the C++ Functionalize key while Python functionalization is active, so that
    tensors are not functionalized twice."""
    return torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
    )
