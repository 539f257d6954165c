"""One compile: fake inputs -> metadata -> trace -> partition -> compile -> runtime wrapper.

The top of the stage is ``compile_flat``; it is a flat list of the steps, each a named
function of its own.
"""
from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import (
    DataDependentOutputException, DynamicOutputShapeException, FakeTensor, FakeTensorMode,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound, ShapeEnv

from .. import debug, op_table
from ..config import config as global_config
from . import cache as aot_cache
from ..torch_versions import new_fake_mode
from .boxing import call_compiled
from .effects import partition_with_effects
from .guards import check_graph_constants
from .input_analysis import DedupeInputs, SyntheticBases, alias_groups, apply_post_compile
from .metadata import collect_metadata
from .rng import RandomOps
from .runtime import check_outputs_once, make_inference_runtime, make_training_runtime
from .schemas import AOTConfig, OutputKind, ViewAndMutationMeta
from .subclasses import TensorSubclasses, check_supported_inputs, is_subclass
from .unfunctionalized import split_by_phase
from .trace import TRACE_LOCK, graph_outputs_fn, joint_fn, make_tangents, trace, trace_forward, trace_joint


@dataclasses.dataclass
class CompileConfig(AOTConfig):
    """AOTConfig plus the functorch.compile options only this stage reads."""

    # Trace without functionalization: in-place ops stay in the graphs (functorch's meaning).
    disable_functionalization: bool = False


def is_training_call(flat_args: Sequence) -> bool:
    """Eager builds an autograd graph only if grad mode is on and some input requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in flat_args
    )


def fake_inputs(flat_args: Sequence, dynamic: bool) -> tuple[FakeTensorMode, list]:
    """Fake versions of the inputs, in the fake mode they already belong to (Dynamo's
    tracing context) or in a new one (with symbolic shapes if ``dynamic``)."""
    fake_mode = detect_fake_mode(flat_args)
    static_shapes = None
    if fake_mode is None:
        # A jagged nested tensor's ragged size is a symbol (a nested int) even in static mode.
        jagged = any(isinstance(a, torch.Tensor) and a.is_nested for a in flat_args)
        fake_mode = new_fake_mode(shape_env=ShapeEnv() if dynamic or jagged else None, allow_non_fake_inputs=True)
        static_shapes = not dynamic
    fakes = []
    for arg in flat_args:
        if isinstance(arg, torch.Tensor) and not isinstance(arg, FakeTensor):
            fake = fake_mode.from_tensor(arg, static_shapes=static_shapes)
            if _has_empty_storage(arg) and not _has_empty_storage(fake):
                # FSDP frees parameters' storage; the fake must show it (metadata reads it)
                fake.untyped_storage().resize_(0)
            arg = fake
        fakes.append(arg)
    return fake_mode, fakes


def _has_empty_storage(tensor: torch.Tensor) -> bool:
    if tensor.layout is not torch.strided or tensor.is_nested or type(tensor) not in (torch.Tensor, FakeTensor, torch.nn.Parameter):
        return False
    return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0


def _check_no_read_of_freed_storage(flat_args: Sequence, meta: ViewAndMutationMeta) -> None:
    """An input whose storage was freed (0 bytes, as FSDP leaves sharded parameters) must be
    re-allocated (resize_storage_bytes_) or swapped (set_()) by the function before use;
    reading it reads freed memory, which crashes eager. Refuse it before anything runs."""
    for index, (arg, info) in enumerate(zip(flat_args, meta.input_info)):
        if isinstance(arg, torch.Tensor) and _has_empty_storage(arg) and not (
            info.storage_nbytes_after or info.storage_swapped
        ):
            raise RuntimeError(
                f"aotforge: input {index} has a freed storage (0 bytes for {arg.numel()} elements, "
                "as after untyped_storage().resize_(0)), and the function neither re-allocates it "
                "(torch.ops.inductor.resize_storage_bytes_) nor set_()s it; reading it would read "
                "freed memory. Re-allocate the storage before the call, or inside the function."
            )


def compile_flat(
    flat_fn: Callable,
    flat_args: Sequence,
    config: AOTConfig,
    *,
    is_training: bool,
) -> tuple[Callable, ViewAndMutationMeta, list]:
    """Compile ``flat_fn`` (flat tensor/SymInt args -> flat outputs) for these arguments.

    Returns ``(run, meta, fake_args)`` where ``run(args_list)`` returns the user's flat outputs.
    """
    check_supported_inputs(flat_args)
    # Inputs that are fake already come from Dynamo, which handles data-dependent code itself.
    from_dynamo = detect_fake_mode(flat_args) is not None
    with TRACE_LOCK, debug.ensure_scope(config.name):
        try:
            if not from_dynamo and aot_cache.function_cache is not None:
                # aot_function with aotforge's compiler: through the AOT cache (compiler/function_cache.py)
                return aot_cache.function_cache(flat_fn, flat_args, config, is_training, _compile_flat)
            return _compile_flat(flat_fn, flat_args, config, is_training=is_training)
        except _DATA_DEPENDENT_ERRORS as error:
            if from_dynamo:
                raise
            raise NotImplementedError(_data_dependent_message(error, config.name)) from error


_DATA_DEPENDENT_ERRORS = (
    DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode,
    PendingUnbackedSymbolNotFound,
)
_PACKAGE_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


def _data_dependent_message(error: Exception, name: str) -> str:
    """Our words for fake tensors' data-dependent errors: what the code did, where, and what
    to do instead."""
    where = ""
    for frame, line in traceback.walk_tb(error.__traceback__):
        if not frame.f_code.co_filename.startswith(_PACKAGE_DIRS):
            where = f" (at {frame.f_code.co_filename}:{line})"
    op = getattr(error, "func", None)
    if isinstance(error, DynamicOutputShapeException) or isinstance(error, PendingUnbackedSymbolNotFound):
        what = (f"calls {op or 'an op'} whose output shape depends on tensor values (boolean-mask "
                "indexing x[mask], nonzero, unique, masked_select, ...)")
        instead = "keep shapes fixed (torch.where(mask, x, 0) instead of x[mask])"
    else:
        what = ("reads a tensor's value in Python (.item(), .tolist(), int(t), or `if t:` / "
                "`if t.sum() > 0:` branching on a tensor)")
        instead = ("compute on tensors instead (torch.where for a branch on values, torch.cond "
                   "for one on a scalar tensor)")
    return (
        f"aotforge: {name}{where} {what}. A graph compiled ahead of time is traced once for all "
        "input values, so it cannot depend on them. Compile it with "
        f"torch.compile(..., backend=\"aotforge\"), whose Dynamo frontend runs such code eagerly "
        f"and compiles the rest; or {instead}; or do that part outside the compiled function and "
        f"pass its result in. ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else op})"
    )


def _compile_flat(flat_fn, flat_args, config: AOTConfig, *, is_training: bool):
    transforms: list = []
    if DedupeInputs.needed(flat_args):
        transforms.append(DedupeInputs(flat_args))
        flat_fn, flat_args = transforms[-1].pre_compile(flat_fn, flat_args)
    fake_mode, fake_args = fake_inputs(flat_args, config.dynamic)
    # Fakes aligned with the caller's arguments (duplicates repeated), for shape guards.
    original_fake_args = [fake_args[i] for i in transforms[0].source] if transforms else fake_args

    random_ops = RandomOps()

    def collect(fn, args):
        with fake_mode:
            try:
                return collect_metadata(
                    random_ops.watch(fn),
                    args,
                    is_training=is_training,
                    keep_inference_input_mutations=config.keep_inference_input_mutations,
                )
            except RuntimeError as error:
                if "invalid python storage" not in str(error):
                    raise
                # traced tensors have no real storage to resize or read
                raise NotImplementedError(
                    "aotforge: the function works on a tensor's storage directly "
                    "(untyped_storage().resize_(), data_ptr(), ...), which a traced graph cannot "
                    f"express ({error}). Do that outside the compiled function, or compile with "
                    "torch.compile, whose Dynamo frontend handles storage resizes of inputs."
                ) from error

    meta, graph_output_fakes = collect(flat_fn, fake_args)
    _check_no_read_of_freed_storage(flat_args, meta)
    groups = alias_groups(fake_args, meta)
    if any(is_subclass(fake_args[i]) for group in groups for i in group):
        raise NotImplementedError(
            # PyTorch's words first (callers match on them), then ours
            "Encountered aliased inputs that are mutated in the graph, but at least one input/output "
            "to the graph is a tensor subclass. This is not supported today. aotforge: "
            "tensor-subclass inputs that share storage with another input (a view passed with "
            "its base), where one of them is mutated, are not supported; clone one of them "
            "before the call."
        )
    if groups:
        transforms.append(SyntheticBases(groups, fake_args))
        with fake_mode:
            flat_fn, fake_args = transforms[-1].pre_compile(flat_fn, fake_args)
        meta, graph_output_fakes = collect(flat_fn, fake_args)
    debug.artifact("metadata", f"{config.name}_metadata", meta.describe(), suffix=".txt")
    # A training call whose outputs need no gradient is compiled as inference.
    meta.is_training = is_training and any(meta.graph_output_requires_grad())
    # Random ops whose draws the backward may redo take a seed input, or save their state.
    random_ops.decide(meta.is_training)
    if random_ops.functionalized:
        transforms.append(random_ops)
        flat_fn, fake_args = random_ops.pre_compile(flat_fn, fake_args, meta)
    graph_fn = graph_outputs_fn(flat_fn, meta)
    # Tensor subclasses among the inputs or outputs: the graphs see their inner tensors.
    subclasses = (
        TensorSubclasses(fake_args, graph_output_fakes)
        if TensorSubclasses.needed(fake_args, graph_output_fakes)
        else None
    )
    if meta.is_training:
        run = _compile_training(graph_fn, fake_args, graph_output_fakes, meta, config, fake_mode, random_ops,
                                subclasses)
    else:
        run = _compile_inference(graph_fn, fake_args, meta, config, fake_mode, random_ops, subclasses)
    wrapped = apply_post_compile(run, transforms)
    return aot_cache.with_plan(wrapped, run, meta, transforms, subclasses, fake_args), meta, original_fake_args


def _compile_inference(graph_fn, fake_args, meta, config: AOTConfig, fake_mode, random_ops,
                       subclasses=None) -> Callable:
    traced_fn, traced_args, traced_meta = graph_fn, fake_args, meta
    if subclasses is not None:
        traced_fn = subclasses.pre_compile(graph_fn)
        traced_args, traced_meta = subclasses.plain_fake_args, subclasses.plain_meta(meta)
    # Traced in the caller's grad mode, not under no_grad: a function that differentiates
    # inside (torch.autograd.grad) needs grad mode, and Dynamo's graphs rely on the grad mode
    # they were captured in. The graph is plain ATen either way, and runs under no_grad.
    with random_ops.tracing():
        forward = trace_forward(
            traced_fn, traced_args, traced_meta, decompositions=config.decompositions, fake_mode=fake_mode,
            functionalize=not getattr(config, "disable_functionalization", False),
        )
    check_graph_constants(forward, grad_enabled=torch.is_grad_enabled())
    debug.graph_artifact("graphs", f"{config.name}_inference", forward)
    with torch.no_grad():
        compiled = check_outputs_once(
            config.inference_compiler(forward, _placeholder_values(forward)), forward, "inference_compiler"
        )
    if subclasses is not None:
        compiled = subclasses.post_compile(compiled, _output_values(forward))
    return make_inference_runtime(compiled, meta, fake_args)


def _compile_training(graph_fn, fake_args, graph_output_fakes, meta, config: AOTConfig, fake_mode, random_ops,
                      subclasses=None):
    user_meta, user_fake_args = meta, fake_args  # what the runtime sees (subclass level)
    tangents = make_tangents(graph_output_fakes, meta)
    functionalize = not getattr(config, "disable_functionalization", False)
    static_inputs = list(config.static_input_indices)
    with torch.enable_grad(), random_ops.tracing():
        mutated_in_backward: list[int] = []
        if subclasses is None:
            joint, mutated_in_backward = trace_joint(
                graph_fn, fake_args, tangents, meta, decompositions=config.decompositions, fake_mode=fake_mode,
                functionalize=functionalize,
            )
        else:
            with fake_mode:
                plain_joint, tangents = subclasses.pre_compile_joint(
                    joint_fn(graph_fn, meta, mutated_in_backward), tangents)
            fake_args, meta = subclasses.plain_fake_args, subclasses.plain_meta(meta)
            static_inputs = subclasses.plain_indices(static_inputs)
            joint = trace(
                plain_joint, [list(fake_args), list(tangents)], decompositions=config.decompositions,
                fake_mode=fake_mode, functionalize=functionalize,
            )
            if any(not isinstance(m, int) for m in mutated_in_backward):
                raise NotImplementedError(
                    "aotforge: a backward that mutates the gradient it received, where the "
                    "function has tensor-subclass inputs or outputs, is not supported; return "
                    "a new gradient (grad * 2) instead of changing it in place (grad.mul_(2))")
    check_graph_constants(joint, grad_enabled=True)
    debug.graph_artifact("graphs", f"{config.name}_joint", joint)
    num_outputs = meta.num_graph_outputs if subclasses is None else subclasses.num_plain_outputs
    if functionalize:
        forward, backward = partition_with_effects(config.partition_fn)(
            joint,
            [*fake_args, *tangents],
            num_fwd_outputs=num_outputs,
            static_lifetime_input_indices=static_inputs,
        )
    else:  # in-place ops in the graph: split in trace order (see unfunctionalized.py)
        forward, backward = split_by_phase(joint, num_outputs)
    debug.graph_artifact("graphs", f"{config.name}_forward", forward)
    debug.graph_artifact("graphs", f"{config.name}_backward", backward)
    saved = _output_values(forward)[num_outputs:]
    # The partitioner saves symbolic values (SymInt, and SymFloat for a float argument) after
    # the tensors; the runtime keeps them on ctx rather than save_for_backward.
    num_saved_symints = sum(1 for v in saved if not isinstance(v, torch.Tensor))
    num_saved_tensors = len(saved) - num_saved_symints
    clone_saved = _saved_aliases_of_mutated_inputs(forward, meta, num_outputs, num_saved_tensors)
    with torch.no_grad():
        compiled_forward = check_outputs_once(
            config.fw_compiler(forward, _placeholder_values(forward)), forward, "fw_compiler"
        )
    bw_compiler = _checked(_in_scope(_under_current_patches(config.bw_compiler), debug.current_scope()),
                           "bw_compiler")
    views_of_outputs = _views_of_outputs_plan(meta, graph_output_fakes) if subclasses is None else []
    if views_of_outputs:
        compiled_forward = _with_views_of_outputs(compiled_forward, views_of_outputs)
    if subclasses is not None:
        # The runtime (autograd.Function) and its epilogue work on the caller's subclasses.
        compiled_forward = subclasses.post_compile(compiled_forward, _output_values(forward)[:num_outputs])
        bw_compiler = _wrapped_compiler(bw_compiler, subclasses.post_compile_backward)
        meta, fake_args = user_meta, user_fake_args
    if config.compile_backward_now:
        with torch.no_grad():
            compiled_backward = bw_compiler(backward, _placeholder_values(backward))
        bw_compiler = lambda gm, example_inputs: compiled_backward  # noqa: E731  already done
    run = make_training_runtime(
        compiled_forward,
        backward,
        bw_compiler,
        meta,
        fake_args,
        num_saved_tensors,
        num_saved_symints,
        clone_saved,
        mutated_in_backward,
    )
    if views_of_outputs:
        # The AOT cache rebuilds a runtime around the compiled graphs alone, which would lose
        # the views rebuilt above: say that this runtime cannot be rebuilt (aot/cache.py).
        run.runtime_parameters = None
    return run


def _views_of_outputs_plan(meta, graph_output_fakes: Sequence) -> list:
    """(graph position of the view, of its sibling, view size, stride, offset relative to the
    sibling, sibling size, stride) for each multi-output view the compiled Function returns
    (OutputInfo.view_of_output, else the view itself) whose layouts are static and whose
    memory lies within its sibling's, as traced."""
    num_mutated = len(meta.mutated_input_indices)
    plan = []
    for position, info in enumerate(meta.output_info):
        if info.kind is not OutputKind.NOT_ALIAS or not info.multi_output_view:
            continue
        # without a sibling: a view of its own value, so that autograd refuses in-place changes
        sibling_index = position if info.view_of_output is None else info.view_of_output
        view, sibling = (graph_output_fakes[num_mutated + i] for i in (position, sibling_index))
        layouts = [(*t.size(), *t.stride(), t.storage_offset()) for t in (view, sibling)]
        if not all(isinstance(v, int) for layout in layouts for v in layout):
            continue  # symbolic sizes: the compiled value stays (PyTorch's behaviour)
        if (view.dtype, view.is_conj(), view.is_neg()) != (sibling.dtype, sibling.is_conj(), sibling.is_neg()):
            continue
        if not _within(view, sibling):
            continue
        plan.append((num_mutated + position, num_mutated + sibling_index, tuple(view.size()),
                     tuple(view.stride()), view.storage_offset() - sibling.storage_offset(),
                     tuple(sibling.size()), tuple(sibling.stride())))
    return plan


def _span(tensor) -> tuple[int, int]:
    if tensor.numel() == 0:
        return tensor.storage_offset(), tensor.storage_offset()
    last = sum((n - 1) * abs(s) for n, s in zip(tensor.size(), tensor.stride()))
    return tensor.storage_offset(), tensor.storage_offset() + last


def _within(view, sibling) -> bool:
    (v0, v1), (s0, s1) = _span(view), _span(sibling)
    return s0 <= v0 and v1 <= s1 and all(s >= 0 for s in (*view.stride(), *sibling.stride()))


def _with_views_of_outputs(compiled_forward: Callable, plan: list) -> Callable:
    """``compiled_forward`` whose outputs in ``plan`` are views of their sibling output, as in
    eager (a compiler may return them as separate tensors). Runs inside the runtime's
    autograd.Function forward, which returns both: the view keeps autograd's multi-output
    rule, and an in-place change of the sibling shows in it."""
    def run(args: list) -> list:
        outputs = list(call_compiled(compiled_forward, args))
        for view_at, sibling_at, size, stride, offset, sibling_size, sibling_stride in plan:
            sibling = outputs[sibling_at]
            if tuple(sibling.size()) != sibling_size or tuple(sibling.stride()) != sibling_stride:
                continue  # the compiler chose another layout: its own value stays
            outputs[view_at] = sibling.as_strided(size, stride, sibling.storage_offset() + offset)
        return outputs

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _saved_aliases_of_mutated_inputs(forward: fx.GraphModule, meta, num_outputs: int, num_saved: int) -> list[int]:
    """Saved tensors that are (views of) inputs the epilogue will mutate. The backward must see
    their values from before the write-back, so the runtime saves clones of them."""
    mutated = {
        i for i, info in enumerate(meta.input_info)
        if info.mutates_data or info.mutates_metadata or info.storage_swapped or info.storage_freed
    }
    placeholders = forward.graph.find_nodes(op="placeholder")
    mutated_nodes = {placeholders[i] for i in mutated}
    (output,) = forward.graph.find_nodes(op="output")
    saved_nodes = output.args[0][num_outputs : num_outputs + num_saved]
    result = []
    for position, node in enumerate(saved_nodes):
        while isinstance(node, fx.Node) and node.op == "call_function" and op_table.is_view(node.target):
            node = node.args[0]
        if node in mutated_nodes:
            result.append(position)
    return result




def _placeholder_values(gm: fx.GraphModule) -> list:
    return [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]


def _output_values(gm: fx.GraphModule) -> list:
    (output,) = gm.graph.find_nodes(op="output")
    return [n.meta.get("val") if isinstance(n, fx.Node) else n for n in output.args[0]]


def _checked(compiler: Callable, compiler_name: str) -> Callable:
    """``compiler`` whose compiled callable checks its outputs against the graph's once."""

    def compile_and_check(gm, example_inputs):
        return check_outputs_once(compiler(gm, example_inputs), gm, compiler_name)
    return compile_and_check


def _wrapped_compiler(compiler: Callable, wrap: Callable) -> Callable:
    """``compiler`` whose compiled callable is passed through ``wrap``."""

    def compile_and_wrap(gm, example_inputs):
        return wrap(compiler(gm, example_inputs))
    return compile_and_wrap


def _in_scope(compiler: Callable, scope) -> Callable:
    """``compiler`` run in this compile's scope: the backward compiles at the first backward
    call, when no scope is open (and its artifacts belong to this compile)."""

    def compile_in_scope(*args, **kwargs):
        with debug.rejoin(scope):
            return compiler(*args, **kwargs)
    return compile_in_scope


def _under_current_patches(compiler: Callable) -> Callable:
    """``compiler`` under the ``aotforge.config.patch`` active now: the backward graph
    compiles at the first backward call, which autograd may run in another thread (its CUDA
    device thread), where this thread's patches are not visible."""
    patches = global_config.current_patches()
    if not patches:
        return compiler

    def compile_patched(*args, **kwargs):
        with global_config.patch(**patches):
            return compiler(*args, **kwargs)
    return compile_patched
