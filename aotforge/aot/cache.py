"""An AOT compile as plain data, and the runtime rebuilt from it: what the AOT cache (kept on
disk by the compiler's pipeline, compiler/aot_cache.py) stores, so that a new process skips
tracing and partitioning and only rebuilds the runtime wrappers around compiled graphs.

``describe`` returns None for a compile whose runtime holds more than plain data can say
here: input transforms (duplicated or aliased inputs, functionalized RNG), tensor subclasses,
outputs that are views (their view replays), or symbolic sizes. Such compiles are simply
traced again; their compiled graphs still come from the compiled-graph cache.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

from .runtime import make_inference_runtime, make_training_runtime
from .schemas import InputInfo, OutputInfo, OutputKind, StridedLayout, ViewAndMutationMeta

FORMAT = 1
_INPUT_FLAGS = ("is_tensor", "requires_grad", "requires_grad_after", "mutates_data", "mutates_metadata",
                "mutations_under_no_grad", "mutations_hidden_from_autograd", "mutation_kept_in_graph")


class NotDescribable(Exception):
    """The compile's runtime needs more than plain data (the reason says what)."""


def with_plan(wrapped: Callable, run: Callable, meta: ViewAndMutationMeta, transforms: Sequence,
              subclasses: Any) -> Callable:
    """``wrapped`` (the compile's callable) carrying its plan as ``aot_plan``, or None and the
    reason as ``aot_plan_missing``. Describing never fails the compile."""
    try:
        plan, missing = describe(run, meta, transforms, subclasses), None
    except NotDescribable as reason:
        plan, missing = None, str(reason)
    except Exception as error:  # noqa: BLE001  a cache costs time, never the compile
        plan, missing = None, f"describing it failed: {type(error).__name__}: {error}"
    if not hasattr(wrapped, "__dict__"):  # (a callable that takes no attributes)
        wrapped = functools.wraps(wrapped)(lambda *args, _call=wrapped: _call(*args))
    wrapped.aot_plan, wrapped.aot_plan_missing = plan, missing
    return wrapped


def describe(run: Callable, meta: ViewAndMutationMeta, transforms: Sequence, subclasses: Any) -> dict:
    """The plain description of a compile whose runtime wrapper is ``run``; raises
    NotDescribable with the reason when there is none."""
    if transforms:
        raise NotDescribable(f"its inputs are transformed ({', '.join(type(t).__name__ for t in transforms)})")
    if subclasses is not None:
        raise NotDescribable("it has tensor-subclass inputs or outputs")
    if getattr(meta, "custom_function_aliases", None):
        raise NotDescribable("a custom autograd.Function returns a view of its input")
    parameters = getattr(run, "runtime_parameters", None)
    if parameters is None:
        raise NotDescribable("its runtime does not say how it was built")
    inputs = []
    for info in meta.input_info:
        described = {flag: bool(getattr(info, flag)) for flag in _INPUT_FLAGS}
        described["layout_after"] = _layout(info.layout_after)
        inputs.append(described)
    outputs = []
    for info in meta.output_info:
        if info.kind not in (OutputKind.NOT_ALIAS, OutputKind.IS_INPUT):
            raise NotDescribable("an output is a view (its view replay is not plain data)")
        outputs.append(dict(kind=info.kind.name, is_tensor=bool(info.is_tensor), requires_grad=bool(info.requires_grad),
                            base_index=info.base_index, layout=_layout(info.layout)))
    return dict(format=FORMAT, training=bool(meta.is_training), inputs=inputs, outputs=outputs,
                num_intermediate_bases=meta.num_intermediate_bases, runtime=dict(parameters))


def _layout(layout: Optional[StridedLayout]) -> Optional[list]:
    if layout is None:
        return None
    if not layout.is_static:
        raise NotDescribable("a layout has symbolic sizes")
    return [list(layout.size), list(layout.stride), layout.storage_offset]


def _read_layout(value: Optional[list]) -> Optional[StridedLayout]:
    if value is None:
        return None
    size, stride, offset = value
    return StridedLayout(tuple(int(s) for s in size), tuple(int(s) for s in stride), int(offset))


def meta_of(plan: dict) -> ViewAndMutationMeta:
    inputs = [InputInfo(**{flag: bool(i[flag]) for flag in _INPUT_FLAGS}, layout_after=_read_layout(i["layout_after"]))
              for i in plan["inputs"]]
    outputs = [OutputInfo(OutputKind[o["kind"]], bool(o["is_tensor"]), bool(o["requires_grad"]),
                          None if o["base_index"] is None else int(o["base_index"]), layout=_read_layout(o["layout"]))
               for o in plan["outputs"]]
    if plan["num_intermediate_bases"]:
        raise ValueError("a plan with intermediate bases")
    return ViewAndMutationMeta(inputs, outputs, 0, [], is_training=bool(plan["training"]))


def rebuild(plan: dict, compiled: dict[str, Callable]) -> Callable:
    """The runtime wrapper (``run(args) -> user outputs``) of a described compile, around its
    compiled graphs (``compiled``: "forward" and "backward", or "inference")."""
    if plan.get("format") != FORMAT:
        raise ValueError(f"a plan of format {plan.get('format')!r}, not {FORMAT}")
    meta = meta_of(plan)
    parameters = plan["runtime"]
    if not meta.is_training:
        return make_inference_runtime(compiled["inference"], meta, [])
    backward = compiled["backward"]
    return make_training_runtime(
        compiled["forward"], None, lambda gm, example_inputs: backward, meta, [],
        int(parameters["num_saved_tensors"]), int(parameters["num_saved_symints"]),
        [int(i) for i in parameters["clone_saved"]], [int(i) for i in parameters["mutated_in_backward"]])
