"""Runtime wrappers: run the compiled graphs and replay every side effect eager would have had.

Per call, the work is only what this call needs: a compiled callable for the graph, then the
epilogue that (1) writes updated values back into mutated inputs and (2) regenerates outputs
that alias inputs or intermediates as real views. Everything else was decided at compile time.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch._C._autograd import CreationMeta, _set_creation_meta

from .boxing import call_compiled
from .subclasses import is_subclass
from .schemas import InputInfo, OutputKind, StridedLayout, ViewAndMutationMeta, symbol_bindings
from .trace import TRACE_LOCK


class Epilogue:
    """Turns the graph's outputs into the user's outputs, with eager's side effects."""

    def __init__(self, meta: ViewAndMutationMeta, fake_args: Sequence, *, custom_aliases_done: bool = False):
        self.meta = meta
        # Outputs a custom autograd.Function returned as views of inputs: replayed here
        # (inference), or already inside the training autograd.Function (custom_aliases_done).
        self.custom_aliases = [] if custom_aliases_done else custom_alias_slots(meta)
        self.fake_args = list(fake_args)
        self.mutated = [(i, meta.input_info[i]) for i in meta.mutated_input_indices]
        # Positions (among self.mutated) of plain data writes that record no autograd history
        # (BatchNorm's running statistics, counters): written back by one _foreach_copy_, not a
        # Python copy_ each (MobileNetV3's 102 buffers, timed alone on a busy CPU: 1.0 ms as
        # copy_ calls, 0.24 ms so; on a GPU it is meant to be one fused kernel, not measured).
        self.batched = [
            position for position, (_, info) in enumerate(self.mutated)
            if (info.mutations_hidden_from_autograd or info.mutations_under_no_grad)
            and not (info.storage_swapped or info.storage_freed or info.mutates_metadata)
        ]
        if len(self.batched) < 2:
            self.batched = []
        self.one_by_one = [
            (index, info, position) for position, (index, info) in enumerate(self.mutated)
            if position not in self.batched
        ]
        self.metadata_mutated = [
            (i, info) for i, info in enumerate(meta.input_info) if info.mutates_metadata
        ]
        self.num_fresh = len(meta.fresh_output_indices)
        self.only_fresh_outputs = all(o.kind is OutputKind.NOT_ALIAS for o in meta.output_info)
        layouts = [info.layout_after for _, info in self.metadata_mutated]
        layouts += [o.layout for o in meta.output_info if o.layout is not None]
        self.replays = getattr(meta, "view_replays", None) or [None] * len(meta.output_info)
        self.needs_bindings = needs_bindings(meta) or any(not layout.is_static for layout in layouts)
        # Storage changes (FSDP): inputs whose storage the call grows from 0 bytes (before the
        # graph runs), frees (after it), or swaps for another tensor's (set_()).
        self.grown = [
            (i, info.storage_nbytes_after) for i, info in enumerate(meta.input_info)
            if info.storage_nbytes_before == 0 and info.storage_nbytes_after
        ]
        self.freed = [i for i, info in enumerate(meta.input_info) if info.storage_freed and not info.storage_swapped]
        self.swapped_to_inputs = [
            (i, info) for i, info in enumerate(meta.input_info) if info.swapped_to_input is not None
        ]

    def prologue(self, args: Sequence) -> None:
        """Before the graph runs: give inputs the storage the call allocates for them."""
        for index, nbytes in self.grown:
            with torch.no_grad():
                args[index].untyped_storage().resize_(nbytes)

    def __call__(self, args: Sequence, graph_outputs: Sequence) -> list:
        bindings = symbol_bindings(self.fake_args, args) if self.needs_bindings else {}
        num_mutated = len(self.mutated)
        if self.batched:
            _write_back_together(
                [args[self.mutated[p][0]] for p in self.batched], [graph_outputs[p] for p in self.batched]
            )
        for index, info, position in self.one_by_one:
            updated = graph_outputs[position]
            if info.storage_swapped:  # set_() to a tensor made inside: the input takes it
                _swap_storage(args[index], info, updated)
                continue
            if info.storage_freed:
                continue  # the call frees its storage: there is nothing to write to
            if info.mutates_metadata:
                args[index].as_strided_(*info.layout_after.evaluate(bindings))
            _write_back(args[index], updated, info)
        for index, info in self.swapped_to_inputs:  # after the other inputs' write-backs
            owner = args[info.swapped_to_input]
            size, stride, offset = info.layout_after.evaluate(bindings)
            _swap_storage(args[index], info, owner, (owner.storage_offset() + offset, size, stride))
        for index in self.freed:
            with torch.no_grad():
                args[index].untyped_storage().resize_(0)
        for index, info in self.metadata_mutated:
            if not info.mutation_returned_by_graph:
                # Under grad mode autograd records the in-place view, as it did for eager's t_().
                args[index].as_strided_(*info.layout_after.evaluate(bindings))
        fresh = graph_outputs[num_mutated : num_mutated + self.num_fresh]
        if self.custom_aliases:
            fresh = list(fresh)
            for slot, input_index, replay in self.custom_aliases:
                fresh[slot] = replay.apply(args[input_index], bindings)
        if self.only_fresh_outputs:
            return list(fresh)
        bases = graph_outputs[num_mutated + self.num_fresh :]
        outputs: list = [None] * len(self.meta.output_info)
        fresh_iter = iter(fresh)
        for position, info in enumerate(self.meta.output_info):
            if info.kind is OutputKind.NOT_ALIAS:
                outputs[position] = next(fresh_iter)
        for position, info in enumerate(self.meta.output_info):
            if info.kind is OutputKind.IS_INPUT:
                outputs[position] = args[info.base_index]
            elif info.kind is OutputKind.ALIAS_OF_INPUT:
                outputs[position] = self._regenerate(args[info.base_index], position, bindings)
            elif info.kind is OutputKind.ALIAS_OF_INTERMEDIATE:
                base = outputs[info.base_index] if info.base_is_user_output else bases[info.base_index]
                _check_base_layout(base, info.base_layout, bindings)
                outputs[position] = self._regenerate(base, position, bindings)
        return outputs

    def _regenerate(self, base: torch.Tensor, position: int, bindings: dict) -> torch.Tensor:
        replay = self.replays[position]
        if replay is None:  # metadata made without view records (export's)
            return _regenerate_view(base, self.meta.output_info[position], bindings)
        return replay.apply(base, bindings)


def custom_alias_slots(meta) -> list:
    """(position among the fresh outputs, input index, replay) per custom-Function alias."""
    aliases = getattr(meta, "custom_function_aliases", None) or {}
    fresh = meta.fresh_output_indices
    return [(fresh.index(output), index, meta.view_replays[output]) for output, index in aliases.items()]


def needs_bindings(meta) -> bool:
    """Whether some view replay has sizes that depend on this call's input sizes."""
    return any(
        replay is not None and replay.steps is not None and not all(s.is_static for s in replay.steps)
        for replay in getattr(meta, "view_replays", None) or ()
    )


def _swap_storage(original: torch.Tensor, info: InputInfo, source: torch.Tensor, layout=None) -> None:
    """Replay ``original.set_(...)`` (under no_grad, as eager's set_ on an input must run):
    free the old storage first if the call did (FSDP), then point at ``source``'s storage."""
    with torch.no_grad():
        if info.storage_freed:
            original.untyped_storage().resize_(0)
        if layout is None:
            original.set_(source)
        else:
            original.set_(source.untyped_storage(), *layout)


def _write_back(original: torch.Tensor, updated: torch.Tensor, info: InputInfo) -> None:
    """Copy an updated value into the input the user passed, as eager's mutation would."""
    if _same_memory(original, updated):
        return  # the graph kept the mutation (disable_functionalization): already written
    if info.mutations_hidden_from_autograd or info.mutations_under_no_grad:
        original.detach().copy_(updated)  # bumps the version, records no autograd history
    else:
        original.copy_(updated)


def _write_back_together(originals: list, updated: list) -> None:
    """_write_back for mutations that record no autograd history, in one dispatcher call
    where the tensors are plain (a subclass, or the graph writing in place, goes one by one)."""
    plain_originals, plain_updated = [], []
    for original, value in zip(originals, updated):
        if is_subclass(original) or is_subclass(value) or original.data_ptr() == value.data_ptr():
            _write_back(original, value, _HIDDEN)
        else:
            plain_originals.append(original)
            plain_updated.append(value)
    if plain_originals:
        with torch.no_grad():  # bumps each version, records no autograd history
            torch._foreach_copy_(plain_originals, plain_updated)


_HIDDEN = InputInfo(is_tensor=True, mutates_data=True, mutations_hidden_from_autograd=True)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if is_subclass(a) or is_subclass(b):
        return a is b  # a wrapper subclass has no data pointer of its own
    return (
        a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
        and a.shape == b.shape
        and a.data_ptr() != 0
    )


def _regenerate_view(base: torch.Tensor, info, bindings: dict) -> torch.Tensor:
    size, stride, offset = info.layout.evaluate(bindings)
    if (
        list(base.size()) == size
        and list(base.stride()) == stride
        and base.storage_offset() == offset
    ):
        view = base.view(base.shape)  # same layout: a plain alias keeps view autograd simple
    else:
        view = base.as_strided(size, stride, offset)
    if view.requires_grad and not info.requires_grad:
        view = view.detach()
    if info.multi_output_view and view.requires_grad:
        _set_creation_meta(view, CreationMeta.MULTI_OUTPUT_NODE)
    return view


def _check_base_layout(base: torch.Tensor, expected: StridedLayout, bindings: dict) -> None:
    size, stride, _ = expected.evaluate(bindings)
    # The stride of a dimension of size 1 (or of an empty tensor) never moves to another
    # element: compilers choose it freely, and views of the base address the same memory.
    same_layout = list(base.size()) == size and (
        base.numel() == 0
        or all(n == 1 or a == b for n, a, b in zip(size, base.stride(), stride))
    )
    if not same_layout:
        raise RuntimeError(
            "aotforge: the compiled graph returned the base of an aliased output with layout "
            f"{tuple(base.size())}/{tuple(base.stride())}, but eager's layout is "
            f"{tuple(size)}/{tuple(stride)}; the compiler must keep graph outputs' strides"
        )


def make_inference_runtime(compiled: Callable, meta: ViewAndMutationMeta, fake_args) -> Callable:
    """``run(args) -> user outputs`` for a forward-only graph."""
    epilogue = Epilogue(meta, fake_args)
    pick_outputs = meta.runtime_outputs_picker()

    def run(args: list) -> list:
        # The graph's outputs carry no autograd history (eager computed them under no_grad,
        # or nothing needed a gradient), even when the call runs in grad mode.
        epilogue.prologue(args)
        with torch.no_grad():
            graph_outputs = pick_outputs(call_compiled(compiled, list(args)))
        return epilogue(args, graph_outputs)

    run.runtime_parameters = {}  # type: ignore[attr-defined]  (aot/cache.py: what rebuilds it)
    return run


def _example_inputs(gm: Optional[fx.GraphModule]) -> list:
    if gm is None:  # a runtime rebuilt by the AOT cache: its backward is compiled already
        return []
    return [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]


def make_training_runtime(
    compiled_forward: Callable,
    backward_module: Optional[fx.GraphModule],
    bw_compiler: Callable,
    meta: ViewAndMutationMeta,
    fake_args: Sequence,
    num_saved_tensors: int,
    num_saved_symints: int,
    clone_saved: Sequence[int] = (),
    mutated_in_backward: Sequence[int] = (),
) -> Callable:
    """``run(args) -> user outputs`` through a custom autograd.Function whose backward
    compiles the backward graph the first time it runs.

    ``mutated_in_backward``: inputs that the backward changes in place (a custom Function's
    backward mutating a tensor it saved); the backward graph returns their new values after
    the gradients, and they are copied into the caller's tensors when the backward runs, as
    in eager.
    """
    epilogue = Epilogue(meta, fake_args, custom_aliases_done=True)
    # Outputs of custom autograd.Functions that alias inputs: returning the input's view from
    # forward() makes autograd give it this Function's backward, like the user's Function did.
    num_mutated = len(meta.mutated_input_indices)
    custom_aliases = [(num_mutated + slot, index, replay) for slot, index, replay in custom_alias_slots(meta)]
    custom_needs_bindings = needs_bindings(meta)
    # the graph's values of regenerated (aliased) outputs are dropped at once (runtime_outputs_picker)
    pick_outputs = meta.runtime_outputs_picker()
    differentiable = pick_outputs(meta.graph_output_requires_grad())
    num_runtime_outputs = len(differentiable)
    non_differentiable_indices = [i for i, d in enumerate(differentiable) if not d]
    tangent_indices = [i for i, d in enumerate(differentiable) if d]
    compiled_backward: list[Optional[Callable]] = [None]
    # The backward graph returns the new values of inputs (int entries) and then of tangents
    # (("tangent", j) entries) that a custom Function's backward mutated.
    mutated_in_backward = list(mutated_in_backward)
    mutated_inputs = [i for i in mutated_in_backward if isinstance(i, int)]
    mutated_tangents = [tangent_indices[j] for kind, j in (m for m in mutated_in_backward if not isinstance(m, int))]

    def run_backward(ctx, grad_outputs) -> list:
        if compiled_backward[0] is None:
            with TRACE_LOCK:
                if compiled_backward[0] is None:
                    compiled_backward[0] = bw_compiler(backward_module, _example_inputs(backward_module))
        tangents = [_as_traced_tangent(grad_outputs[i]) for i in tangent_indices]
        args = [*ctx.symints, *ctx.saved_tensors, *tangents]
        # Drop ctx's references (unless retain_graph), so that a boxed backward can free
        # each saved tensor after its last use instead of holding all of them to the end.
        ctx.maybe_clear_saved_tensors()
        return call_compiled(compiled_backward[0], args)

    @torch.autograd.function.once_differentiable
    def backward_once(ctx, *grad_outputs):
        results = run_backward(ctx, grad_outputs)
        if not mutated_in_backward:
            return tuple(results)
        num_grads = len(results) - len(mutated_in_backward)
        targets = [*ctx.mutated_in_backward, *(grad_outputs[i] for i in mutated_tangents)]
        for target, value in zip(targets, results[num_grads:]):
            target.copy_(value)  # under no_grad (once_differentiable), as eager's backward ran
        return tuple(results[:num_grads])

    class CompiledFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            results = pick_outputs(call_compiled(compiled_forward, list(args)))
            outputs = results[:num_runtime_outputs]
            if custom_aliases:
                bindings = symbol_bindings(fake_args, args) if custom_needs_bindings else {}
                for slot, index, replay in custom_aliases:
                    outputs[slot] = replay.apply(args[index], bindings, patch_requires_grad=False)
            saved = results[num_runtime_outputs : num_runtime_outputs + num_saved_tensors]
            for position in clone_saved:
                saved[position] = saved[position].clone()
            ctx.save_for_backward(*saved)
            ctx.symints = results[num_runtime_outputs + num_saved_tensors :]
            if mutated_in_backward:
                ctx.mutated_in_backward = [args[i] for i in mutated_inputs]
            ctx.mark_non_differentiable(
                *(outputs[i] for i in non_differentiable_indices if isinstance(outputs[i], torch.Tensor))
            )
            return tuple(outputs)

        @staticmethod
        @torch._disable_dynamo
        def backward(ctx, *grad_outputs):
            # (not traced by Dynamo: a torch.compile'd function that calls loss.backward() runs
            # this under Dynamo's frame hook, which would trace and recompile our own wrappers)
            if mutated_in_backward and torch.is_grad_enabled():
                _check_backward_mutations_without_create_graph(ctx.mutated_in_backward)
            return backward_once(ctx, *grad_outputs)

    def run(args: list) -> list:
        epilogue.prologue(args)
        graph_outputs = CompiledFunction.apply(*args)
        return epilogue(args, list(graph_outputs))

    run.compiled_function = CompiledFunction  # type: ignore[attr-defined]
    # what aot/cache.py needs to rebuild this runtime around the same compiled graphs
    run.runtime_parameters = dict(num_saved_tensors=num_saved_tensors,  # type: ignore[attr-defined]
                                  num_saved_symints=num_saved_symints, clone_saved=list(clone_saved),
                                  mutated_in_backward=list(mutated_in_backward))
    return run


def _check_backward_mutations_without_create_graph(targets: Sequence[torch.Tensor]) -> None:
    """Under ``backward(create_graph=True)`` eager runs a custom Function's backward in grad
    mode, where changing a leaf that requires grad in place raises. The compiled backward
    cannot record such a mutation either: raise for every input that requires grad."""
    for target in targets:
        if target.requires_grad:
            if target.is_leaf:
                raise RuntimeError(
                    "a leaf Variable that requires grad is being used in an in-place operation. "
                    "(aotforge: a custom autograd.Function's backward mutates this input, and "
                    "backward ran with create_graph=True, as eager would refuse too.)"
                )
            raise RuntimeError(
                # PyTorch's words first (callers match on them), then ours
                "aot_autograd does not support input mutations with requires_grad in backward "
                "for create_graph=True. aotforge: a custom autograd.Function's backward mutates "
                "an input that requires grad, and backward ran with create_graph=True; the "
                "compiled backward cannot record that mutation for double backward. Call "
                "backward without create_graph, or mutate a tensor that does not require grad."
            )


def check_outputs_once(compiled: Callable, gm: fx.GraphModule, compiler_name: str) -> Callable:
    """``compiled``, checked on its first call against what ``gm`` returns: the number of
    outputs and, for tensors, dtype, device and (static) shape. A compiler that returns the
    wrong outputs would otherwise give wrong answers or fail far from the cause."""
    if not callable(compiled):
        raise TypeError(
            f"aotforge: {compiler_name} returned {type(compiled).__name__} ({compiled!r:.80}), not a "
            "callable. A compiler takes (fx.GraphModule, example inputs) and returns a callable that "
            "runs the graph (for example the GraphModule itself, or make_boxed_func(gm.forward))."
        )
    (output,) = gm.graph.find_nodes(op="output")
    expected = [node.meta.get("val") if isinstance(node, fx.Node) else node for node in output.args[0]]
    # Outputs that ATen itself may return as None although tracing promised a tensor.
    may_be_none = {index for index, node in enumerate(output.args[0]) if _may_return_none(node)}
    float32_statistics = {index for index, node in enumerate(output.args[0])
                          if _output_of(node, _FLOAT32_STATISTICS_OF)}
    checked = [False]

    def checked_call(args: list) -> list:
        outputs = call_compiled(compiled, args)
        if not checked[0]:
            _check_outputs(outputs, expected, compiler_name, may_be_none, float32_statistics)
            checked[0] = True
        return outputs

    checked_call._boxed_call = True  # type: ignore[attr-defined]
    checked_call.compiled = compiled  # type: ignore[attr-defined]  (for introspection)
    return checked_call


# Attention ops return their philox seed and offset (and, for cuDNN, the sequence outputs)
# as None when there is no dropout, where their fake implementations give tensors: every
# output but the attention itself (index 0) may be None. The CUDA kernels (memory-efficient,
# flash, cuDNN) return their seed and offset as 0-d int64 tensors on the CPU outside a CUDA
# graph capture and on the GPU inside one, where the fake implementations always say the GPU:
# such an output may be on either device. The backward's ATen call reads it wherever it is.
_NONE_OUTPUTS_OF = {
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_efficient_attention_forward", "_flash_attention_forward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable",
}


# Ops whose CPU kernel returns float32 statistics (outputs after the first) for a bfloat16 or
# float16 input with float32 weights, as under autocast, where their fake implementation says
# the input's dtype. Eager runs the same kernel, so such an output is eager's, not a compiler's
# mistake.
_FLOAT32_STATISTICS_OF = frozenset({"native_layer_norm"})


def _may_return_none(node) -> bool:
    return _output_of(node, _NONE_OUTPUTS_OF)


def _output_of(node, op_names: frozenset) -> bool:
    """Whether ``node`` takes an output after the first of one of ``op_names``."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or len(node.args) != 2:
        return False
    source, index = node.args
    packet = getattr(getattr(source, "target", None), "overloadpacket", None)
    return index != 0 and getattr(packet, "__name__", None) in op_names


def _check_outputs(outputs: list, expected: list, compiler_name: str, may_be_none: set,
                   float32_statistics: set = frozenset()) -> None:
    def fail(what: str) -> None:
        raise RuntimeError(
            f"aotforge: the callable returned by {compiler_name} {what}. A compiler must return "
            "a callable whose outputs match the graph's outputs (same number, order, shapes, "
            "dtypes and devices)."
        )

    if len(outputs) != len(expected):
        fail(f"returned {len(outputs)} outputs, but the graph has {len(expected)}")
    for index, (actual, value) in enumerate(zip(outputs, expected)):
        if not isinstance(value, torch.Tensor) or (actual is None and index in may_be_none):
            continue
        if actual is None:
            fail(f"returned None as output {index}, where the graph returns a {tuple(value.shape)} "
                 f"{value.dtype} tensor")
        if not isinstance(actual, torch.Tensor):
            fail(f"returned {type(actual).__name__} as output {index}, where the graph returns a tensor")
        static_shape = [s if isinstance(s, int) else None for s in value.shape]
        shape_ok = actual.dim() == len(static_shape) and all(
            s is None or s == a for s, a in zip(static_shape, actual.shape)
        )
        dtype_ok = actual.dtype == value.dtype or (index in float32_statistics and actual.dtype == torch.float32)
        device_ok = actual.device.type == value.device.type or (
            index in may_be_none and actual.dim() == 0 and actual.dtype == torch.int64)
        if not shape_ok or not dtype_ok or not device_ok:
            fail(
                f"returned output {index} as {tuple(actual.shape)} {actual.dtype} on {actual.device}, "
                f"but the graph returns {tuple(value.shape)} {value.dtype} on {value.device}"
            )


def _as_traced_tangent(grad: torch.Tensor) -> torch.Tensor:
    """Tangents were traced contiguous; the graph may rely on that layout."""
    if grad is not None and not grad.is_contiguous():
        return grad.contiguous()
    return grad
