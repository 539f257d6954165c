"""Export: the functional graph itself, not a callable, plus a signature saying what each of
its inputs and outputs is.

``aot_export_module(mod, args, trace_joint=...)`` lifts parameters and buffers into graph
inputs and returns one graph::

    inputs:  (*parameters, *buffers, *user_inputs)                   pytree-flattened
    outputs: (*updated_inputs, *user_outputs)                        trace_joint=False
             (*updated_inputs, *user_outputs, *parameter_gradients)  trace_joint=True

Side effects become data: a buffer updated in place (BatchNorm's running statistics) is an
extra output, and ``GraphSignature.buffers_to_mutate`` names the buffer the caller must write
it back to. For a BatchNorm model (``bn.running_mean`` updated in forward)::

    def forward(self, primals_1, ..., primals_5, primals_8):
        ...
        _native_batch_norm_legit_functional = aten._native_batch_norm_legit_functional(...)
        getitem_3 = _native_batch_norm_legit_functional[3]  # the new running_mean
        ...
        return (getitem_3, getitem_4, add, sum_1, detach, t_3, view, getitem_6, getitem_7)

    buffers_to_mutate = {'getitem_3': 'bn.running_mean', ...}
    backward_signature.gradients_to_parameters = {'t_3': 'l.weight', ...}

``aot_export_joint_simple(func, args, trace_joint=...)`` is the convention-preserving variant
for flat functions of tensors: the inference graph has ``func``'s own signature, and the joint
graph is the one ``aot_function`` would partition.

Both are built on the AOT core's pieces (metadata collection, functional tracing); only the
calling convention of the joint differs: an export joint differentiates one scalar loss with
an implicit gradient of ones, so it has no tangent inputs.

Companions: ``export_guards`` asserts in the graph what the trace assumed (specialized
non-tensor inputs; size conditions under ``dynamic_shapes=True``); ``exported`` calls a graph
like its module (``run_exported``) and saves / loads it with its node names.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

from .. import debug
from ..torch_versions import new_fake_mode
from .compile import fake_inputs
from .export_errors import ExportError
from .export_guards import guard_constant_inputs, guard_dynamic_shapes
from .export_pre_dispatch import trace_pre_dispatch
from .export_checks import check_module_inputs, check_simple_inputs
from .metadata import collect_metadata
from .schemas import OutputKind, ViewAndMutationMeta
from .trace import graph_outputs_fn, make_tangents, trace, trace_forward
from .trace import trace_joint as trace_joint_graph

__all__ = [
    "BackwardSignature",
    "ExportError",
    "GraphSignature",
    "aot_export_joint_simple",
    "aot_export_module",
]


@dataclasses.dataclass(frozen=True)
class BackwardSignature:
    """The backward part of an exported joint graph. Names are graph node names."""

    gradients_to_parameters: dict[str, str]  # gradient output -> parameter FQN
    gradients_to_user_inputs: dict[str, str]  # gradient output -> user input placeholder
    loss_output: str  # the graph output that is the loss


@dataclasses.dataclass(frozen=True)
class GraphSignature:
    """What each input and output of an exported graph is.

    Inputs and outputs are named by their FX node names (``primals_3``, ``getitem_3``);
    parameters and buffers by their fully qualified names in the module (``bn.running_mean``).
    ``in_spec`` unflattens the graph's inputs to ``((*parameters, *buffers, *args), kwargs)``;
    ``out_spec`` unflattens its user outputs to what the module returned.
    """

    parameters: list[str]
    buffers: list[str]
    user_inputs: list[str]
    user_outputs: list[str]
    inputs_to_parameters: dict[str, str]
    inputs_to_buffers: dict[str, str]
    buffers_to_mutate: dict[str, str]  # graph output -> buffer FQN it updates
    parameters_to_mutate: dict[str, str]  # only in inference exports (no_grad updates)
    user_inputs_to_mutate: dict[str, str]  # graph output -> user input placeholder it updates
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    backward_signature: Optional[BackwardSignature] = None

    def describe(self) -> str:
        """A readable, line-per-fact rendering (used by ``python -m aotforge explain``)."""
        backward = self.backward_signature
        names = [
            *self.inputs_to_parameters, *self.inputs_to_buffers, *self.user_inputs,
            *self.user_outputs, *self.buffers_to_mutate, *self.parameters_to_mutate,
            *self.user_inputs_to_mutate,
            *(backward.gradients_to_parameters if backward else ()),
            *(backward.gradients_to_user_inputs if backward else ()),
        ]
        width = max([16, *map(len, names)])
        lines = ["graph inputs:"]
        for name, fqn in self.inputs_to_parameters.items():
            lines.append(f"  {name:<{width}} parameter {fqn}")
        for name, fqn in self.inputs_to_buffers.items():
            lines.append(f"  {name:<{width}} buffer    {fqn}")
        for name, path in zip(self.user_inputs, self._user_input_paths()):
            lines.append(f"  {name:<{width}} user input {path}")
        lines.append("graph outputs:")
        mutations = {
            **{k: f"new value of buffer {v}" for k, v in self.buffers_to_mutate.items()},
            **{k: f"new value of parameter {v}" for k, v in self.parameters_to_mutate.items()},
            **{k: f"new value of user input {v}" for k, v in self.user_inputs_to_mutate.items()},
        }
        for name, what in mutations.items():
            lines.append(f"  {name:<{width}} {what}")
        output_paths = _leaf_paths(self.out_spec, None)
        for index, (name, path) in enumerate(zip(self.user_outputs, output_paths)):
            loss = " (the loss)" if backward is not None and backward.loss_output == name else ""
            lines.append(f"  {name:<{width}} user {_output_label(index, path)}{loss}")
        if backward is not None:
            for name, fqn in backward.gradients_to_parameters.items():
                lines.append(f"  {name:<{width}} gradient of parameter {fqn}")
            for name, input_name in backward.gradients_to_user_inputs.items():
                lines.append(f"  {name:<{width}} gradient of user input {input_name}")
        return "\n".join(lines)

    def __getstate__(self) -> dict:
        # Pickle the specs in pytree's own text format where it can (plain containers):
        # pickled TreeSpec objects trigger deprecation warnings on load in recent torch.
        state = dict(self.__dict__)
        for field in ("in_spec", "out_spec"):
            try:
                state[field] = ("treespec", pytree.treespec_dumps(state[field]))
            except Exception:  # custom pytree nodes without a serialization name
                pass
        return state

    def __setstate__(self, state: dict) -> None:
        for field, value in state.items():
            if isinstance(value, tuple) and len(value) == 2 and value[0] == "treespec":
                value = pytree.treespec_loads(value[1])
            object.__setattr__(self, field, value)

    def _user_input_paths(self) -> list[str]:
        """``args[0]``, ``kwargs['mask']``: where each user input sits in the module call."""
        num_state = len(self.parameters) + len(self.buffers)
        tree = pytree.tree_unflatten(list(range(self.in_spec.num_leaves)), self.in_spec)
        paths = []
        for path, index in pytree.tree_flatten_with_path(tree)[0]:
            if index < num_state:
                continue
            if path[0].idx == 0:
                paths.append(f"args[{path[1].idx - num_state}]" + pytree.keystr(path[2:]))
            else:
                paths.append("kwargs" + pytree.keystr(path[1:]))
        return paths


def aot_export_module(
    mod: nn.Module,
    args: Sequence,
    *,
    decompositions: Optional[dict] = None,
    trace_joint: bool,
    output_loss_index: Optional[int] = None,
    pre_dispatch: bool = False,
    kwargs: Optional[dict] = None,
    dynamic_shapes: bool = False,
) -> tuple[fx.GraphModule, GraphSignature]:
    """Export ``mod`` called with ``args`` (and ``kwargs``) as one functional ATen graph.

    The graph takes ``(*parameters, *buffers, *user_inputs)`` (pytree-flattened) and returns
    ``(*updated_inputs, *user_outputs)``, plus ``*parameter_gradients`` with ``trace_joint``:
    then output ``output_loss_index`` of the module must be a scalar loss, differentiated with
    a gradient of one; every other output must not require grad.

    With ``dynamic_shapes=True`` the sizes of user inputs are symbolic (parameters and
    buffers keep theirs): the graph runs for other sizes, and asserts at its top every size
    condition the trace relied on (see ``export_guards``). Non-tensor inputs are always
    specialized to their values, and asserted too.

    With ``pre_dispatch=True`` (forward only) the graph is traced above autograd: composite
    ops such as ``aten.linear`` stay whole, ``torch.no_grad()`` blocks become
    ``_set_grad_enabled`` calls and ``torch.cond`` / ``map`` stay higher-order operators
    (see ``export_pre_dispatch``); signature and restrictions are the same.

    Restrictions (each raises ``ExportError`` naming the input or output): no metadata
    mutation of inputs; in a joint, no data mutation of inputs that require grad; tensors
    assigned to the module in forward must be registered buffers (updated in place or
    reassigned with the same shape and dtype).
    """
    if not isinstance(mod, nn.Module):
        raise TypeError(f"aot_export_module: expected an nn.Module, got {type(mod).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            "aot_export_module: args must be a tuple of positional arguments, e.g. (x,); "
            f"got {type(args).__name__}"
        )
    if pre_dispatch and trace_joint:
        raise ExportError(
            "aot_export_module: pre_dispatch=True exports the forward only (as PyTorch's does): "
            "a joint graph's backward comes from autograd, which runs below the pre-dispatch "
            "level. Pass trace_joint=False, or pre_dispatch=False for a joint graph."
        )
    if trace_joint and output_loss_index is None:
        raise ExportError(
            "aot_export_module: trace_joint=True needs output_loss_index, the index of the "
            "module's output that is the scalar loss to differentiate (e.g. output_loss_index=0)."
        )
    kwargs = dict(kwargs or {})
    parameters = dict(mod.named_parameters())
    buffers = dict(mod.named_buffers())
    state_names = [*parameters, *buffers]
    num_state = len(state_names)
    user_flat, user_spec = pytree.tree_flatten((tuple(args), kwargs))
    flat_args = [*parameters.values(), *buffers.values(), *user_flat]
    in_spec = pytree.tree_flatten(((*parameters.values(), *buffers.values(), *args), kwargs))[1]
    descriptions = [
        *(f"parameter {n!r}" for n in parameters),
        *(f"buffer {n!r}" for n in buffers),
        *(f"user input {path}" for path in _leaf_paths(user_spec, ("args", "kwargs"))),
    ]
    out_spec_cell: list = [None]
    output_shapes: list = []
    watch = _AssignmentWatch(mod)

    def flat_fn(*flat):
        state = dict(zip(state_names, flat[:num_state]))
        call_args, call_kwargs = pytree.tree_unflatten(list(flat[num_state:]), user_spec)
        with watch.active(state):
            outputs = torch.func.functional_call(
                mod, state, call_args, call_kwargs, tie_weights=True
            )
        flat_outputs, out_spec_cell[0] = pytree.tree_flatten(outputs)
        output_shapes[:] = [o.shape if isinstance(o, torch.Tensor) else None for o in flat_outputs]
        return flat_outputs

    fake_mode, fake_args = _fake_export_inputs(flat_args, num_state, dynamic_shapes)
    # An inference export traces under no_grad, so that nothing is recorded for autograd.
    # Pre-dispatch keeps the caller's grad mode instead, so that the graph records where
    # the forward switches it (torch.no_grad() blocks), as PyTorch's does.
    grad_context = torch.enable_grad() if trace_joint else torch.no_grad()
    if pre_dispatch:
        grad_context = contextlib.nullcontext()
    with grad_context, watch.restoring(), _data_dependence_is_an_export_error("aot_export_module"):
        with fake_mode, _unbacked_symbols_of_this_run_are_not_graph_values(fake_mode):
            meta, _ = collect_metadata(
                flat_fn, fake_args, is_training=trace_joint, keep_inference_input_mutations=False
            )
        watch.check()
        out_spec = out_spec_cell[0]
        output_descriptions = [
            _output_label(index, path) for index, path in enumerate(_leaf_paths(out_spec, None))
        ]
        check_module_inputs(fake_args, meta, descriptions, trace_joint)
        graph_fn = _export_outputs_fn(flat_fn, meta)
        if trace_joint:
            output_loss_index = _check_joint_outputs(
                meta, output_shapes, output_descriptions, output_loss_index
            )
            graph_fn = _loss_joint_fn(graph_fn, len(meta.mutated_input_indices) + output_loss_index)
        if pre_dispatch:
            gm = trace_pre_dispatch(
                graph_fn, fake_args, decompositions=dict(decompositions or {}), fake_mode=fake_mode
            )
        else:
            gm = trace(
                lambda primals: graph_fn(*primals),
                [list(fake_args)],
                decompositions=dict(decompositions or {}),
                fake_mode=fake_mode,
            )
        if trace_joint:
            _check_gradients(gm, fake_args, descriptions)
    gm = name_inputs_like_torch(gm)
    guard_constant_inputs(gm, fake_args, descriptions)
    if dynamic_shapes:
        guard_dynamic_shapes(gm, fake_args, descriptions, fake_mode.shape_env)
    _drop_stale_pytree_specs(gm)
    signature = _graph_signature(
        gm,
        meta,
        parameter_names=list(parameters),
        buffer_names=list(buffers),
        in_spec=in_spec,
        out_spec=out_spec,
        num_user_outputs=len(meta.output_info),
        loss_index=output_loss_index if trace_joint else None,
        fake_args=fake_args,
    )
    name = f"{type(mod).__name__}_export_{'joint' if trace_joint else 'inference'}"
    debug.graph_artifact("graphs", name, gm)
    debug.artifact("graphs", f"{name}_signature", signature.describe(), suffix=".txt")
    return gm, signature


def aot_export_joint_simple(
    func: Callable,
    args: Sequence,
    *,
    trace_joint: bool,
    num_params_buffers: int = 0,
    decompositions: Optional[dict] = None,
) -> fx.GraphModule:
    """Export ``func`` without changing its calling convention.

    ``num_params_buffers`` is accepted for compatibility with PyTorch's signature; it only
    marks leading inputs as static under dynamic shapes there, and export here is static.

    ``func`` takes a flat list of tensors and returns a tuple or list of tensors; it must not
    mutate its inputs, and its outputs must not alias its inputs or each other.

    * ``trace_joint=False``: the graph is ``func`` itself, functional: ``gm(*args) == func(*args)``.
    * ``trace_joint=True``: the joint graph ``(primals_1.., tangents_1..) -> (*outputs,
      *one gradient per input or None)``, with a tangent for each output that requires grad;
      a partition_fn splits it into a forward with ``func``'s own convention and a backward.
    """
    if not isinstance(args, (tuple, list)):
        raise ExportError(
            f"aot_export_joint_simple: args must be a flat tuple or list of tensors, got "
            f"{type(args).__name__}. Wrap a single tensor as (x,)."
        )
    for index, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            raise ExportError(
                # PyTorch's words first (callers match on them), then ours
                "aot_export_joint_simple requires individual inputs not to be pytrees. "
                f"aot_export_joint_simple: input {index} is a {type(arg).__name__}, not a tensor. "
                "It takes no pytrees or constants: flatten them yourself (pytree.tree_flatten) "
                "or use aot_export_module, or bind constants into func with functools.partial."
            )
    def flat_fn(*flat):
        outputs = func(*flat)
        if not isinstance(outputs, (tuple, list)):
            raise ExportError(
                "aot_export_joint_simple: func must return a tuple or list of tensors, got "
                f"{_type_name(outputs)}; return (out,) for a single tensor."
            )
        for index, out in enumerate(outputs):
            if not isinstance(out, torch.Tensor):
                raise ExportError(
                    f"aot_export_joint_simple: output {index} is a {type(out).__name__}, not a "
                    "tensor; it takes no pytrees. Flatten the outputs (pytree.tree_flatten) or "
                    "use aot_export_module."
                )
        return list(outputs)

    fake_mode, fake_args = fake_inputs(list(args), dynamic=False)
    decompositions = dict(decompositions or {})
    grad_context = torch.enable_grad() if trace_joint else torch.no_grad()
    with grad_context, _data_dependence_is_an_export_error("aot_export_joint_simple"):
        with fake_mode:
            meta, graph_output_fakes = collect_metadata(
                flat_fn, fake_args, is_training=trace_joint, keep_inference_input_mutations=False
            )
        check_simple_inputs(fake_args, meta, trace_joint)
        for index, info in enumerate(meta.output_info):
            if info.kind is not OutputKind.NOT_ALIAS:
                raise ExportError(
                    f"aot_export_joint_simple: output {index} {_alias_description(info, meta)}. "
                    "Outputs must not alias inputs or other values: return out.clone() instead."
                )
        graph_fn = graph_outputs_fn(flat_fn, meta)
        if trace_joint:
            tangents = make_tangents(graph_output_fakes, meta)
            gm, mutated_in_backward = trace_joint_graph(
                graph_fn, fake_args, tangents, meta,
                decompositions=decompositions, fake_mode=fake_mode,
            )
            if mutated_in_backward:
                raise ExportError(
                    f"aot_export_joint_simple: the backward mutates input(s) {mutated_in_backward} "
                    "(a custom autograd.Function's backward changes a saved input in place); the "
                    "joint graph's convention has no output for that. Mutate a copy instead."
                )
        else:
            gm = name_inputs_like_torch(trace_forward(
                graph_fn, fake_args, meta, decompositions=decompositions, fake_mode=fake_mode
            ))
    kind = "joint" if trace_joint else "inference"
    debug.graph_artifact("graphs", f"{getattr(func, '__name__', 'function')}_export_{kind}", gm)
    return _drop_stale_pytree_specs(gm)


def _fake_export_inputs(flat_args: list, num_state: int, dynamic: bool) -> tuple[Any, list]:
    """Fake inputs to trace with. With dynamic shapes, parameters and buffers keep their
    shapes and every user input size gets its own symbol (no "duck sizing": two sizes that
    happen to be equal in the example are not assumed equal unless the model needs it, in
    which case it is a guard, and the graph checks it)."""
    if not dynamic or detect_fake_mode(flat_args) is not None:
        return fake_inputs(flat_args, dynamic=dynamic)
    fake_mode = new_fake_mode(shape_env=ShapeEnv(duck_shape=False), allow_non_fake_inputs=True)
    fakes = [
        fake_mode.from_tensor(arg, static_shapes=index < num_state)
        if isinstance(arg, torch.Tensor) else arg
        for index, arg in enumerate(flat_args)
    ]
    return fake_mode, fakes


def name_inputs_like_torch(gm: fx.GraphModule) -> fx.GraphModule:
    """Rename the graph's inputs ``arg0_1, arg1_1, ...`` as PyTorch's export names them, so
    that code written against PyTorch's graph signature finds the same names here.

    Our tracer names inputs after its own calling convention (``primals_N``); the export's
    graph and signature are built after the rename, so both use the new names."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    new_names = {node: f"arg{index}_1" for index, node in enumerate(placeholders)}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:  # placeholders come first, so their names are free
        if node in new_names:
            env[node] = graph.placeholder(new_names[node], type_expr=node.type)
            env[node].meta = dict(node.meta)
            if env[node].name != new_names[node]:
                raise AssertionError(f"could not name graph input {new_names[node]!r}")
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph)


def _drop_stale_pytree_specs(gm: fx.GraphModule) -> fx.GraphModule:
    """make_fx leaves the pytree specs of its traced function on the module although the
    graph now takes and returns flat values; pickling them makes torch.load warn."""
    for name in ("_in_spec", "_out_spec"):
        if isinstance(gm.__dict__.get(name), pytree.TreeSpec):
            gm.__dict__[name] = None
    return gm


def _unbacked_symbols_of_this_run_are_not_graph_values(fake_mode):
    """Metadata collection runs the forward once outside the trace; every ``.item()`` in it
    makes a fresh unbacked size symbol that no graph node will define. The trace that follows
    makes its own, so the shape environment must not wait for these ones."""
    shape_env = fake_mode.shape_env
    if shape_env is None:
        return contextlib.nullcontext()
    return shape_env.ignore_fresh_unbacked_symbols()


@contextlib.contextmanager
def _data_dependence_is_an_export_error(api: str):
    """Tracing runs on fake tensors, which have shapes but no values: turn fake tensor's terse
    ``aten._local_scalar_dense.default`` into an error that says what to change."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise ExportError(
            f"{api}: the forward depends on the values inside a tensor ({error}), as .item(), "
            "a Python `if` or `while` on a tensor, or an op whose output shape depends on the "
            "data (nonzero, masked_select, unique) do. Export traces with shapes only: use "
            "tensor ops instead (torch.where, masking by multiplication), or pass the value "
            "as a Python number argument. Where the value is a size (x[:n.item()], "
            "torch.zeros(n.item())), aot_export_module can keep it symbolic: export with "
            "dynamic_shapes=True. The traceback of the cause shows the line."
        ) from error
    except GuardOnDataDependentSymNode as error:
        first_line = str(error).strip().splitlines()[0]
        raise ExportError(
            f"{api}: the forward decides something from a value it read from a tensor "
            f"(.item() or a data-dependent size): {first_line}. The export knows nothing of "
            "that value, so it cannot pick a side of a Python `if`, `min` or size comparison. "
            "Tell it what holds with torch._check (e.g. torch._check(n >= 0), "
            "torch._check(n <= x.shape[0])): the graph then asserts it at run time; or branch "
            "with torch.cond, or use tensor ops (torch.where). The traceback of the cause "
            "shows the line."
        ) from error


def _type_name(value) -> str:
    return "a tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


def _alias_description(info, meta: ViewAndMutationMeta) -> str:
    if info.kind is OutputKind.IS_INPUT:
        return f"is input {info.base_index} itself"
    if info.kind is OutputKind.ALIAS_OF_INPUT:
        return f"is a view of input {info.base_index}"
    if info.base_is_user_output:
        return f"is a view of output {info.base_index}"
    return "is a view of an intermediate tensor"


# ---------------------------------------------------------------------------------------------
# The graph functions that get traced


def _export_outputs_fn(flat_fn: Callable, meta: ViewAndMutationMeta) -> Callable:
    """``flat_fn`` returning ``(*updated values of mutated inputs, *every user output)``.

    Unlike the runtime's graph (which regenerates aliasing outputs outside the graph), an
    exported graph returns every user output itself, views included."""
    mutated = meta.mutated_input_indices

    def fn(*args):
        outputs = list(flat_fn(*args))
        return [*(args[i] for i in mutated), *outputs]

    return fn


def _loss_joint_fn(graph_fn: Callable, loss_position: int) -> Callable:
    """``graph_fn`` plus the gradient of its output ``loss_position`` (a scalar, gradient one)
    with respect to every input that requires grad, in input order."""

    def joint(*primals):
        outputs = graph_fn(*primals)
        wrt = [p for p in primals if isinstance(p, torch.Tensor) and p.requires_grad]
        gradients = torch.autograd.grad(outputs[loss_position], wrt, allow_unused=True)
        return [*outputs, *gradients]

    return joint


# ---------------------------------------------------------------------------------------------
# Restrictions


def _check_joint_outputs(
    meta: ViewAndMutationMeta, output_shapes: list, descriptions: list[str], loss_index: int
) -> int:
    """Check the outputs of a joint export; return the loss index, made non-negative."""
    outputs = meta.output_info
    if not -len(outputs) <= loss_index < len(outputs):
        raise ExportError(
            f"aot_export_module: output_loss_index={loss_index}, but the module returned "
            f"{len(outputs)} output(s) (after flattening: {', '.join(descriptions)}). Pass the "
            "index of the scalar loss among them."
        )
    loss_index %= len(outputs)
    loss = f"the loss ({descriptions[loss_index]}, output_loss_index={loss_index})"
    if not outputs[loss_index].is_tensor:
        raise ExportError(f"aot_export_module: {loss} is not a tensor; it must be a scalar tensor.")
    if not outputs[loss_index].requires_grad:
        raise ExportError(
            f"aot_export_module: {loss} does not require grad, so there is nothing to "
            "differentiate. Compute it from parameters that require grad (not under "
            "torch.no_grad() or from detached values), or export with trace_joint=False."
        )
    shape = output_shapes[loss_index]
    if shape.numel() != 1:
        raise ExportError(
            f"aot_export_module: {loss} has shape {tuple(shape)}, but it must be a scalar (one "
            "element). Reduce it in the forward, e.g. loss.sum() or loss.mean()."
        )
    for index, info in enumerate(outputs):
        if index != loss_index and info.requires_grad:
            raise ExportError(
                "Found an output of the forward that requires gradients, that was not the scalar "
                f"loss. aot_export_module: {descriptions[index]} requires grad, but only the loss "
                f"({descriptions[loss_index]}) is differentiated in a joint export. "
                "Return it with .detach() from the forward."
            )
    return loss_index


def _check_gradients(gm: fx.GraphModule, fake_args: Sequence, descriptions: list[str]) -> None:
    """Every input that requires grad must reach the loss: a missing gradient has no place
    among the graph's outputs (and eager would leave its .grad as None, not zero)."""
    (output_node,) = gm.graph.find_nodes(op="output")
    requiring_grad = [
        i for i, a in enumerate(fake_args) if isinstance(a, torch.Tensor) and a.requires_grad
    ]
    gradients = output_node.args[0][len(output_node.args[0]) - len(requiring_grad) :]
    for index, gradient in zip(requiring_grad, gradients):
        if gradient is None:
            raise ExportError(
                f"aot_export_module: {descriptions[index]} requires grad but the loss does not "
                "depend on it, so it has no gradient. Call requires_grad_(False) on it before "
                "exporting, or use it in the loss."
            )


class _AssignmentWatch:
    """Watches the tensors the forward assigns to modules.

    * A registered buffer reassigned in forward (``self.count = self.count + 1``) is turned
      into an in-place update of the traced buffer, so it becomes a buffer mutation.
    * Any other tensor attribute assigned in forward is an error: the exported graph has no
      place for it (and eager would keep it on the module between calls).
    The module is left exactly as it was (no fake tensors left on it)."""

    def __init__(self, mod: nn.Module):
        self.mod = mod
        self.buffer_names = [name for name, _ in mod.named_buffers()]
        self.assigned: list[str] = []

    def _tensor_attributes(self) -> dict[tuple[str, str], Any]:
        found = {}
        for prefix, module in self.mod.named_modules(remove_duplicate=False):
            for name, value in vars(module).items():
                if isinstance(value, torch.Tensor):
                    found[(prefix, name)] = value
        return found

    @contextlib.contextmanager
    def active(self, state: dict):
        """Around one functional call of the module with ``state`` swapped in."""
        before = self._tensor_attributes()

        def reassigned_buffers(module, inputs, outputs):
            for name in self.buffer_names:
                current = self.mod.get_buffer(name)
                traced = state[name]
                if current is traced:
                    continue
                if current.shape != traced.shape or current.dtype != traced.dtype:
                    raise ExportError(
                        f"aot_export_module: the forward reassigns buffer {name!r} with a tensor "
                        f"of shape {tuple(current.shape)} and dtype {current.dtype}, but it was "
                        f"registered with shape {tuple(traced.shape)} and dtype {traced.dtype}. "
                        "A buffer may only be updated with a value of the same shape and dtype."
                    )
                traced.copy_(current)
            for key, value in self._tensor_attributes().items():
                if before.get(key) is not value:
                    self.assigned.append(".".join(filter(None, key)))
            return outputs

        handle = self.mod.register_forward_hook(reassigned_buffers)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def restoring(self):
        """Put back every plain attribute of every submodule as it was before the export."""
        modules = [module for _, module in self.mod.named_modules(remove_duplicate=False)]
        saved = [(module, dict(vars(module))) for module in modules]
        try:
            yield
        finally:
            for module, attributes in saved:
                for name in set(vars(module)) - set(attributes):
                    delattr(module, name)
                for name, value in attributes.items():
                    if vars(module).get(name) is not value:
                        object.__setattr__(module, name, value)

    def check(self) -> None:
        if self.assigned:
            name = self.assigned[0]
            raise ExportError(
                f"aot_export_module: the forward assigns a tensor to the module attribute "
                f"{name!r}, which is not a registered buffer. The exported graph cannot carry "
                "state that is not a buffer: register it in __init__ with "
                f"self.register_buffer({name.rsplit('.', 1)[-1]!r}, tensor) and update it in "
                "place, or return it as an output instead of storing it."
            )


# ---------------------------------------------------------------------------------------------
# The signature


def _leaf_paths(spec, root_names: Optional[tuple[str, ...]]) -> list[str]:
    """``args[0]``, ``kwargs['mask']``, ``[1]['logits']``: where each flat leaf of ``spec`` is."""
    if spec is None:
        return []
    tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    paths = []
    for path, _ in pytree.tree_flatten_with_path(tree)[0]:
        if root_names is not None:
            head, rest = root_names[path[0].idx], path[1:]
            paths.append(head + pytree.keystr(rest))
        else:
            paths.append(pytree.keystr(path))
    return paths


def _output_label(index: int, path: str) -> str:
    """``output 1``, or ``output 1 (['logits'])`` where the outputs are nested."""
    return f"output {index}" if path in ("", f"[{index}]") else f"output {index} ({path})"


def _node_names(nodes: Sequence) -> list[str]:
    return [n.name if isinstance(n, fx.Node) else repr(n) for n in nodes]


def _graph_signature(
    gm: fx.GraphModule,
    meta: ViewAndMutationMeta,
    *,
    parameter_names: list[str],
    buffer_names: list[str],
    in_spec,
    out_spec,
    num_user_outputs: int,
    loss_index: Optional[int],
    fake_args: Sequence,
) -> GraphSignature:
    """Name every graph input and output, from the calling convention and the metadata."""
    inputs = _node_names(gm.graph.find_nodes(op="placeholder"))
    (output_node,) = gm.graph.find_nodes(op="output")
    outputs = _node_names(output_node.args[0])
    num_params, num_buffers = len(parameter_names), len(buffer_names)
    state_names = [*parameter_names, *buffer_names]
    mutated = meta.mutated_input_indices
    mutation_outputs, rest = outputs[: len(mutated)], outputs[len(mutated) :]
    user_outputs, gradient_outputs = rest[:num_user_outputs], rest[num_user_outputs:]
    buffers_to_mutate, parameters_to_mutate, user_inputs_to_mutate = {}, {}, {}
    for output_name, index in zip(mutation_outputs, mutated):
        if index < num_params:
            parameters_to_mutate[output_name] = state_names[index]
        elif index < num_params + num_buffers:
            buffers_to_mutate[output_name] = state_names[index]
        else:
            user_inputs_to_mutate[output_name] = inputs[index]
    backward = None
    if loss_index is not None:
        requiring_grad = [
            i for i, a in enumerate(fake_args) if isinstance(a, torch.Tensor) and a.requires_grad
        ]
        gradients_to_parameters, gradients_to_user_inputs = {}, {}
        for output_name, index in zip(gradient_outputs, requiring_grad):
            if index < num_params + num_buffers:
                gradients_to_parameters[output_name] = state_names[index]
            else:
                gradients_to_user_inputs[output_name] = inputs[index]
        backward = BackwardSignature(
            gradients_to_parameters=gradients_to_parameters,
            gradients_to_user_inputs=gradients_to_user_inputs,
            loss_output=user_outputs[loss_index],
        )
    return GraphSignature(
        parameters=list(parameter_names),
        buffers=list(buffer_names),
        user_inputs=inputs[num_params + num_buffers :],
        user_outputs=user_outputs,
        inputs_to_parameters=dict(zip(inputs[:num_params], parameter_names)),
        inputs_to_buffers=dict(zip(inputs[num_params : num_params + num_buffers], buffer_names)),
        buffers_to_mutate=buffers_to_mutate,
        parameters_to_mutate=parameters_to_mutate,
        user_inputs_to_mutate=user_inputs_to_mutate,
        in_spec=in_spec,
        out_spec=out_spec,
        backward_signature=backward,
    )

