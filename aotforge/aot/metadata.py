"""Collect the view-and-mutation metadata: run the function once under functionalization
(on fake tensors) and read off what it did to its inputs and what its outputs alias."""
from __future__ import annotations

import contextlib
import dataclasses
from types import MethodType
from typing import Callable, Optional, Sequence

import torch
from torch._C._autograd import CreationMeta, _get_creation_meta
from torch._dispatch.python import enable_python_dispatcher

from .eager_kernels import eager_aliasing_kernels
from .functional import (
    FunctionalTensorMode,
    below_functionalization,
    has_data_mutation,
    has_metadata_mutation,
    mutations_hidden_from_autograd,
    mutations_under_no_grad,
    storage_ref,
)
from .schemas import InputInfo, OutputInfo, OutputKind, StridedLayout, ViewAndMutationMeta
from .subclasses import from_functional, is_subclass, subclass_input_info, to_functional
from .view_replay import ViewReplay, record_view_replay


@dataclasses.dataclass
class ContractMeta(ViewAndMutationMeta):
    """ViewAndMutationMeta plus what only the runtime epilogue reads."""

    # Per user output: how to rebuild it from its base if it is an alias, else None.
    view_replays: list[Optional[ViewReplay]] = dataclasses.field(default_factory=list)
    # Outputs a custom autograd.Function returned as (a view of) its input, by output index:
    # the input index. The graph computes them as regular outputs, so that the Function's
    # backward is traced; the runtime hands back the replayed view of the real input in their
    # place, so that they still alias the input as in eager. (A plain view replay would drop
    # the custom backward.)
    custom_function_aliases: dict[int, int] = dataclasses.field(default_factory=dict)


_STORAGE_SWAP_MESSAGE = (
    "aotforge: the function swaps or grows the storage of an input (set_() on a tensor "
    "subclass, or resize_() to a larger size); that cannot be replayed on the caller's "
    "tensor. Write the result to a new tensor and return it instead."
)

# Functionalization refuses resize_() to a larger size of a view; from torch 2.15 of every
# tensor, inputs and intermediates too (up to 2.14 an input's growth reached the check above).
_FUNCTIONALIZATION_REFUSES_GROWING = "Attempted to resize a view tensor to a larger size"
_GROWING_RESIZE_MESSAGE = (
    "aotforge: the function grows a tensor with resize_() ({error}). A traced graph cannot "
    "do that: on an input it would have to grow the caller's storage, and from torch 2.15 "
    "functionalization refuses it for any tensor. Make a new tensor of the new size instead "
    "(torch.empty, torch.cat) and return it."
)


def collect_metadata(
    flat_fn: Callable,
    fake_args: Sequence,
    *,
    is_training: bool,
    keep_inference_input_mutations: bool,
) -> tuple[ViewAndMutationMeta, list]:
    """Run ``flat_fn(*fake_args)`` once under functionalization and describe its effects.

    ``flat_fn`` takes flat arguments and returns a flat list of outputs. Also returns fake
    values of what the functional graph will return (the tangents are made like them).
    """
    nbytes_before = [_storage_nbytes(a) for a in fake_args]  # before wrapping touches them
    functional_mode = FunctionalTensorMode(_allow_token_discovery=True)
    with enable_python_dispatcher(), eager_aliasing_kernels(), functional_mode:
        with below_functionalization():
            functional_args = [to_functional(a) for a in fake_args]
            # Which input does each storage belong to? (aliased inputs were merged before.)
            storages = {}
            for index, arg in enumerate(functional_args):
                if isinstance(arg, torch.Tensor):
                    storages.setdefault(storage_ref(arg), index)
            grad_fns_before = [getattr(a, "grad_fn", None) for a in functional_args]
            try:
                with _StorageChanges(functional_args, nbytes_before).watching(functional_mode) as resizes:
                    outputs = list(flat_fn(*functional_args))
            except RuntimeError as error:
                if _FUNCTIONALIZATION_REFUSES_GROWING in str(error):
                    raise NotImplementedError(_GROWING_RESIZE_MESSAGE.format(error=error)) from error
                raise
            input_info = [
                subclass_input_info(index, f_arg, arg, grad_fn_before, _STORAGE_SWAP_MESSAGE)
                if is_subclass(arg)
                else _swapped_input_info(index, f_arg, arg, resizes, functional_args)
                if isinstance(arg, torch.Tensor) and torch._functionalize_was_storage_changed(f_arg.elem)
                else _input_info(f_arg, arg, grad_fn_before, is_training, keep_inference_input_mutations,
                                 resizes.of(index, arg))
                for index, (f_arg, arg, grad_fn_before) in enumerate(zip(functional_args, fake_args, grad_fns_before))
            ]
            # Inputs the call changes (data, metadata, storage): the epilogue changes them after the
            # compiled Function, so their aliases are regenerated after it.
            changed = {index for index, info in enumerate(input_info)
                       if info.mutates_data or info.mutates_metadata or info.storage_swapped
                       or info.storage_nbytes_after is not None}
            output_info, bases, view_replays, custom = _output_info(outputs, functional_args, storages, changed)
            meta = ContractMeta(
                input_info=input_info,
                output_info=output_info,
                num_intermediate_bases=len(bases),
                intermediate_base_requires_grad=[bool(b.requires_grad) for b in bases],
                is_training=is_training,
                view_replays=view_replays,
                custom_function_aliases=custom,
            )
            graph_outputs = [
                *(functional_args[i] for i in meta.mutated_input_indices),
                *outputs,
                *bases,
            ]
            graph_output_fakes = [from_functional(o) for o in graph_outputs]
            # Sync pending updates so no functional state leaks out of the mode.
            for arg in functional_args:
                from_functional(arg)
    return meta, graph_output_fakes


def _input_info(f_arg, arg, grad_fn_before, is_training: bool, keep_mutations: bool, resize) -> InputInfo:
    if not isinstance(arg, torch.Tensor):
        return InputInfo(is_tensor=False)
    nbytes_before, nbytes_after = resize
    mutates_data = has_data_mutation(f_arg)
    mutates_metadata = has_metadata_mutation(f_arg, arg)
    under_no_grad = mutates_data and mutations_under_no_grad(f_arg)
    # A mutation autograd saw gives the tensor a new grad_fn; one through .detach() (or
    # under no_grad) leaves it as it was, and the write-back must not record one either.
    hidden = mutates_data and (
        mutations_hidden_from_autograd(f_arg)
        or (not mutates_metadata and f_arg.grad_fn is grad_fn_before)
    )
    keep = (
        keep_mutations
        and not is_training
        and mutates_data
        and not mutates_metadata
    )
    layout_after = StridedLayout.of(from_functional(f_arg)) if mutates_metadata else None
    if layout_after is not None and _grows_storage(layout_after, arg):
        raise NotImplementedError(_STORAGE_SWAP_MESSAGE)
    return InputInfo(
        is_tensor=True,
        requires_grad=bool(arg.requires_grad),
        requires_grad_after=bool(f_arg.requires_grad),
        mutates_data=mutates_data,
        mutates_metadata=mutates_metadata,
        mutations_under_no_grad=under_no_grad,
        mutations_hidden_from_autograd=hidden,
        mutation_kept_in_graph=keep,
        layout_after=layout_after,
        storage_nbytes_before=nbytes_before,
        storage_nbytes_after=nbytes_after,
    )


class _StorageChanges:
    """Records ``torch.ops.inductor.resize_storage_bytes_`` calls on inputs (FSDP frees and
    re-allocates parameters' storage with it; functionalization does not record them), and
    which inputs had their data changed before a ``set_()`` moved them to another storage."""

    def __init__(self, functional_args: list, nbytes_before: list):
        self.args = functional_args
        self.nbytes: dict[int, int] = {}  # input index -> its storage size after the last resize
        self.nbytes_before = nbytes_before
        self.changed_before_set: set[int] = set()

    @contextlib.contextmanager
    def watching(self, functional_mode):
        """See every op the functional mode handles. The hook is an attribute of the mode
        object rather than a mode of its own: higher-order ops (torch.cond) look their rules
        up by the type of the mode on top, which must stay FunctionalTensorMode."""
        handle = functional_mode.__torch_dispatch__

        def dispatch(mode, func, types, args=(), kwargs=None):
            self._see(func, args)
            return handle(func, types, args, kwargs)

        # bound to the mode object, as torch requires of __torch_dispatch__
        functional_mode.__torch_dispatch__ = MethodType(dispatch, functional_mode)
        try:
            yield self
        finally:
            del functional_mode.__torch_dispatch__

    def _see(self, func, args) -> None:
        if func is _RESIZE_STORAGE_BYTES:
            index = self._input_index(args[0])
            if index is not None:
                self.nbytes[index] = args[1]
        elif getattr(func, "overloadpacket", None) is torch.ops.aten.set_:
            index = self._input_index(args[0])
            if index is not None and has_data_mutation(args[0]):
                self.changed_before_set.add(index)

    def _input_index(self, tensor) -> Optional[int]:
        """The input ``tensor`` is, or whose storage it views."""
        index = next((i for i, a in enumerate(self.args) if a is tensor), None)
        if index is None and isinstance(tensor, torch.Tensor) and not is_subclass(tensor):
            index = next(
                (i for i, a in enumerate(self.args)
                 if isinstance(a, torch.Tensor) and not is_subclass(a) and _same_storage(a, tensor)),
                None,
            )
        return index

    def of(self, index: int, arg) -> tuple[Optional[int], Optional[int]]:
        """(bytes before, bytes after) if the call resized input ``index``'s storage, else
        (None, None). The storage must start or end empty, as in FSDP: the runtime then
        resizes the caller's storage before the graph runs (growing) or after it (freeing)."""
        if index not in self.nbytes:
            return None, None
        before, after = self.nbytes_before[index], self.nbytes[index]
        if before == after:
            return None, None
        if before != 0 and after != 0:
            raise NotImplementedError(
                f"aotforge: the function resizes the storage of input {index} from {before} to "
                f"{after} bytes (resize_storage_bytes_); only resizes from or to 0 bytes (FSDP's "
                "free and re-allocate) are supported. Resize outside the compiled function."
            )
        return int(before), int(after)


def _storage_nbytes(value) -> Optional[int]:
    if not isinstance(value, torch.Tensor) or is_subclass(value) or value.is_sparse or value.is_nested:
        return None
    return value.untyped_storage().nbytes()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except RuntimeError:  # a subclass without storage
        return False


_RESIZE_STORAGE_BYTES = getattr(getattr(torch.ops.inductor, "resize_storage_bytes_", None), "default", None)


def _swapped_input_info(index: int, f_arg, arg, changes: _StorageChanges, functional_args) -> InputInfo:
    """InputInfo of an input the function pointed at another tensor (``set_()``)."""
    if index in changes.changed_before_set:
        raise NotImplementedError(
            f"aotforge: input {index} is changed in place and then set_() to another tensor; the "
            "change to its old storage cannot be replayed. Do the set_() first, or change a "
            "clone of the input."
        )
    if has_data_mutation(f_arg) and not (mutations_under_no_grad(f_arg) or mutations_hidden_from_autograd(f_arg)):
        # PyTorch's AOTAutograd raises AssertionError here too, with these words.
        raise AssertionError(
            f"aotforge: input {index} received a set_() (a storage swap), but the input has other "
            "mutations that we cannot replay after it: an in-place change that autograd records. "
            "Do the set_() and the in-place changes under torch.no_grad(), or change a clone."
        )
    nbytes_before, nbytes_after = changes.of(index, arg)  # FSDP frees the old storage, then swaps
    value = from_functional(f_arg)
    layout = StridedLayout.of(value)
    owner = None
    for other_index, other in enumerate(functional_args):
        if other_index == index or not isinstance(other, torch.Tensor) or is_subclass(other):
            continue
        other_value = from_functional(other)
        if storage_ref(other_value) == storage_ref(value):
            owner = other_index
            # the offset within the other input's storage, relative to where that input starts
            layout = StridedLayout(layout.size, layout.stride, layout.storage_offset - StridedLayout.of(other_value).storage_offset)
            break
    return InputInfo(
        is_tensor=True,
        requires_grad=bool(arg.requires_grad),
        requires_grad_after=bool(f_arg.requires_grad),
        layout_after=layout,
        storage_swapped=True,
        swapped_to_input=owner,
        storage_nbytes_before=nbytes_before,
        storage_nbytes_after=nbytes_after,
    )


def _grows_storage(layout: StridedLayout, arg: torch.Tensor) -> bool:
    """True if the new layout reaches past the input's storage (resize_ to a larger size)."""
    if not layout.is_static or any(s == 0 for s in layout.size):
        return False
    last = layout.storage_offset + sum((n - 1) * st for n, st in zip(layout.size, layout.stride))
    nbytes = arg.untyped_storage().nbytes()
    return isinstance(nbytes, int) and (last + 1) * arg.element_size() > nbytes


def _output_info(outputs, functional_args, storages, changed_inputs=frozenset()) -> tuple[list[OutputInfo], list, list, dict]:
    """Classify each output; return the infos, the intermediate bases the graph must add, for
    each aliased output how to replay its views, and the custom-Function aliases of inputs."""
    infos: list[OutputInfo] = []
    bases: list[torch.Tensor] = []
    replays: list[Optional[ViewReplay]] = []
    custom: dict[int, int] = {}
    hidden = _hidden_multi_output_aliases(outputs, storages, changed_inputs)
    for position, out in enumerate(outputs):
        replays.append(None)
        if not isinstance(out, torch.Tensor):
            infos.append(OutputInfo(kind=OutputKind.NOT_ALIAS, is_tensor=False))
            continue
        requires_grad = bool(out.requires_grad)
        if _made_by_custom_function(out):
            # Its gradient is the Function's backward, not a view's: a regular graph output.
            input_index = storages.get(storage_ref(out))
            if input_index is not None:
                custom[position] = input_index
                replays[-1] = record_view_replay(out, functional_args[input_index])
            infos.append(OutputInfo(OutputKind.NOT_ALIAS, True, requires_grad))
            continue
        input_index = next((i for i, a in enumerate(functional_args) if a is out), None)
        if input_index is not None:
            infos.append(
                OutputInfo(OutputKind.IS_INPUT, True, requires_grad, base_index=input_index)
            )
            continue
        input_index = storages.get(storage_ref(out))
        if input_index is not None and position in hidden:
            # Returned from the compiled autograd.Function (its backward is the graph's), as
            # the real view of the caller's input that the runtime replays inside forward().
            custom[position] = input_index
            replays[-1] = record_view_replay(out, functional_args[input_index])
            infos.append(OutputInfo(OutputKind.NOT_ALIAS, True, requires_grad))
            continue
        if input_index is not None:
            replays[-1] = record_view_replay(out, functional_args[input_index])
            infos.append(
                OutputInfo(
                    OutputKind.ALIAS_OF_INPUT,
                    True,
                    requires_grad,
                    base_index=input_index,
                    layout=StridedLayout.of(out),
                    multi_output_view=_is_multi_output_view(out),
                )
            )
            continue
        base = out._base if out._is_view() else None
        if base is None:
            infos.append(OutputInfo(OutputKind.NOT_ALIAS, True, requires_grad))
            continue
        if position in hidden:
            # A graph output of the compiled Function; the one ordinary view among them (if
            # any) leaves the graph as a fresh tensor (hides_alias), so that autograd lets
            # the user change it in place, as eager does.
            multi = _is_multi_output_view(out)
            infos.append(OutputInfo(OutputKind.NOT_ALIAS, True, requires_grad, hides_alias=not multi,
                                    multi_output_view=multi, view_of_output=hidden[position] if multi else None))
            continue
        user_index = next((i for i, o in enumerate(outputs) if o is base), None)
        if user_index is not None:
            base_index, base_is_user_output = user_index, True
        else:
            base_index = next((i for i, b in enumerate(bases) if b is base), None)
            if base_index is None:
                bases.append(base)
                base_index = len(bases) - 1
            base_is_user_output = False
        replays[-1] = record_view_replay(out, base)
        infos.append(
            OutputInfo(
                OutputKind.ALIAS_OF_INTERMEDIATE,
                True,
                requires_grad,
                base_index=base_index,
                base_is_user_output=base_is_user_output,
                layout=StridedLayout.of(out),
                base_layout=StridedLayout.of(base),
                multi_output_view=_is_multi_output_view(out),
            )
        )
    return infos, bases, replays, custom


def _hidden_multi_output_aliases(outputs, storages, changed_inputs=frozenset()) -> dict[int, Optional[int]]:
    """Positions (with their ordinary sibling output, if any) of the differentiable outputs
    that alias each other through one multi-output view op (``unbind``, ``split``, ``chunk``)
    and that the compiled autograd.Function returns itself, as PyTorch's AOTAutograd does (its
    "multi-output view" rule), instead of regenerating them as views outside it: one backward
    node for all of them.

    Safe because autograd forbids in-place changes to such views that could alter another
    alias's history: an input's storage qualifies when every output on it is such a view; an
    intermediate's when at most one output on it is not (the base, or one other view).
    The Function's outputs stay views of the caller's input (replayed inside forward()) or of
    their ordinary sibling (OutputInfo.view_of_output), and multi-output views keep autograd's
    refusal of in-place changes."""
    groups: dict = {}
    for position, out in enumerate(outputs):
        if isinstance(out, torch.Tensor) and not is_subclass(out) and not _made_by_custom_function(out):
            groups.setdefault(storage_ref(out), []).append(position)
    hidden: dict[int, Optional[int]] = {}
    for ref, positions in groups.items():
        multi = [p for p in positions if _is_multi_output_view(outputs[p])]
        ordinary = [p for p in positions if p not in multi]
        if not multi or not all(outputs[p].requires_grad for p in positions):
            continue
        if ref in storages:  # aliases of an input (the input itself counts as ordinary)
            # (not of an input the call changes: its write-back after the Function would
            # invalidate views returned by it, where eager made them after the change)
            if not ordinary and storages[ref] not in changed_inputs:
                hidden.update(dict.fromkeys(positions))
        elif len(ordinary) <= 1:
            views = [p for p in positions if outputs[p]._is_view()]
            if all(outputs[p]._base.requires_grad for p in views):
                sibling = ordinary[0] if ordinary else None
                hidden.update((p, sibling) for p in views)
    return hidden


def _made_by_custom_function(tensor: torch.Tensor) -> bool:
    """True for the output of a user's autograd.Function (Python or C++), whose backward is
    the user's own code."""
    grad_fn = tensor.grad_fn
    return isinstance(grad_fn, torch.autograd.function.BackwardCFunction) or (
        type(grad_fn).__name__ == "CppFunction"
    )


def _is_multi_output_view(tensor: torch.Tensor) -> bool:
    return tensor._is_view() and _get_creation_meta(tensor) == CreationMeta.MULTI_OUTPUT_NODE
