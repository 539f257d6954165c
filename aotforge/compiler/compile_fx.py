"""The compiler's entry points.

``compile_fx(model, example_inputs)`` is the torch.compile backend: it normalizes the graph
(tuple outputs, flat inputs, pytree codegen), runs pre-grad passes, then AOT autograd with
``compile_fx_inner`` as forward, backward and inference compiler.

``compile_fx_inner(gm, example_inputs)`` compiles one functional ATen graph::

    fake-tensor propagation -> post-grad passes -> lowering to loop IR -> scheduling (fusion)
      -> Triton kernels + Python wrapper   (CUDA tensors, or CPU with config.triton_on_cpu)
      -> the graph's own ATen calls         (CPU tensors: correct, not yet fast)
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import debug
from ..aot.boxing import make_boxed_func
from ..config import config
from . import passes
from .decompositions import select_decomposition_table

# statistics of the last compile_fx_inner call, for tests and `explain`
last_compile: dict[str, Any] = {}


def _has_calls(gm: fx.GraphModule) -> bool:
    return any(node.op == "call_function" for node in gm.graph.nodes)


def _ensure_fake_values(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Every node needs ``meta['val']``; graphs built by hand may lack it."""
    if all("val" in n.meta for n in gm.graph.nodes if n.op not in ("output",)):
        return
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not _is_fake(x) else x for x in example_inputs]
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)


def _is_fake(x: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def _wants_triton(gm: fx.GraphModule) -> bool:
    devices = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            devices.add(val.device.type)
    if "cuda" in devices:
        return True
    return config.triton_on_cpu


def _static_shapes(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) or (isinstance(val, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in list(val.shape) + list(val.stride()))):
            return False
    return True


def _is_functional(gm: fx.GraphModule) -> bool:
    """In-place ops other than ``copy_`` into a graph input would need alias tracking the
    loop IR does not do; such graphs run as ATen calls."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target._schema.is_mutable:
                if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder":
                    continue
                return False
    return True


def compile_fx_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                     static_input_idxs: Sequence[int] = (), is_backward: bool = False,
                     is_inference: bool = False, graph_id: Optional[int] = None, **unused: Any) -> Callable:
    """Compile one functional ATen graph; returns a boxed callable (``fn(args_list)``)."""
    kind = "backward" if is_backward else "inference" if is_inference else "forward"
    if not _has_calls(gm):
        return make_boxed_func(gm)
    started = time.perf_counter()
    _ensure_fake_values(gm, example_inputs)
    gm = passes.post_grad_passes(gm)
    debug.graph_artifact("graphs", f"{kind}_post_grad", gm)
    if not (_wants_triton(gm) and _static_shapes(gm) and _is_functional(gm)):
        last_compile.clear()
        last_compile.update(path="aten", kind=kind, kernels=0, seconds=time.perf_counter() - started)
        return make_boxed_func(gm)  # FX's generated code: one ATen call per node, frees at last use
    compiled = _compile_triton(gm, kind)
    last_compile.clear()
    last_compile.update(path="triton", kind=kind, kernels=compiled.kernel_count, externs=compiled.extern_count,
                        lowered=compiled.lowered, fallbacks=compiled.fallbacks,
                        lowering_errors=compiled.lowering_errors, wrapper=compiled.wrapper_source,
                        kernel_source=compiled.kernel_source, seconds=time.perf_counter() - started)
    call = compiled.call
    call._boxed_call = True  # type: ignore[attr-defined]
    call.compiled_graph = compiled  # type: ignore[attr-defined]
    return call


def _compile_triton(gm: fx.GraphModule, kind: str):
    from .codegen.wrapper import WrapperCodegen
    from .lowering import GraphLowering
    from .runtime.launch import interpreting
    from .scheduler import schedule

    graph = GraphLowering(gm).run()
    output_names = {v.buffer.name for v in graph.outputs if hasattr(v, "buffer")}
    plan = schedule(graph.operations, output_names)
    compiled = WrapperCodegen(graph, plan, interpreting()).generate()
    compiled.lowered, compiled.fallbacks = dict(graph.lowered_ops), dict(graph.fallback_ops)
    compiled.lowering_errors = list(graph.lowering_errors)
    debug.artifact("output_code", f"{kind}_kernels", compiled.kernel_source)
    debug.artifact("output_code", f"{kind}_wrapper", compiled.wrapper_source)
    return compiled


# --- the torch.compile backend -------------------------------------------------------------

def _partitioner() -> Callable:
    import aotforge.partition as partition

    chosen = getattr(partition, "min_cut_rematerialization_partition", None) or partition.default_partition

    def partition_with_joint_passes(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        joint = passes.joint_graph_passes(joint)
        return chosen(joint, joint_inputs, **kwargs)
    return partition_with_joint_passes


def compile_fx(model: fx.GraphModule, example_inputs: Sequence[Any],
               inner_compile: Callable = compile_fx_inner, config_patches: Optional[dict] = None,
               decompositions: Optional[dict] = None) -> Callable:
    """Compile a Dynamo FX graph (torch-level) end to end; the torch.compile backend."""
    if config_patches:
        with config.patch(**config_patches):
            compiled = compile_fx(model, example_inputs, inner_compile, None, decompositions)

        def run_patched(*args: Any) -> Any:
            with config.patch(**config_patches):
                return compiled(*args)
        return run_patched

    if isinstance(model, fx.GraphModule) and isinstance(model.graph._codegen, fx.graph._PyTreeCodeGen):
        return _compile_pytree_codegen(model, example_inputs, inner_compile, decompositions)

    if any(isinstance(x, (list, tuple)) for x in example_inputs):
        return _compile_flattened_inputs(model, example_inputs, inner_compile, decompositions)

    if isinstance(model, fx.GraphModule) and not _returns_tuple(model):
        model = _make_output_tuple(model)
        compiled = compile_fx(model, example_inputs, inner_compile, None, decompositions)
        return lambda *args: compiled(*args)[0]

    if isinstance(model, fx.GraphModule):
        model = passes.pre_grad_passes(model)

    from ..aot import aot_module_simplified

    table = select_decomposition_table(decompositions)
    forward = functools.partial(inner_compile, is_backward=False)
    backward = functools.partial(inner_compile, is_backward=True)
    inference = functools.partial(inner_compile, is_inference=True)
    return aot_module_simplified(model, list(example_inputs), fw_compiler=forward, bw_compiler=backward,
                                 inference_compiler=inference, decompositions=table,
                                 partition_fn=_partitioner(), keep_inference_input_mutations=True)


def _returns_tuple(gm: fx.GraphModule) -> bool:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


def _make_output_tuple(gm: fx.GraphModule) -> fx.GraphModule:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((output.args[0],),)
    gm.recompile()
    return gm


def _compile_pytree_codegen(model: fx.GraphModule, example_inputs, inner_compile, decompositions) -> Callable:
    """Graphs from ``torch._dynamo.export`` take and return pytrees; compile the flat graph
    inside and (un)flatten around it."""
    codegen = model.graph._codegen
    in_spec, out_spec = codegen.pytree_info.in_spec, codegen.pytree_info.out_spec
    model.graph._codegen = fx.graph.CodeGen()
    model.recompile()
    flat_inputs = pytree.arg_tree_leaves(*example_inputs) if in_spec is not None else list(example_inputs)
    compiled = compile_fx(model, flat_inputs, inner_compile, None, decompositions)

    def run(*args: Any, **kwargs: Any) -> Any:
        flat = pytree.arg_tree_leaves(*args, **kwargs) if in_spec is not None else list(args)
        out = compiled(*flat)
        return pytree.tree_unflatten(list(out) if isinstance(out, (list, tuple)) else [out], out_spec) \
            if out_spec is not None else out
    return run


class _FlatInputs(torch.nn.Module):
    def __init__(self, model: Callable, spec: Any):
        super().__init__()
        self.model, self.spec = model, spec

    def forward(self, *flat: Any) -> Any:
        return self.model(*pytree.tree_unflatten(list(flat), self.spec))


def _compile_flattened_inputs(model, example_inputs, inner_compile, decompositions) -> Callable:
    flat, spec = pytree.tree_flatten(list(example_inputs))
    flat_model = _FlatInputs(model, spec)
    compiled = compile_fx(flat_model, flat, inner_compile, None, decompositions)

    def run(*args: Any) -> Any:
        return compiled(*pytree.tree_flatten(list(args))[0])
    return run
