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
here: duplicated or aliased inputs (their input transforms), tensor subclasses, custom
autograd.Functions returning views of inputs, inputs whose storage is resized or swapped, and
views whose replay is a Python function of a subclass. Such compiles are simply traced again;
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
    if subclasses is not None:
        raise NotDescribable("it has tensor-subclass inputs or outputs")
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
                rng=_rng(random[0]) if random else None, runtime=_plain(dict(parameters)))


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
    if not meta.is_training:
        run = make_inference_runtime(compiled["inference"], meta, traced)
    else:
        backward = compiled["backward"]
        run = make_training_runtime(
            compiled["forward"], None, lambda gm, example_inputs: backward, meta, traced,
            int(parameters["num_saved_tensors"]), int(parameters["num_saved_symints"]),
            [int(i) for i in parameters["clone_saved"]], list(parameters["mutated_in_backward"]))
    return apply_post_compile(run, transforms)
