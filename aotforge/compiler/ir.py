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

from .ops import ops

Expr = sympy.Expr


# --- integer index arithmetic -------------------------------------------------------------

class FloorDiv(sympy.Function):
    """``a // b`` for non-negative integer index expressions."""

    is_integer = True
    nargs = (2,)

    @classmethod
    def eval(cls, base, divisor):
        if divisor == 1:
            return base
        if base == 0:
            return sympy.Integer(0)
        if base.is_Integer and divisor.is_Integer:
            return sympy.Integer(int(base) // int(divisor))
        if isinstance(base, FloorDiv):  # (a // b) // c == a // (b*c)
            return FloorDiv(base.args[0], base.args[1] * divisor)
        # (c*k + r) // k == c + r // k when k divides c (k may be symbolic: s0*32)
        if base.is_Add:
            whole = [t for t in base.args if _divides(divisor, t)]
            if whole:
                rest = [t for t in base.args if not _divides(divisor, t)]
                return sympy.Add(*[t / divisor for t in whole]) + FloorDiv(sympy.Add(*rest), divisor)
        if base.is_Mul and _divides(divisor, base):
            return base / divisor
        return None


def _divides(divisor: Expr, term: Expr) -> bool:
    """Whether ``term / divisor`` is a product with integer coefficient (no division left)."""
    if divisor.is_Integer:
        coefficient = term.as_coeff_Mul()[0]
        return coefficient.is_Integer and int(coefficient) % int(divisor) == 0
    quotient = term / divisor
    numerator, denominator = sympy.fraction(quotient)
    return denominator == 1 and quotient.as_coeff_Mul()[0].is_Integer


class ModularIndexing(sympy.Function):
    """``(a // d) % m`` for non-negative integer index expressions."""

    is_integer = True
    nargs = (3,)

    @classmethod
    def eval(cls, base, divisor, modulus):
        if modulus == 1 or base == 0:
            return sympy.Integer(0)
        if base.is_Integer and divisor.is_Integer and modulus.is_Integer:
            return sympy.Integer((int(base) // int(divisor)) % int(modulus))
        # whole multiples of divisor*modulus never change the result
        if base.is_Add:
            period = divisor * modulus
            kept = [t for t in base.args if not _divides(period, t)]
            if len(kept) < len(base.args):
                return ModularIndexing(sympy.Add(*kept), divisor, modulus)
        return None


def sympify_size(values: Sequence[Any]) -> list[Expr]:
    """Sizes as sympy expressions (a ``SymInt`` becomes its expression, never its value)."""
    from .sizes import to_expr

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
    """One tensor output of an ATen call made by the wrapper."""

    def __init__(self, name, layout, dtype, device, call: "ExternCall", output_index: Optional[int]):
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

@dataclasses.dataclass
class PointwiseBody:
    ranges: list[Expr]
    fn: Callable[[list[Expr]], Any]  # index -> ops value; the value is stored at the layout


@dataclasses.dataclass
class ReductionBody:
    ranges: list[Expr]  # kept dimensions (the buffer's size)
    reduction_ranges: list[Expr]
    reduction_type: str  # sum, prod, max, min, argmax, argmin, any, all
    fn: Callable[[list[Expr], list[Expr]], Any]
    source_dtype: torch.dtype  # dtype of the reduced values (accumulation type follows it)


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

    def make_loader(self):
        return self.fn

    def __repr__(self) -> str:
        return f"Pointwise({_ints_text(self.size)}, {self.dtype})"


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

@dataclasses.dataclass(frozen=True)
class LoweredGraph:
    """A graph in loop IR: its inputs, its operations in program order (``ComputedBuffer``s
    and ``ExternCall``s) and its outputs. Printed, each computed buffer shows its body::

        buf0: f32[16] = sum over [64] of (i0 | r0):
            t0 = load(arg0_1, r0 + 64*i0)
            -> t0
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


_SHORT_DTYPE = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
                torch.uint8: "u8", torch.bool: "b8"}


def short_dtype(dtype: torch.dtype) -> str:
    return _SHORT_DTYPE.get(dtype, str(dtype).replace("torch.", ""))


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


def describe_operation(op: Any) -> list[str]:
    """The lines that print one operation of a ``LoweredGraph``."""
    from .ops import BodyPrinter, use_handler

    if isinstance(op, ExternCall):
        target = str(op.op) if isinstance(op.op, torch._ops.OpOverload) else getattr(op.op, "__name__", str(op.op))
        arguments = [describe_value(a) for a in op.args] + [f"{k}={describe_value(v)}" for k, v in op.kwargs.items()]
        results = ", ".join(describe_buffer(o) if o is not None else "None" for o in op.outputs)
        return [f"{op.name} = {target}({', '.join(arguments)}) -> {results}"]
    body, printer = op.body, BodyPrinter()
    index = index_symbols("i", len(body.ranges))
    with use_handler(printer):
        if isinstance(body, ReductionBody):
            reduction_index = index_symbols("r", len(body.reduction_ranges))
            result = body.fn(index, reduction_index)
            head = (f"{body.reduction_type} over {_ints_text(body.reduction_ranges)} of "
                    f"({', '.join(map(str, index))} | {', '.join(map(str, reduction_index))})")
        else:
            result = body.fn(index)
            head = f"pointwise over {_ints_text(body.ranges)} ({', '.join(map(str, index))})"
    target = describe_buffer(op) if op.mutates is None else f"{op.name} (written in place): {describe_buffer(op)}"
    return [f"{target} = {head}:"] + ["    " + line for line in printer.lines] + [f"    -> {result}"]
