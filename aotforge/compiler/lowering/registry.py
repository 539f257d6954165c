"""The table of lowerings (ATen op -> function building loop IR) and helpers they share."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Optional, Sequence

import sympy
import torch

from ..ir import Pointwise, Value, product
from ..ops import ops

LOWERINGS: dict[Any, Callable[..., Any]] = {}


class NotLowerable(Exception):
    """Raised by a lowering for an input it does not handle; the op then runs as an extern."""


def register(*ops_: Any, **params: Any) -> Callable[[Callable], Callable]:
    """Register one lowering for several ATen overloads (packets register every overload).
    ``params`` are keyword arguments the table binds for these ops, so that one function
    serves a family without asking which op it lowers (``register(aten.amax, kind="max")``)."""

    def decorate(fn: Callable) -> Callable:
        entry = functools.partial(fn, **params) if params else fn
        for op in ops_:
            if isinstance(op, torch._ops.OpOverloadPacket):
                for overload in op.overloads():
                    LOWERINGS[getattr(op, overload)] = entry
            else:
                LOWERINGS[op] = entry
        return fn
    return decorate


# --- what a lowering knows besides its arguments ------------------------------------------

@dataclasses.dataclass(frozen=True)
class LoweringContext:
    """Handed to every lowering as its first argument: the FX node being lowered (its fake
    value says the result's dtype, shape and device) and the graph being built, for the few
    lowerings that must give a value a buffer of its own (``realize``) or add a reduction."""

    node: torch.fx.Node
    graph: Any  # GraphLowering

    @property
    def op(self) -> Any:
        return self.node.target

    @property
    def value(self) -> Any:
        """The fake value the node produced (a tensor, or a tuple of them)."""
        return self.node.meta.get("val")

    def result_dtype(self, default: Optional[torch.dtype] = None) -> torch.dtype:
        val = self.value
        if isinstance(val, torch.Tensor):
            return val.dtype
        if isinstance(val, (tuple, list)) and val and isinstance(val[0], torch.Tensor):
            return val[0].dtype
        if default is None:
            raise NotLowerable("no dtype known for the node's result")
        return default

    def device(self, *args: Any) -> torch.device:
        """The device of the first tensor among ``args`` (lists searched), else the node's."""
        for arg in args:
            if isinstance(arg, Value):
                return arg.device
            if isinstance(arg, (list, tuple)):
                for item in arg:
                    if isinstance(item, Value):
                        return item.device
        if isinstance(self.value, torch.Tensor):
            return self.value.device
        raise NotLowerable("cannot tell the device")

    def hint(self, expr: Any) -> int:
        """A size's value in the example inputs: for choices that affect speed only."""
        return self.graph.sizes.hint(expr)

    def realize(self, value: Value, stride_hint: Optional[list] = None) -> Any:
        return self.graph.realize(value, stride_hint)


# --- dtypes --------------------------------------------------------------------------------

def promoted_dtype(*args: Any, kind: str = "DEFAULT") -> tuple[torch.dtype, torch.dtype]:
    """torch's type promotion over lowered values and Python scalars: (compute, result)."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    proxies = []
    for arg in args:
        if isinstance(arg, Value):
            proxies.append(torch.empty([1] * len(arg.size), dtype=arg.dtype, device="meta"))
        elif isinstance(arg, (bool, int, float)):
            proxies.append(arg)
        elif isinstance(arg, sympy.Expr):  # a symbolic size used as a number
            proxies.append(1)
    if not proxies:
        raise NotLowerable("no operands")
    return elementwise_dtypes(*proxies, type_promotion_kind=getattr(ELEMENTWISE_TYPE_PROMOTION_KIND, kind))


# --- shapes --------------------------------------------------------------------------------

def broadcast_shapes(*shapes: Sequence[sympy.Expr]) -> list[sympy.Expr]:
    rank = max((len(s) for s in shapes), default=0)
    out: list[sympy.Expr] = [sympy.Integer(1)] * rank
    for shape in shapes:
        for i, dim in enumerate(shape):
            position = rank - len(shape) + i
            if dim != 1:
                if out[position] != 1 and out[position] != dim:
                    raise NotLowerable(f"shapes {shapes} do not broadcast")
                out[position] = dim
    return out


def broadcast_loader(value: Any, size: Sequence[sympy.Expr], dtype: torch.dtype) -> Callable:
    """A loader over ``size`` that reads ``value`` broadcast to it, converted to ``dtype``."""
    if not isinstance(value, Value):
        return lambda index: ops.constant(value, dtype)
    inner = value.make_loader()
    skip = len(size) - len(value.size)
    own = value.size
    source_dtype = value.dtype

    def load(index):
        mapped = [sympy.Integer(0) if own[d] == 1 else index[skip + d] for d in range(len(own))]
        result = inner(mapped)
        return ops.to_dtype(result, dtype, source_dtype) if source_dtype != dtype else result
    return load


def to_dtype(value: Value, dtype: torch.dtype) -> Value:
    if value.dtype == dtype:
        return value
    loader, source = value.make_loader(), value.dtype
    return Pointwise(value.size, dtype, value.device, lambda index: ops.to_dtype(loader(index), dtype, source))


def normalize_dim(dim: int, rank: int) -> int:
    if rank == 0:
        if dim not in (0, -1):
            raise NotLowerable(f"dim {dim} out of range for a 0-d tensor")
        return 0
    if not -rank <= dim < rank:
        raise NotLowerable(f"dim {dim} out of range for rank {rank}")
    return dim % rank


def as_value(obj: Any) -> Value:
    if not isinstance(obj, Value):
        raise NotLowerable(f"expected a tensor, got {type(obj).__name__}")
    return obj


def static_ints(values: Iterable[Any]) -> list[int]:
    """Integer arguments that must be numbers (a symbolic one: the op runs as an ATen call)."""
    out = []
    for v in values:
        if isinstance(v, sympy.Expr) and not v.is_Integer:
            raise NotLowerable(f"this lowering needs a static value, got the symbolic size {v}")
        out.append(int(v))
    return out


def static(value: Any) -> int:
    return static_ints([value])[0]


def size_exprs(values: Iterable[Any]) -> list[sympy.Expr]:
    """Size arguments (ints, or expressions of symbolic sizes) as sympy expressions."""
    return [v if isinstance(v, sympy.Expr) else sympy.Integer(int(v)) for v in values]


def numel(value: Value) -> Any:
    return product(value.size)

