"""The loop-level IR: tensors as functions of a symbolic index.

A value in this IR is one of

* ``Pointwise(size, dtype, device, fn)``: lazy; ``fn(index)`` computes one element through
  the ``ops`` handler (see ``ops.py``). Nothing is stored until it is *realized*.
* ``StorageView(buffer, size, stride, offset)``: a strided window on a realized buffer.
  Views (permute, expand, slice, unsqueeze, ...) are new index maps over the same storage,
  never copies.

Buffers are what the wrapper allocates: graph inputs, ``ComputedBuffer`` (a pointwise or
reduction body that a Triton kernel computes), ``ExternBuffer`` (the output of an ATen call).

Index expressions are sympy expressions over integer symbols. Two functions keep integer
division readable and comparable: ``FloorDiv(a, b)`` and ``ModularIndexing(a, d, m)``
(``(a // d) % m``)::

    x: f32[4, 8] (contiguous), y = x.permute(1, 0)
    y.make_loader()([i0, i1])  ->  ops.load("arg0", i0 + 8*i1)
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, Optional, Sequence

import sympy
import torch

from .body import Code, capture, replay
from .dtypes import short_dtype
from .expr import ModularIndexing
from .ops import BodyPrinter, current_handler, ops
from .sizes import to_expr

Expr = sympy.Expr


def sympify_size(values: Sequence[Any]) -> list[Expr]:
    """Sizes as sympy expressions (a ``SymInt`` becomes its expression, never its value)."""
    return [v if isinstance(v, sympy.Expr) else to_expr(v) if isinstance(v, torch.SymInt) else sympy.Integer(int(v))
            for v in values]


def static_int(expr: Any) -> Optional[int]:
    """``expr`` as an int when it is a number, None when it is symbolic."""
    if isinstance(expr, int):
        return expr
    return int(expr) if getattr(expr, "is_Integer", False) else None


def same_size(a: Any, b: Any) -> bool:
    """Whether two size expressions are equal for every value of their symbols."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    return a == b or sympy.expand(a - b) == 0


def product(values: Sequence[Any]) -> Any:
    return functools.reduce(lambda a, b: a * b, values, sympy.Integer(1))


def contiguous_strides(size: Sequence[Any]) -> list[Expr]:
    strides, running = [], sympy.Integer(1)
    for dim in reversed(size):
        strides.append(running)
        running = running * dim
    return list(reversed(strides))


def strided_index(index: Sequence[Expr], stride: Sequence[Expr], offset: Expr = sympy.Integer(0)) -> Expr:
    return offset + sum((i * s for i, s in zip(index, stride)), sympy.Integer(0))


def unflatten_index(flat: Expr, size: Sequence[Expr]) -> list[Expr]:
    """The multi-dimensional index of position ``flat`` in a contiguous tensor of ``size``."""
    out, divisor = [], sympy.Integer(1)
    for dim in reversed(size):
        out.append(ModularIndexing(flat, divisor, dim) if dim != 1 else sympy.Integer(0))
        divisor = divisor * dim
    return list(reversed(out))


def index_symbols(prefix: str, count: int) -> list[sympy.Symbol]:
    return [sympy.Symbol(f"{prefix}{i}", integer=True, nonnegative=True) for i in range(count)]


@functools.lru_cache(maxsize=None)
def _symbols(prefix: str, count: int) -> tuple:
    return tuple(index_symbols(prefix, count))


# --- buffers -----------------------------------------------------------------------------

@dataclasses.dataclass
class Layout:
    size: list[Expr]
    stride: list[Expr]
    offset: Expr = sympy.Integer(0)

    def storage_numel(self) -> Expr:
        """Elements of storage the layout spans (an expression when sizes are symbolic)."""
        if any(s == 0 for s in self.size):
            return sympy.Integer(0)
        return sympy.expand(self.offset + 1 + sum(((n - 1) * s for n, s in zip(self.size, self.stride)),
                                                  sympy.Integer(0)))


class Buffer:
    """Something the wrapper holds in a named variable."""

    def __init__(self, name: str, layout: Layout, dtype: torch.dtype, device: torch.device):
        self.name, self.layout, self.dtype, self.device = name, layout, dtype, device

    def view(self) -> "StorageView":
        return StorageView(self, self.layout.size, self.layout.stride, self.layout.offset)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {self.dtype}, {_ints_text(self.layout.size)})"


class InputBuffer(Buffer):
    pass


class ComputedBuffer(Buffer):
    """A buffer whose elements a generated kernel computes from ``body``."""

    def __init__(self, name, layout, dtype, device, body: "Body", *, mutates: Optional[Buffer] = None):
        super().__init__(name, layout, dtype, device)
        self.body = body
        # set for writes into an existing buffer (``copy_`` into a graph input)
        self.mutates = mutates


class ExternBuffer(Buffer):
    """One tensor output of an ATen call made by the wrapper. ``output_index`` is its path in
    the call's result (``(1, 0)``: ``result[1][0]``), None for a call returning one tensor."""

    def __init__(self, name, layout, dtype, device, call: "ExternCall", output_index: Optional[tuple]):
        super().__init__(name, layout, dtype, device)
        self.call, self.output_index = call, output_index


@dataclasses.dataclass
class ExternCall:
    """``outputs = op(*args, **kwargs)`` run by the wrapper; tensors in args are Buffers or
    StorageViews (passed as strided views)."""

    name: str
    op: Any
    args: tuple
    kwargs: dict
    outputs: list = dataclasses.field(default_factory=list)  # ExternBuffer or None, per output
    # True when the op returns one tensor rather than a tuple
    single_output: bool = True


# --- bodies of computed buffers ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PointwiseBody:
    """``code`` computes the element at index ``(i0, i1, ...)`` over ``ranges``; the value is
    stored at the buffer's layout."""

    ranges: tuple
    code: Code

    @staticmethod
    def capture(ranges: Sequence[Expr], fn: Callable[[list[Expr]], Any]) -> "PointwiseBody":
        """The body of ``fn`` (index -> ops value), captured once (see body.py)."""
        return PointwiseBody(tuple(ranges), capture(fn, index_symbols("i", len(ranges))))

    def walk(self, handler: Any, index: Sequence[Expr], rindex: Sequence[Expr] = ()) -> Any:
        """The body through ``handler``, at ``index`` (expressions in the handler's variables)."""
        return replay(self.code, handler, dict(zip(_symbols("i", len(self.ranges)), index)))


@dataclasses.dataclass(frozen=True)
class ReductionBody:
    """``code`` computes the value at ``(i0, ... | r0, ...)`` that is reduced over the
    ``reduction_ranges`` for each index of ``ranges``."""

    ranges: tuple  # kept dimensions (the buffer's size)
    reduction_ranges: tuple
    reduction_type: str  # a kind of reduction_kinds.REDUCTIONS
    code: Code
    source_dtype: torch.dtype  # dtype of the reduced values (accumulation type follows it)

    @staticmethod
    def capture(ranges: Sequence[Expr], reduction_ranges: Sequence[Expr], reduction_type: str,
                fn: Callable[[list[Expr], list[Expr]], Any], source_dtype: torch.dtype) -> "ReductionBody":
        code = capture(fn, index_symbols("i", len(ranges)), index_symbols("r", len(reduction_ranges)))
        return ReductionBody(tuple(ranges), tuple(reduction_ranges), reduction_type, code, source_dtype)

    def walk(self, handler: Any, index: Sequence[Expr], rindex: Sequence[Expr] = ()) -> Any:
        mapping = dict(zip(_symbols("i", len(self.ranges)), index))
        mapping.update(zip(_symbols("r", len(self.reduction_ranges)), rindex))
        return replay(self.code, handler, mapping)


Body = Any  # PointwiseBody | ReductionBody


# --- values (what lowerings pass around) -----------------------------------------------------

class Value:
    size: list[Expr]
    dtype: torch.dtype
    device: torch.device

    def make_loader(self) -> Callable[[list[Expr]], Any]:
        raise NotImplementedError

    def numel(self) -> Expr:
        return product(self.size)


class Pointwise(Value):
    def __init__(self, size, dtype, device, fn):
        self.size, self.dtype, self.device, self.fn = sympify_size(size), dtype, device, fn
        self._load: Optional[Callable] = None

    def make_loader(self):
        if self._load is None:
            self._load = _read_once(self.fn)
        return self._load

    def __repr__(self) -> str:
        return f"Pointwise({_ints_text(self.size)}, {self.dtype})"


def _read_once(fn: Callable) -> Callable:
    """``fn`` (index -> ops value), called once per index in a body: a value its consumers
    read more than once is not computed again for each read. A chain of selects reads its
    previous value twice per link (max pooling's taps: ``where(tap > best, tap, best)``), so
    without this a window of n taps called the first tap's loader 2^(n-1) times: a 4 x 4
    pooling took 54 s to compile, ResNet-18's 3 x 3 ones 1.6 s a kernel. A value is shared
    within one handler's body and block (values recorded inside a masked block stay there)."""
    memo: dict = {}

    def load(index):
        handler = current_handler()
        scope = getattr(handler, "scope", None)  # (a handler's __getattr__ may make any name)
        key = (id(handler), scope if isinstance(scope, int) else None, tuple(index))
        hit = memo.get(key)
        if hit is not None and hit[0] is handler:
            return hit[1]
        value = fn(index)
        memo[key] = (handler, value)
        return value
    return load


class StorageView(Value):
    def __init__(self, buffer: Buffer, size, stride, offset=sympy.Integer(0)):
        self.buffer = buffer
        self.size, self.stride = sympify_size(size), sympify_size(stride)
        self.offset = sympy.sympify(offset)
        self.dtype, self.device = buffer.dtype, buffer.device

    def make_loader(self):
        name, stride, offset = self.buffer.name, self.stride, self.offset

        def load(index):
            return ops.load(name, strided_index([i for i, n in zip(index, self.size) if n != 1],
                                                [s for s, n in zip(stride, self.size) if n != 1], offset))
        return load

    def is_contiguous(self) -> bool:
        expected = contiguous_strides(self.size)
        return self.offset == 0 and all(n == 1 or s == e for n, s, e in zip(self.size, self.stride, expected))

    def __repr__(self) -> str:
        return f"StorageView({self.buffer.name}, {_ints_text(self.size)}, {_ints_text(self.stride)})"


def is_value(obj: Any) -> bool:
    return isinstance(obj, Value)


def counter(prefix: str) -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"{prefix}{next(numbers)}"


def dense_strides_like(size: Sequence[Any], stride: Sequence[Any], hint: Callable[[Any], int] = int) -> list[Expr]:
    """Strides of a dense tensor of ``size`` that orders dimensions as ``stride`` does (the
    layout eager would give a pointwise result of an input with that stride). ``hint`` gives
    a symbolic stride's example value, for the order."""
    order = sorted(range(len(size)), key=lambda d: (hint(stride[d]), -d))
    out, running = [sympy.Integer(0)] * len(size), sympy.Integer(1)
    for dim in order:
        out[dim] = running
        running = running * size[dim]
    return out


def is_non_overlapping_dense(size: Sequence[Any], stride: Sequence[Any], hint: Callable[[Any], int] = int) -> bool:
    dims = [d for d in range(len(size)) if size[d] != 1]
    dims.sort(key=lambda d: hint(stride[d]))
    expected = sympy.Integer(1)
    for d in dims:
        if not same_size(stride[d], expected):
            return False
        expected = expected * size[d]
    return True


def ceil_pow2(n: int) -> int:
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


# --- the lowered graph: what the lowering stage hands the scheduler ---------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class LoweredGraph:
    """A graph in loop IR: its inputs, its operations in program order (``ComputedBuffer``s
    and ``ExternCall``s) and its outputs. Printed, each computed buffer shows its body::

        buf0: f32[16] = sum over [64] of (i0 | r0):
            t0 = load(arg0_1, r0 + 64*i0)
            -> t0

    Graphs compare (and hash) by what they compute: ``key`` is every buffer, body, call and
    output as plain values (constants by identity); the lowering's statistics are left out.
    """

    inputs: tuple  # InputBuffer | None (a non-tensor input), per graph input
    constants: dict  # buffer name -> tensor (get_attr constants)
    constant_buffers: dict  # buffer name -> InputBuffer
    operations: tuple  # ComputedBuffer | ExternCall, in program order
    outputs: tuple  # StorageView | Python value, per graph output
    lowered_ops: dict  # op name -> count of nodes lowered to loop IR
    fallback_ops: dict  # op name -> count of nodes run as ATen calls
    lowering_errors: tuple  # lowerings that failed (a bug; the op ran through ATen)
    sizes: Any = None  # sizes.SizeVars: the symbols of symbolic sizes, their sources and hints

    @functools.cached_property
    def key(self) -> tuple:
        sizes = self.sizes
        return (tuple(_buffer_key(b) for b in self.inputs),
                tuple((_buffer_key(b), id(self.constants[name])) for name, b in self.constant_buffers.items()),
                tuple(_operation_key(op) for op in self.operations),
                _plain(self.outputs),
                (tuple(sizes.sources.items()), tuple(sorted(sizes.hints.items()))) if sizes is not None else None)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, LoweredGraph) and (self is other or self.key == other.key)

    def __hash__(self) -> int:
        return hash(self.key)

    def buffers(self) -> dict[str, Buffer]:
        """Every named buffer the program holds: inputs, constants, computed and extern outputs."""
        named: dict[str, Buffer] = {b.name: b for b in self.inputs if b is not None}
        named.update(self.constant_buffers)
        for op in self.operations:
            if isinstance(op, ExternCall):
                named.update({out.name: out for out in op.outputs if out is not None})
            elif op.mutates is None:
                named[op.name] = op
        return named

    def __str__(self) -> str:
        lines = [f"size {line}" for line in str(self.sizes).splitlines()] if getattr(self.sizes, "dynamic", False) else []
        lines += [f"input {describe_buffer(b)}" for b in self.inputs if b is not None]
        lines += [f"constant {describe_buffer(b)}" for b in self.constant_buffers.values()]
        for op in self.operations:
            lines += describe_operation(op)
        shown = [describe_value(v) for v in self.outputs]
        lines.append(f"return ({', '.join(shown)})")
        return "\n".join(lines) + "\n"


def _ints_text(values: Sequence[Any]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def describe_buffer(buffer: Buffer) -> str:
    layout = buffer.layout
    offset = f" offset {layout.offset}" if layout.offset != 0 else ""
    return f"{buffer.name}: {short_dtype(buffer.dtype)}{_ints_text(layout.size)} stride {_ints_text(layout.stride)}{offset}"


def describe_value(value: Any) -> str:
    if isinstance(value, StorageView):
        buffer = value.buffer
        if (list(value.size), list(value.stride), value.offset) == (list(buffer.layout.size),
                                                                     list(buffer.layout.stride), buffer.layout.offset):
            return buffer.name
        return f"view({buffer.name}, {_ints_text(value.size)}, {_ints_text(value.stride)}, {value.offset})"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(describe_value(v) for v in value) + ")"
    return repr(value)


def _buffer_key(buffer: Optional[Buffer]) -> Any:
    if buffer is None:
        return None
    layout = buffer.layout
    return (type(buffer).__name__, buffer.name, buffer.dtype, str(buffer.device),
            tuple(layout.size), tuple(layout.stride), layout.offset)


def _operation_key(op: Any) -> tuple:
    if isinstance(op, ExternCall):
        return ("extern", op.name, _plain(op.op), _plain(op.args), _plain(op.kwargs),
                tuple(_buffer_key(o) for o in op.outputs), op.single_output)
    mutates = op.mutates.name if op.mutates is not None else None
    return ("computed", _buffer_key(op), op.body, mutates)


def _plain(obj: Any) -> Any:
    """``obj`` (an argument or output of the graph) as a hashable value."""
    if isinstance(obj, StorageView):
        return ("view", obj.buffer.name, tuple(obj.size), tuple(obj.stride), obj.offset)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__,) + tuple(_plain(o) for o in obj)
    if isinstance(obj, dict):
        return ("dict",) + tuple((k, _plain(v)) for k, v in obj.items())
    if isinstance(obj, torch.device):
        return ("device", str(obj))
    if isinstance(obj, (bool, int, float)):  # 1, 1.0 and True promote differently
        return (type(obj).__name__, obj)
    try:
        hash(obj)
    except TypeError:
        return ("object", id(obj))
    return obj


def describe_operation(op: Any) -> list[str]:
    """The lines that print one operation of a ``LoweredGraph``."""
    if isinstance(op, ExternCall):
        target = str(op.op) if isinstance(op.op, torch._ops.OpOverload) else getattr(op.op, "__name__", str(op.op))
        arguments = [describe_value(a) for a in op.args] + [f"{k}={describe_value(v)}" for k, v in op.kwargs.items()]
        results = ", ".join(describe_buffer(o) if o is not None else "None" for o in op.outputs)
        return [f"{op.name} = {target}({', '.join(arguments)}) -> {results}"]
    body, printer = op.body, BodyPrinter()
    index = index_symbols("i", len(body.ranges))
    result = replay(body.code, printer, {})  # the record's own symbols: i0, ..., r0, ...
    if isinstance(body, ReductionBody):
        reduction_index = index_symbols("r", len(body.reduction_ranges))
        head = (f"{body.reduction_type} over {_ints_text(body.reduction_ranges)} of "
                f"({', '.join(map(str, index))} | {', '.join(map(str, reduction_index))})")
    else:
        head = f"pointwise over {_ints_text(body.ranges)} ({', '.join(map(str, index))})"
    target = describe_buffer(op) if op.mutates is None else f"{op.name} (written in place): {describe_buffer(op)}"
    return [f"{target} = {head}:"] + ["    " + line for line in printer.lines] + [f"    -> {result}"]
