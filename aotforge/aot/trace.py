"""Trace the user's function into purely functional ATen graphs with make_fx.

Two graphs can be traced from one function and its metadata:

* the forward graph (inference): ``primals -> (*updated inputs, *user outputs, *bases)``;
* the joint graph (training): ``(primals, tangents) -> (*forward outputs, *gradients)``,
  where the gradients come from ``torch.autograd.grad`` run inside the trace.

Mutations never appear in these graphs, except the ``copy_`` into an input that an
inference graph keeps when the caller asked for ``keep_inference_input_mutations``.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from . import effects, rng
from .eager_kernels import eager_aliasing_kernels
from .functional import (
    FunctionalTensor,
    FunctionalTensorMode,
    below_functionalization,
    from_functional,
    has_data_mutation,
    to_functional,
)
from .schemas import OutputKind, ViewAndMutationMeta
from .subclasses import from_functional as subclass_from_functional, inner_leaves, is_subclass
from . import source_lines
from .source_lines import copy_forward_source_to_backward, recording_source_lines
from .unfunctionalized import BACKWARD, PHASE_KEY

# make_fx and FX's symbolic tracer keep global state (the patcher, the current node meta):
# two threads tracing at once corrupt it for every later trace, torch.compile's included.
# Every compile in this package holds this lock (re-entrant: a compile may trace inside).
TRACE_LOCK = threading.RLock()


def graph_outputs_fn(flat_fn: Callable, meta: ViewAndMutationMeta) -> Callable:
    """``flat_fn`` rewritten to return what the functional graph returns::

        (*updated values of mutated inputs, *user outputs, *intermediate bases)

    Outputs that alias inputs or intermediates are returned too (PyTorch's layout), though the
    runtime regenerates them from the real inputs and bases. In training, inputs that are
    mutated and require grad are cloned first, so that
    ``autograd.grad`` differentiates with respect to their values before the mutation.
    """
    clone_before_call = [
        meta.is_training and info.requires_grad and (info.mutates_data or info.mutates_metadata)
        for info in meta.input_info
    ]
    base_outputs = [
        (index, info.base_index)
        for index, info in enumerate(meta.output_info)
        if info.kind is OutputKind.ALIAS_OF_INTERMEDIATE and not info.base_is_user_output
    ]

    hides_alias = [index for index, info in enumerate(meta.output_info) if info.hides_alias]

    def fn(*args):
        args = [a.clone() if clone else a for a, clone in zip(args, clone_before_call)]
        outputs = list(flat_fn(*args))
        for index in hides_alias:
            outputs[index] = torch.ops.aten._unsafe_view(outputs[index], outputs[index].shape)
        bases = [None] * meta.num_intermediate_bases
        for output_index, base_index in base_outputs:
            bases[base_index] = outputs[output_index]._base
        return [
            *(args[i] for i in meta.mutated_input_indices),
            *outputs,
            *bases,
        ]

    return fn


def joint_fn(graph_fn: Callable, meta: ViewAndMutationMeta, mutated_in_backward: list) -> Callable:
    """``(primals, tangents) -> (*forward outputs, *one gradient per primal or None,
    *values of inputs the backward mutated)``.

    A custom autograd.Function's backward may mutate a tensor it saved (an input), or the
    gradient it received (``grad.mul_(2)``): eager applies that when the backward runs. The
    joint returns each such tensor's value after the backward as an extra backward output,
    and fills ``mutated_in_backward`` with the input indices (ints), then ``("tangent", j)``
    for the tangents, so that the runtime copies them into the caller's tensors at backward
    time.
    """
    differentiable = meta.graph_output_requires_grad()
    num_mutated = len(meta.mutated_input_indices)
    # Inputs that are mutated and require grad reach the forward as clones (graph_outputs_fn),
    # returned first among the outputs: the backward mutates the clone, not the primal.
    clone_position = {index: position for position, index in enumerate(meta.mutated_input_indices)
                      if meta.input_info[index].requires_grad}

    def joint(primals: list, tangents: list):
        outputs = graph_fn(*primals)
        # The forward's values of mutated inputs, before the backward changes them again.
        forward_outputs = [_current_value(o) if i < num_mutated else o for i, o in enumerate(outputs)]
        # where each input's value lives while the backward runs
        holders = [outputs[clone_position[i]] if i in clone_position else p for i, p in enumerate(primals)]
        before_backward = [_state(h) for h in holders]
        effects.end_phase("forward")  # the backward's effects get a chain of their own
        grad_outputs = [o for o, d in zip(outputs, differentiable) if d]
        wrt = [p for p in primals if isinstance(p, torch.Tensor) and p.requires_grad]
        grads = []
        if wrt and grad_outputs:
            with _tagged_as_backward():
                grads = list(source_lines.grad(grad_outputs, wrt, tangents))
        grads_per_primal = [
            grads.pop(0) if isinstance(p, torch.Tensor) and p.requires_grad and grads else None
            for p in primals
        ]
        updated = []
        for index, (holder, before) in enumerate(zip(holders, before_backward)):
            after = _state(holder)
            if after is before:
                continue
            if is_subclass(holder):
                if all(a is b for a, b in zip(after, before)):
                    continue
                # The subclass itself (over functional inner tensors) is the output: its inner
                # tensors' values at the end of the trace are the ones after the backward.
                mutated_in_backward.append(index)
                updated.append(holder)
                continue
            if (after.shape, after.stride(), after.storage_offset()) != (before.shape, before.stride(), before.storage_offset()):
                raise NotImplementedError(
                    "aotforge: a backward (of a custom autograd.Function) changes the shape or "
                    "strides of an input in place (t_(), resize_(), ...); that is not supported. "
                    "Change a copy of it instead."
                )
            mutated_in_backward.append(index)
            updated.append(after)
        for index, tangent in enumerate(tangents):
            if isinstance(tangent, FunctionalTensor) and has_data_mutation(tangent):
                mutated_in_backward.append(("tangent", index))
                updated.append(_current_value(tangent))
        return (*forward_outputs, *grads_per_primal, *updated)

    return joint


@contextlib.contextmanager
def _tagged_as_backward():
    """Nodes traced inside get ``meta["partitioner_tag"] = "is_backward"`` (make_fx copies the
    current node meta): the split of a graph traced without functionalization reads it."""
    meta = fx_traceback.get_current_meta() if fx_traceback.has_preserved_node_meta() else None
    if meta is None:
        yield
        return
    previous = meta.get(PHASE_KEY)
    meta[PHASE_KEY] = BACKWARD
    try:
        yield
    finally:
        if previous is None:
            meta.pop(PHASE_KEY, None)
        else:
            meta[PHASE_KEY] = previous


def _current_value(value):
    """The value a FunctionalTensor holds now (a traced plain tensor, which later mutations of
    the FunctionalTensor do not change), for a tensor subclass over FunctionalTensors the
    subclass over their values now; other values as they are."""
    if isinstance(value, FunctionalTensor):
        return from_functional(value)
    if is_subclass(value) and any(isinstance(leaf, FunctionalTensor) for leaf in inner_leaves(value)):
        return subclass_from_functional(value)
    return value


def _state(value):
    """``_current_value``, and for a tensor subclass the tuple of its inner tensors' values,
    so that a change of an inner tensor shows."""
    if is_subclass(value):
        return tuple(_current_value(leaf) for leaf in inner_leaves(value))
    return _current_value(value)


def make_tangents(graph_output_fakes: Sequence, meta: ViewAndMutationMeta) -> list:
    """Fake contiguous tangents, one per differentiable graph output."""
    return [
        torch.empty_like(out, memory_format=torch.contiguous_format)
        for out, needed in zip(graph_output_fakes, meta.graph_output_requires_grad())
        if needed
    ]


def _functionalized(fn: Callable, kept_mutations: Sequence[int], arity: int, functional_mode) -> Callable:
    """Run ``fn`` on functional wrappers of its (pytree) arguments and unwrap the results.

    ``kept_mutations`` lists flat argument indices whose final value is written back with a
    ``copy_`` that stays in the graph (keep_inference_input_mutations); each ``copy_`` carries
    the source line of the op that mutated the input.
    """

    def functional(args):
        with below_functionalization():
            functional_args = pytree.tree_map(to_functional, args)
            flat_functional = pytree.tree_leaves(functional_args)
            kept = {index: flat_functional[index] for index in kept_mutations}
            with source_lines.mutation_source_lines(functional_mode, kept) as mutation_lines:
                outputs = fn(*functional_args)
            effects.end_phase("forward" if arity == 1 else "backward")
        results = pytree.tree_map(from_functional, outputs)
        flat_args = pytree.tree_leaves(args)
        for index in kept_mutations:
            with source_lines.stack_trace_of_next_nodes(mutation_lines.get(index)):
                flat_args[index].copy_(from_functional(flat_functional[index]))
        return results

    # make_fx names placeholders after the traced function's parameters: primals_1, tangents_1.
    def forward(primals):
        return functional((primals,))

    def joint(primals, tangents):
        return functional((primals, tangents))

    return forward if arity == 1 else joint


def _unfunctionalized(fn: Callable, arity: int) -> Callable:
    """``fn`` with the (primals) / (primals, tangents) signature, traced as it is: in-place
    ops stay in the graph (disable_functionalization)."""

    def forward(primals):
        return fn(primals)

    def joint(primals, tangents):
        return fn(primals, tangents)

    return forward if arity == 1 else joint


def trace(
    fn: Callable, args: Sequence, *, decompositions: dict, fake_mode, kept_mutations=(), functionalize: bool = True
) -> fx.GraphModule:
    """make_fx over functionalization (unless ``functionalize`` is False), on fake arguments."""
    functional_mode = (
        FunctionalTensorMode(_allow_token_discovery=True) if functionalize else contextlib.nullcontext()
    )
    traced_fn = (_functionalized(fn, kept_mutations, len(args), functional_mode) if functionalize
                 else _unfunctionalized(fn, len(args)))
    with TRACE_LOCK, recording_source_lines(), fake_mode, enable_python_dispatcher(), eager_aliasing_kernels(), \
            functional_mode:
        gm = make_fx(
            traced_fn,
            decomposition_table=rng.trace_decompositions(decompositions),
            record_module_stack=True,
        )(*args)
    # Compilers take flat placeholders and return a flat tuple: drop make_fx's pytree codegen.
    gm.graph._codegen = fx.graph.CodeGen()
    for stale in ("_in_spec", "_out_spec"):
        gm.__dict__.pop(stale, None)
    (output,) = gm.graph.find_nodes(op="output")
    output.args = (tuple(pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None)),)
    effects.finish_trace(gm)
    gm.graph.eliminate_dead_code()
    copy_forward_source_to_backward(gm)
    gm.recompile()
    return gm


def trace_forward(
    graph_fn: Callable, fake_args: Sequence, meta: ViewAndMutationMeta, *, decompositions, fake_mode,
    functionalize: bool = True,
) -> fx.GraphModule:
    kept = [i for i, info in enumerate(meta.input_info) if info.mutation_kept_in_graph]

    def forward(primals):
        return graph_fn(*primals)

    return trace(
        forward, [list(fake_args)], decompositions=decompositions, fake_mode=fake_mode, kept_mutations=kept,
        functionalize=functionalize,
    )


def trace_joint(
    graph_fn: Callable,
    fake_args: Sequence,
    tangents: Sequence,
    meta: ViewAndMutationMeta,
    *,
    decompositions,
    fake_mode,
    functionalize: bool = True,
) -> tuple[fx.GraphModule, list[int]]:
    """The joint graph, and the indices of the inputs its backward mutates (see joint_fn)."""
    mutated_in_backward: list[int] = []
    gm = trace(
        joint_fn(graph_fn, meta, mutated_in_backward),
        [list(fake_args), list(tangents)],
        decompositions=decompositions,
        fake_mode=fake_mode,
        functionalize=functionalize,
    )
    return gm, mutated_in_backward
