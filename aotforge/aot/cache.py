"""An AOT compile as plain data, and the runtime rebuilt from it: what the AOT cache (kept on
disk by the compiler's pipeline, compiler/aot_cache.py) stores, so that a new process skips
tracing and partitioning and only rebuilds the runtime wrappers around compiled graphs.

The plan holds the runtime's metadata (per input: its mutations; per output: what it aliases,
with the view ops that regenerate an aliased output), the sizes and strides of the traced
inputs as text (a runtime with symbolic sizes binds its size symbols from the call's inputs),
and the functionalized RNG's runtime half (its scheme, and for the philox scheme the draws
whose effect on the generator is replayed per call). JSON only: ops by name, dtypes by name,
sizes as ints or sympy text, never pickled objects.

``describe`` returns None for a compile whose runtime holds more than plain data can say
here: duplicated or aliased inputs (their input transforms), tensor subclasses of symbolic
size or with a flatten context that is not plain data (those of static size are described by
their layouts: class, context, inner attributes), custom autograd.Functions returning views of
inputs, inputs whose storage is resized or swapped, and views whose replay is a Python
function of a subclass. Such compiles are simply traced again;
their compiled graphs still come from the compiled-graph cache.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import sympy
import torch

from .input_analysis import apply_post_compile
from .metadata import ContractMeta
from .rng import RandomOps
from .runtime import make_inference_runtime, make_training_runtime
from .schemas import InputInfo, OutputInfo, OutputKind, StridedLayout, TracedSizes
from .view_replay import ViewReplay, ViewStep

FORMAT = 2  # 2: RNG, aliased outputs with their view replays, symbolic sizes
_INPUT_FLAGS = ("is_tensor", "requires_grad", "requires_grad_after", "mutates_data", "mutates_metadata",
                "mutations_under_no_grad", "mutations_hidden_from_autograd", "mutation_kept_in_graph")


# The AOT cache of aot_function's compiles: compiler/aot_cache.py sets it when aotforge's
# compiler loads; ``function_cache(flat_fn, flat_args, config, is_training, compile)``.
function_cache: Optional[Callable] = None


class NotDescribable(Exception):
    """The compile's runtime needs more than plain data (the reason says what)."""


def with_plan(wrapped: Callable, run: Callable, meta: Any, transforms: Sequence, subclasses: Any,
              fake_args: Sequence = ()) -> Callable:
    """``wrapped`` (the compile's callable) carrying its plan as ``aot_plan``, or None and the
    reason as ``aot_plan_missing``. ``fake_args``: the inputs the runtime was built for (their
    symbolic sizes). Describing never fails the compile."""
    try:
        plan, missing = describe(run, meta, transforms, subclasses, fake_args), None
    except NotDescribable as reason:
        plan, missing = None, str(reason)
    except Exception as error:  # noqa: BLE001  a cache costs time, never the compile
        plan, missing = None, f"describing it failed: {type(error).__name__}: {error}"
    if not hasattr(wrapped, "__dict__"):  # (a callable that takes no attributes)
        wrapped = functools.wraps(wrapped)(lambda *args, _call=wrapped: _call(*args))
    wrapped.aot_plan, wrapped.aot_plan_missing = plan, missing
    return wrapped


def describe(run: Callable, meta: Any, transforms: Sequence, subclasses: Any, fake_args: Sequence = ()) -> dict:
    """The plain description of a compile whose runtime wrapper is ``run``; raises
    NotDescribable with the reason when there is none."""
    others = [type(t).__name__ for t in transforms if not isinstance(t, RandomOps)]
    if others:
        raise NotDescribable(f"its inputs are transformed ({', '.join(others)})")
    subclass_plan = None if subclasses is None else _subclasses(subclasses)
    if getattr(meta, "custom_function_aliases", None):
        raise NotDescribable("a custom autograd.Function returns a view of its input")
    parameters = getattr(run, "runtime_parameters", None)
    if parameters is None:
        raise NotDescribable("its runtime does not say how it was built")
    inputs = []
    for info in meta.input_info:
        if info.storage_swapped or info.storage_nbytes_before is not None or info.storage_nbytes_after is not None:
            raise NotDescribable("an input's storage is resized or swapped")
        described = {flag: bool(getattr(info, flag)) for flag in _INPUT_FLAGS}
        described["layout_after"] = _layout(info.layout_after)
        inputs.append(described)
    outputs = [dict(kind=info.kind.name, is_tensor=bool(info.is_tensor), requires_grad=bool(info.requires_grad),
                    base_index=info.base_index, base_is_user_output=bool(info.base_is_user_output),
                    layout=_layout(info.layout), base_layout=_layout(info.base_layout),
                    multi_output_view=bool(info.multi_output_view))
               for info in meta.output_info]
    replays = list(getattr(meta, "view_replays", None) or [None] * len(outputs))
    random = [t for t in transforms if isinstance(t, RandomOps)]
    return dict(format=FORMAT, training=bool(meta.is_training), inputs=inputs, outputs=outputs,
                num_intermediate_bases=meta.num_intermediate_bases,
                intermediate_base_requires_grad=[bool(r) for r in meta.intermediate_base_requires_grad],
                view_replays=[_replay(r) for r in replays], traced=[_traced(a) for a in fake_args],
                rng=_rng(random[0]) if random else None, runtime=_plain(dict(parameters)),
                subclasses=subclass_plan)


# --- plain values: JSON with tagged objects ---------------------------------------------------------

def _plain(value: Any) -> Any:
    """``value`` as JSON data: tuples, dicts, dtypes, devices, layouts and sympy expressions as
    one-key tagged objects (lists and scalars as themselves)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_plain(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _plain(v) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {"torch": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.SymInt):
        value = value.node.expr
    if isinstance(value, sympy.Basic):
        if value.is_Integer:
            return int(value)
        return {"expr": str(value)}
    raise NotDescribable(f"its runtime holds a {type(value).__name__}")


def _unplain(value: Any, symbols: "Symbols") -> Any:
    if isinstance(value, list):
        return [_unplain(v, symbols) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, inner), = value.items()
    if tag == "tuple":
        return tuple(_unplain(v, symbols) for v in inner)
    if tag == "dict":
        return {k: _unplain(v, symbols) for k, v in inner.items()}
    if tag == "dtype":
        return _torch_attribute(inner, torch.dtype)
    if tag == "torch":
        return _torch_attribute(inner, (torch.layout, torch.memory_format))
    if tag == "device":
        return torch.device(inner)
    if tag == "expr":
        return symbols.expr(inner)
    raise ValueError(f"unknown tagged value {tag!r}")


def _torch_attribute(name: str, kind: Any) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise ValueError(f"torch.{name} is not a {kind}")
    return value


class Symbols:
    """The size symbols of one rebuilt plan, by name: every expression of the plan refers to
    the same Symbol objects (sympy compares symbols by name and assumptions)."""

    def __init__(self) -> None:
        self.table: dict[str, sympy.Symbol] = {}
        self._functions: Optional[dict] = None

    def expr(self, text: str) -> Any:
        if self._functions is None:
            import torch.utils._sympy.functions as functions

            self._functions = {k: v for k, v in vars(functions).items()
                               if isinstance(v, type) and issubclass(v, sympy.Basic)}
        parsed = sympy.sympify(text, locals=self._functions)
        replace = {s: self.table.setdefault(s.name, sympy.Symbol(s.name, integer=True, positive=True))
                   for s in parsed.free_symbols}
        result = parsed.xreplace(replace)
        return int(result) if result.is_Integer else result


# --- pieces of the plan ------------------------------------------------------------------------------

def _layout(layout: Optional[StridedLayout]) -> Optional[list]:
    if layout is None:
        return None
    return [_plain(list(layout.size)), _plain(list(layout.stride)), _plain(layout.storage_offset)]


def _read_layout(value: Optional[list], symbols: Symbols) -> Optional[StridedLayout]:
    if value is None:
        return None
    size, stride, offset = (_unplain(v, symbols) for v in value)
    return StridedLayout(tuple(size), tuple(stride), offset)


def _replay(replay: Optional[ViewReplay]) -> Optional[dict]:
    if replay is None:
        return None
    if replay.view_function is not None:
        raise NotDescribable("an output is a view of a tensor subclass (its replay is a function)")
    steps = None if replay.steps is None else [[s.kind, _plain(s.arguments)] for s in replay.steps]
    return dict(steps=steps, layout=_layout(replay.layout), dtype=_plain(replay.dtype), is_conj=bool(replay.is_conj),
                is_neg=bool(replay.is_neg), requires_grad=bool(replay.requires_grad),
                made_under_no_grad=bool(replay.made_under_no_grad))


def _read_replay(value: Optional[dict], symbols: Symbols) -> Optional[ViewReplay]:
    if value is None:
        return None
    steps = None if value["steps"] is None else tuple(
        ViewStep(str(kind), _unplain(arguments, symbols)) for kind, arguments in value["steps"])
    return ViewReplay(steps, _read_layout(value["layout"], symbols), _unplain(value["dtype"], symbols),
                      bool(value["is_conj"]), bool(value["is_neg"]), bool(value["requires_grad"]),
                      bool(value["made_under_no_grad"]))


def _traced(value: Any) -> Any:
    """A traced input's sizes, strides and offset (what binds the size symbols at run time)."""
    if isinstance(value, torch.Tensor):
        return _plain([*value.shape, *value.stride(), value.storage_offset()])
    if isinstance(value, torch.SymInt):
        return {"symint": _plain(value)}
    return None


def _read_traced(value: Any, symbols: Symbols) -> Any:
    if isinstance(value, dict):
        return TracedSizes((_unplain(value["symint"], symbols),), symint=True)
    return None if value is None else TracedSizes(tuple(_unplain(value, symbols)))


def _rng(random: RandomOps) -> dict:
    """The runtime half of functionalized RNG. The eager scheme's graphs save and restore the
    generator's state themselves (nothing to do per call); the philox scheme feeds a seed
    derived from the generator and advances it by the draws' count."""
    draws = [dict(op=[op.namespace, op._schema.name.split("::")[1], op._overloadname], spec=_plain(spec),
                  numel=int(numel), dtype=_plain(dtype)) for op, spec, numel, dtype in random.philox_draws]
    return dict(scheme=random.scheme, device=str(random.device), draws=draws)


def _read_rng(value: dict, symbols: Symbols) -> RandomOps:
    random = RandomOps()
    random.functionalized = True
    random.scheme, random.device = str(value["scheme"]), torch.device(value["device"])
    for draw in value["draws"]:
        namespace, name, overload = draw["op"]
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        random.philox_draws.append((op, _unplain(draw["spec"], symbols), int(draw["numel"]),
                                    _unplain(draw["dtype"], symbols)))
    return random


def meta_of(plan: dict, symbols: Optional[Symbols] = None) -> ContractMeta:
    symbols = symbols or Symbols()
    inputs = [InputInfo(**{flag: bool(i[flag]) for flag in _INPUT_FLAGS},
                        layout_after=_read_layout(i["layout_after"], symbols))
              for i in plan["inputs"]]
    outputs = [OutputInfo(OutputKind[o["kind"]], bool(o["is_tensor"]), bool(o["requires_grad"]),
                          None if o["base_index"] is None else int(o["base_index"]),
                          bool(o["base_is_user_output"]), _read_layout(o["layout"], symbols),
                          _read_layout(o["base_layout"], symbols), bool(o["multi_output_view"]))
               for o in plan["outputs"]]
    replays = [_read_replay(r, symbols) for r in plan["view_replays"]]
    if len(replays) != len(outputs):
        raise ValueError("a plan with a view replay per output")
    return ContractMeta(inputs, outputs, int(plan["num_intermediate_bases"]),
                        [bool(r) for r in plan["intermediate_base_requires_grad"]], is_training=bool(plan["training"]),
                        view_replays=replays)


def rebuild(plan: dict, compiled: dict[str, Callable]) -> Callable:
    """The runtime wrapper (``run(args) -> user outputs``) of a described compile, around its
    compiled graphs (``compiled``: "forward" and "backward", or "inference")."""
    if plan.get("format") != FORMAT:
        raise ValueError(f"a plan of format {plan.get('format')!r}, not {FORMAT}")
    symbols = Symbols()
    meta = meta_of(plan, symbols)
    traced = [_read_traced(t, symbols) for t in plan["traced"]]
    transforms = [] if plan["rng"] is None else [_read_rng(plan["rng"], symbols)]
    parameters = _unplain(plan["runtime"], symbols)
    subclasses = None if plan.get("subclasses") is None else _read_subclasses(plan["subclasses"])
    if not meta.is_training:
        inference = compiled["inference"]
        if subclasses is not None:  # the graph sees the inner tensors, the runtime the caller's subclasses
            inference = subclasses.post_compile(inference)
        run = make_inference_runtime(inference, meta, traced)
    else:
        forward, backward = compiled["forward"], compiled["backward"]
        if subclasses is not None:
            forward, backward = subclasses.post_compile(forward), subclasses.post_compile_backward(backward)
        run = make_training_runtime(
            forward, None, lambda gm, example_inputs: backward, meta, traced,
            int(parameters["num_saved_tensors"]), int(parameters["num_saved_symints"]),
            [int(i) for i in parameters["clone_saved"]], list(parameters["mutated_in_backward"]))
    return apply_post_compile(run, transforms)


# --- tensor subclasses: the layouts TensorSubclasses flattens and rebuilds them by --------------------
# Only static layouts (every outer and inner size an int), importable classes and flatten
# contexts that are plain data (TwoTensor's None; not a DTensor's spec). The inner tensors'
# meaning, the class's __torch_dispatch__, is the class's code: the caches' keys hold a digest
# of the module that defines it (compiler/runtime/graph_cache.py's input_description).

def _subclasses(subclasses: Any) -> dict:
    if not subclasses.is_static or not all(_static(layout) for layout in subclasses.input_layouts):
        raise NotDescribable("it has tensor-subclass inputs or outputs of symbolic size")
    if subclasses.has_duplicates:
        raise NotDescribable("a tensor-subclass input holds an inner tensor twice")
    leaves = []
    for tangent in subclasses.tangent_leaf_fakes if subclasses.tangent_layouts else []:
        if not all(isinstance(leaf, torch.Tensor) and all(isinstance(n, int) for n in leaf.shape) for leaf in tangent):
            raise NotDescribable("a tensor-subclass tangent holds more than tensors of static size")
        leaves.append([[list(leaf.shape), _plain(leaf.dtype)] for leaf in tangent])
    return dict(inputs=[_subclass_layout(x) for x in subclasses.input_layouts],
                outputs=[_subclass_layout(x) for x in subclasses.output_layouts],
                tangents=[_subclass_layout(x) for x in subclasses.tangent_layouts],
                grads=[_subclass_layout(x) for x in subclasses.grad_layouts],
                keep=[int(i) for i in subclasses.keep], tangent_leaves=leaves)


def _static(layout: Any) -> bool:
    return layout is None or not hasattr(layout, "is_static") or layout.is_static


def _subclass_layout(layout: Any) -> Any:
    from .subclasses import ConstantAttribute, SubclassLayout

    if layout is None:
        return None
    if isinstance(layout, ConstantAttribute):
        return {"constant": _plain(layout.value)}
    if not isinstance(layout, SubclassLayout) or layout.symbolic:
        raise NotDescribable(f"a tensor-subclass layout {layout!r} that plain data cannot say")
    cls = layout.cls
    if "<locals>" in cls.__qualname__ or _class(f"{cls.__module__}:{cls.__qualname__}") is not cls:
        raise NotDescribable(f"the tensor subclass {cls.__qualname__} cannot be imported by its name")
    return dict(cls=f"{cls.__module__}:{cls.__qualname__}", context=_plain(layout.context),
                attributes=[[str(name), _subclass_layout(child)] for name, child in layout.attributes],
                size=[int(n) for n in layout.size], stride=[int(n) for n in layout.stride],
                requires_grad=bool(layout.requires_grad))


def _class(name: str) -> Any:
    import importlib

    module, _, qualname = name.partition(":")
    try:
        value: Any = importlib.import_module(module)
        for part in qualname.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError):
        return None
    return value


def _read_subclass_layout(value: Any) -> Any:
    from .subclasses import ConstantAttribute, SubclassLayout

    if value is None:
        return None
    if "constant" in value:
        return ConstantAttribute(_unplain(value["constant"], Symbols()))
    cls = _class(value["cls"])
    if not isinstance(cls, type) or not issubclass(cls, torch.Tensor) or not hasattr(cls, "__tensor_unflatten__"):
        raise ValueError(f"{value['cls']} is not a tensor subclass here")
    return SubclassLayout(cls, _unplain(value["context"], Symbols()),
                          tuple((str(name), _read_subclass_layout(child)) for name, child in value["attributes"]),
                          tuple(int(n) for n in value["size"]), tuple(int(n) for n in value["stride"]),
                          bool(value["requires_grad"]))


def _read_subclasses(value: dict) -> Any:
    """A TensorSubclasses wrapper with what its post_compile halves read (static layouts)."""
    from .subclasses import TensorSubclasses, num_leaves

    subclasses = TensorSubclasses.__new__(TensorSubclasses)
    subclasses.input_layouts = [_read_subclass_layout(x) for x in value["inputs"]]
    subclasses.output_layouts = [_read_subclass_layout(x) for x in value["outputs"]]
    subclasses.tangent_layouts = [_read_subclass_layout(x) for x in value["tangents"]]
    subclasses.grad_layouts = [_read_subclass_layout(x) for x in value["grads"]]
    subclasses.keep = [int(i) for i in value["keep"]]
    subclasses.source = list(range(len(subclasses.keep)))
    subclasses.has_duplicates = False
    subclasses.plain_fake_args = []  # (read for symbolic sizes only)
    subclasses.num_plain_outputs = sum(num_leaves(layout) for layout in subclasses.output_layouts)
    subclasses.is_static = True
    subclasses.tangent_leaf_fakes = [
        [torch.empty(shape, dtype=_unplain(dtype, Symbols()), device="meta") for shape, dtype in tangent]
        for tangent in value["tangent_leaves"]]
    return subclasses
