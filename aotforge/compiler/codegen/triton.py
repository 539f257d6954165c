"""Triton code generation for one fused kernel (a ``KernelGroup``).

Three shapes of kernel:

* pointwise: one program handles ``XBLOCK`` elements (``xindex``);
* persistent reduction: ``XBLOCK`` rows, each row's ``rnumel`` elements in registers at
  once (``rindex = tl.arange(0, RBLOCK)``); every reduction of the kernel, and every
  elementwise epilogue, works on those registers, so a row is read from memory once;
* looped reduction: rows too long for registers are walked in ``RBLOCK`` chunks; a value
  that needs a finished reduction starts a new loop (values from an earlier loop are
  recomputed, never reloaded).

Values are computed in float32 for half types (loads upcast, stores downcast). Everything a
body computes goes through ``ops``, which this handler turns into one line per value, with
common subexpressions shared.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import re
from typing import Any, Optional

import sympy
import torch

from ...config import config
from ..indexing import RINDEX, XINDEX, node_indices, simplify_index, store_index
from ..ir import FloorDiv, ModularIndexing, ReductionBody
from ..ops import use_handler
from ..schedule import BufferReads, KernelGroup, KernelPlan
from ..ir import LoweredGraph
from ..sizes import SIZE_SYMBOL_NAME, is_size_symbol
from .triton_ops import ARITHMETIC, HELPERS, PREDICATES, TRITON_DTYPE, spell

INT32_MAX = 2**31 - 1


@dataclasses.dataclass
class Var:
    name: str
    dtype: torch.dtype  # dtype as held in registers (half types are held as float32)
    level: int  # 0: same for every element, 1: varies with xindex only, 2: varies with rindex

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """One kernel's Triton source. Parameters are named by position (``in_ptr0``, ...) and the
    kernel by a hash of its text, so that structurally identical kernels (the same layer
    repeated, the forward of one graph and the backward of another) have identical sources
    and compile once."""

    group: str  # the kernel group this source computes (``kernel3``)
    name: str  # ``aot_<kind>_<hash of the source>``
    source: str  # one @triton.jit function, without the decorator
    arguments: tuple  # buffer names passed for the parameters, in order
    dtypes: tuple  # the dtype of each of those buffers
    numel: Any  # the kernel's sizes: ints, or expressions of the graph's size symbols
    rnumel: Any
    kind: str  # pointwise | persistent | looped
    mutates: bool
    reduction_contiguous: bool  # the reduced axis is the fastest-moving in memory
    # symbolic sizes: the symbol passed for each ``ks<i>`` parameter, then xnumel and rnumel
    # (the wrapper passes their values at each launch); their hints choose block sizes
    size_symbols: tuple = ()
    hints: tuple = ()  # hint of each size symbol, then of numel and rnumel
    int64: bool = False  # index arithmetic in 64 bits

    @property
    def dynamic(self) -> bool:
        """Whether the wrapper passes sizes at each launch (a size or an index uses a symbol)."""
        return bool(self.size_symbols) or not (sympy.sympify(self.numel).is_Integer
                                               and sympy.sympify(self.rnumel).is_Integer)


def held_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@functools.lru_cache(maxsize=65536)
def texpr(expr: sympy.Expr) -> str:
    """Print an index expression as Triton code."""
    if isinstance(expr, sympy.Symbol):
        return expr.name
    if isinstance(expr, sympy.Integer):
        return str(int(expr))
    if isinstance(expr, FloorDiv):
        return f"({_atom(expr.args[0])} // {_atom(expr.args[1])})"
    if isinstance(expr, ModularIndexing):
        base, divisor, modulus = expr.args
        inner = _atom(base) if divisor == 1 else f"({_atom(base)} // {_atom(divisor)})"
        return f"({inner} % {_atom(modulus)})"
    if isinstance(expr, sympy.Add):
        return " + ".join(texpr(a) for a in sorted(expr.args, key=str))
    if isinstance(expr, sympy.Mul):
        return "*".join(texpr(a) if not isinstance(a, sympy.Add) else f"({texpr(a)})" for a in expr.args)
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
        return "*".join([_atom(expr.base)] * int(expr.exp))
    raise NotImplementedError(f"cannot print index expression {expr!r} ({type(expr).__name__})")


def _atom(expr: sympy.Expr) -> str:
    return f"({texpr(expr)})" if isinstance(expr, (sympy.Add, sympy.Mul, sympy.Pow)) else texpr(expr)


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if value != value:
            return "float('nan')"
        if value in (float("inf"), float("-inf")):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    return repr(int(value))


REDUCTION_IDENTITY = {"sum": 0, "prod": 1, "max": "low", "min": "high", "argmax": "low", "argmin": "high"}


class TritonKernel:
    """Generates the source of one kernel; the object is also the ``ops`` handler."""

    def __init__(self, group: KernelGroup, stored: set[str], buffer_numels: dict[str, int], hint=int):
        self.group = group
        self.stored = stored
        self.hint = hint
        self.numel, self.rnumel = group.numel, group.rnumel
        self.is_reduction = group.rnumel != 1
        # a row held in registers needs a block as long as the row: known only for static sizes
        self.persistent = (self.is_reduction and group.rnumel.is_Integer
                           and group.rnumel <= config.persistent_reduction_limit)
        self.members = {n.name: n for n in group.nodes if n.mutates is None}
        self.arguments: dict[str, str] = {}
        self.top: list[str] = []
        self.loop: Optional[list[str]] = None
        self.loop_prelude: list[str] = []
        self.loop_after: list[str] = []
        self.open_reductions: set[str] = set()
        self.cache_top: dict[str, Var] = {}
        self.cache_loop: dict[str, Var] = {}
        self.values_top: dict[tuple[str, str], Var] = {}
        self.values_loop: dict[tuple[str, str], Var] = {}
        self.symbol_levels: dict[str, int] = {}
        self.masks: list[Var] = []
        self.names = (f"tmp{i}" for i in itertools.count())
        # (symbolic sizes: by their hints; the wrapper checks each call's sizes against INT32_MAX
        # and runs the graph's ATen calls for a call that would overflow)
        limit = max([hint(self.numel * self.rnumel)] + list(buffer_numels.values()))
        self.int64 = limit > INT32_MAX

    # --- emitting lines -----------------------------------------------------------------

    def _emit(self, expression: str, dtype: torch.dtype, level: int) -> Var:
        in_loop = self.loop is not None and level == 2
        cache = self.cache_loop if in_loop else self.cache_top
        if expression in self.cache_top:
            return self.cache_top[expression]
        if expression in cache:
            return cache[expression]
        var = Var(next(self.names), dtype, level)
        (self.loop if in_loop else self.top).append(f"{var.name} = {expression}")
        cache[expression] = var
        return var

    def _level_of_index(self, index: sympy.Expr) -> int:
        level = 0
        for symbol in index.free_symbols:
            if symbol == RINDEX:
                level = 2
            elif symbol == XINDEX:
                level = max(level, 1)
            elif is_size_symbol(symbol):
                continue  # a kernel argument: the same for every element
            else:
                level = max(level, self.symbol_levels.get(symbol.name, 2))
        return level

    def _mask(self, level: int) -> Optional[str]:
        parts = {0: [], 1: ["xmask"], 2: ["xmask", "rmask"]}[level] if self.is_reduction else (["xmask"] if level else [])
        parts = parts + [m.name for m in self.masks]
        return " & ".join(parts) if parts else None

    def _block_index(self, index: sympy.Expr, level: int) -> str:
        """The index as a block of the full shape for its level: compiled Triton wants the
        pointer, the mask and the value of a load or store to have one shape."""
        if level == 0:
            return f"{texpr(index)} + tl.full({'[1, 1]' if self.is_reduction else '[1]'}, 0, tl.int32)"
        needed = {XINDEX, RINDEX} if (level == 2 and self.is_reduction) else {XINDEX}
        if needed <= index.free_symbols:
            return texpr(index)
        return f"{texpr(index)} + tl.full({self._shape(level)}, 0, tl.int32)"

    def _argument(self, name: str) -> str:
        """The kernel parameter for buffer ``name``: named by position, not by buffer."""
        return self.arguments.setdefault(name, f"ptr{len(self.arguments)}")

    def _shape(self, level: int) -> str:
        if not self.is_reduction:
            return "[XBLOCK]"
        return "[XBLOCK, RBLOCK]" if level == 2 else "[XBLOCK, 1]"

    # --- the ops handler ------------------------------------------------------------------

    def load(self, name: str, index: sympy.Expr) -> Var:
        index = simplify_index(index)
        key = (name, str(index))
        if key in self.values_top:
            return self.values_top[key]
        if self.loop is not None and key in self.values_loop:
            return self.values_loop[key]
        if name in self.members:
            return self._recompute(self.members[name], index)
        buffer_dtype = self.buffer_dtypes[name]
        level = max([self._level_of_index(index)] + [m.level for m in self.masks])
        varying = {s for s in index.free_symbols if not is_size_symbol(s)}
        if self.is_reduction and not self.masks and varying and varying <= {XINDEX, RINDEX}:
            # a row-invariant read (a weight indexed by rindex alone) loads one row's worth,
            # [1, RBLOCK], and broadcasts: no per-row copies of the same addresses
            parts = [m for m, symbol in (("xmask", XINDEX), ("rmask", RINDEX)) if symbol in varying]
            pointer = f"{self._argument(name)} + ({texpr(index)})"
            text = f"tl.load({pointer}, {' & '.join(parts)}, other=0)"
        else:
            mask = self._mask(level if level else 0)
            pointer = f"{self._argument(name)} + ({self._block_index(index, level)})"
            text = f"tl.load({pointer}, {mask}, other=0)" if mask else f"tl.load({pointer})"
        if held_dtype(buffer_dtype) != buffer_dtype:
            text += ".to(tl.float32)"
        return self._emit(text, held_dtype(buffer_dtype), level)

    def _recompute(self, buffer, index: sympy.Expr) -> Var:
        if isinstance(buffer.body, ReductionBody):
            raise AssertionError(f"reduction {buffer.name} read before it was computed")
        indices, _ = node_indices(buffer, self.numel, self.rnumel)
        return buffer.body.fn(indices)

    def constant(self, value: Any, dtype: torch.dtype) -> Var:
        if isinstance(value, sympy.Expr) and not value.is_Number:  # a symbolic size as a number
            return self.to_dtype(self.index_expr(value, torch.int64), dtype, torch.int64)
        if isinstance(value, sympy.Number):
            value = int(value) if value.is_Integer else float(value)
        dtype = held_dtype(dtype)
        if isinstance(value, float) and not dtype.is_floating_point and value == int(value):
            value = int(value)
        return self._emit(f"tl.full([], {_literal(value)}, {TRITON_DTYPE[dtype]})", dtype, 0)

    def to_dtype(self, value: Var, dtype: torch.dtype, source: Optional[torch.dtype] = None) -> Var:
        if dtype == torch.bool:
            return self._emit(f"({value} != 0)", torch.bool, value.level)
        if dtype in (torch.float16, torch.bfloat16):
            return self._emit(f"{value}.to({TRITON_DTYPE[dtype]}).to(tl.float32)", torch.float32, value.level)
        if held_dtype(dtype) == value.dtype:
            return value
        return self._emit(f"{value}.to({TRITON_DTYPE[dtype]})", dtype, value.level)

    def index_expr(self, expr: sympy.Expr, dtype: torch.dtype) -> Var:
        expr = simplify_index(sympy.sympify(expr))
        level = self._level_of_index(expr)
        if level == 0 and expr.is_Integer:
            return self.constant(int(expr), dtype)
        if level == 0:
            return self._emit(f"tl.full([], {texpr(expr)}, {TRITON_DTYPE[dtype]})", dtype, 0)
        return self._emit(f"({texpr(expr)}).to({TRITON_DTYPE[dtype]})", dtype, level)

    def indirect_indexing(self, value: Var, size: Any, check: bool = True) -> sympy.Symbol:
        var = self._emit(f"tl.where({value} < 0, {value} + {_atom(sympy.sympify(size))}, {value})", value.dtype,
                         value.level)
        self.symbol_levels[var.name] = var.level
        return sympy.Symbol(var.name, integer=True)

    def masked(self, mask: Var, body, other: Any) -> Var:
        self.masks.append(mask)
        try:
            result = body()
        finally:
            self.masks.pop()
        other_var = self.constant(other, result.dtype)
        return self.where(mask, result, other_var)

    def where(self, condition: Var, a: Var, b: Var) -> Var:
        return self._emit(f"tl.where({condition}, {a}, {b})", a.dtype, max(condition.level, a.level, b.level))

    def __getattr__(self, name: str):
        if name in ARITHMETIC:
            entry, boolean = ARITHMETIC[name], False
        elif name in PREDICATES:
            entry, boolean = PREDICATES[name], True
        else:
            raise AttributeError(f"the Triton code generator has no instruction {name!r}")

        def op(*args: Var) -> Var:
            dtype = args[0].dtype
            text = spell(entry, [str(a) for a in args], dtype)
            return self._emit(f"({text})", torch.bool if boolean else dtype, max(a.level for a in args))
        return op

    # --- reductions -----------------------------------------------------------------------

    def _identity(self, reduction_type: str, dtype: torch.dtype) -> Var:
        identity = REDUCTION_IDENTITY[reduction_type]
        if identity in ("low", "high"):
            if dtype.is_floating_point:
                identity = float("-inf") if identity == "low" else float("inf")
            elif dtype == torch.bool:
                identity = 0 if identity == "low" else 1
            else:
                info = torch.iinfo(dtype)
                identity = info.min if identity == "low" else info.max
        return self.constant(identity, dtype)

    def _reduce(self, buffer, value: Var) -> Var:
        kind = buffer.body.reduction_type
        dtype = value.dtype
        mask = "xmask & rmask"
        if value.level < 2:
            value = self._emit(f"tl.broadcast_to({value}, [XBLOCK, RBLOCK])", dtype, 2)
        identity = self._identity(kind, dtype)
        final = Var(next(self.names), dtype if not kind.startswith("arg") else torch.int64, 1)
        index_bound = texpr(sympy.sympify(self.rnumel))
        if self.persistent:
            masked = self._emit(f"tl.where({mask}, {value}, {identity})", dtype, 2)
            self.top.extend(self._finish(kind, masked.name, final.name, "rindex", index_bound, masked_source=masked.name))
            self.cache_top[f"reduction:{buffer.name}"] = final
            return final
        accumulator = f"acc_{buffer.name}"
        self.loop_prelude.append(f"{accumulator} = tl.full([XBLOCK, RBLOCK], {identity}, {TRITON_DTYPE[dtype]})")
        if kind.startswith("arg"):
            self.loop_prelude.append(f"{accumulator}_index = tl.full([XBLOCK, RBLOCK], {index_bound}, tl.int64)")
            # a lane's first valid element always replaces the identity it starts from (a row
            # of -inf, of +inf or of uint8 zeros equals that identity and never beats it)
            beats = "_beats_for_max" if kind == "argmax" else "_beats_for_min"
            self.loop.append(f"better_{buffer.name} = (({beats}({value}, {accumulator}) | "
                             f"({accumulator}_index == {index_bound})) & {mask})")
            self.loop.append(f"{accumulator}_index = tl.where(better_{buffer.name}, rindex, {accumulator}_index)")
            self.loop.append(f"{accumulator} = tl.where(better_{buffer.name}, {value}, {accumulator})")
        else:
            combine = {"sum": "{a} + {v}", "prod": "{a} * {v}",
                       "max": "_max_combine({a}, {v})", "min": "_min_combine({a}, {v})"}[kind]
            self.loop.append(f"{accumulator} = tl.where({mask}, {combine.format(a=accumulator, v=value)}, {accumulator})")
        self.loop_after.extend(self._finish(kind, accumulator, final.name, f"{accumulator}_index", index_bound))
        self.open_reductions.add(buffer.name)
        return final

    @staticmethod
    def _finish(kind: str, values: str, result: str, indices: str, bound: str, masked_source: str = "") -> list[str]:
        if kind == "sum":
            return [f"{result} = tl.reduce({values}, 1, _sum_combine)[:, None]"]
        if kind == "prod":
            return [f"{result} = tl.reduce({values}, 1, _product)[:, None]"]
        if kind in ("max", "min"):
            return [f"{result} = tl.reduce({values}, 1, _{kind}_combine)[:, None]"]
        best = "max" if kind == "argmax" else "min"
        positions = f"tl.broadcast_to({indices}, [XBLOCK, RBLOCK])"
        # the first position holding the best value (NaN counts as the best, as in eager)
        return [f"{result}_best = tl.reduce({values}, 1, _{best}_combine)[:, None]",
                f"{result} = tl.reduce(tl.where(_same_value({values}, {result}_best), {positions}, {bound}), 1, "
                f"_min_combine)[:, None].to(tl.int64)"]

    # --- nodes and loops ----------------------------------------------------------------------

    def _open_loop(self) -> None:
        self.loop, self.cache_loop, self.values_loop = [], {}, {}
        self.loop_prelude, self.loop_after = [], []

    def _close_loop(self) -> None:
        if self.loop is None:
            return
        self.top.extend(self.loop_prelude)
        self.top.append("for roffset in range(0, rnumel, RBLOCK):")
        body = ["rindex = roffset + rbase", "rmask = rindex < rnumel"] + self.loop
        self.top.extend("    " + line for line in body)
        self.top.extend(self.loop_after)
        self.loop = None
        self.open_reductions.clear()
        self.cache_loop, self.values_loop = {}, {}

    def _codegen_node(self, buffer, reads: set[str]) -> None:
        is_reduction = isinstance(buffer.body, ReductionBody)
        indices = node_indices(buffer, self.numel, self.rnumel)
        per_element = not is_reduction and any(RINDEX in i.free_symbols for i in indices[0])
        if not self.persistent and self.is_reduction:
            if reads & self.open_reductions:
                self._close_loop()
            if (is_reduction or per_element) and self.loop is None:
                self._open_loop()
        if is_reduction:
            value = self._reduce(buffer, buffer.body.fn(*indices))
        else:
            value = buffer.body.fn(indices[0])
        index = store_index(buffer, indices[0])
        key = (buffer.name, str(index))
        if is_reduction and not self.persistent:
            self.values_top[key] = value
        elif value.level == 2 and self.loop is not None:
            self.values_loop[key] = value
        else:
            self.values_top[key] = value
        if buffer.name in self.stored or buffer.mutates is not None:
            self._store(buffer, index, value, level=2 if per_element else 1, after_loop=is_reduction and not self.persistent)

    def _store(self, buffer, index, value: Var, level: int, after_loop: bool) -> None:
        target = buffer.dtype
        text = value.name
        if target == torch.bool and value.dtype != torch.bool:
            text = f"({text} != 0)"
        elif held_dtype(target) != value.dtype or target != held_dtype(target):
            text = f"{text}.to({TRITON_DTYPE[target]})"
        if value.level < level or (not self.is_reduction and value.level == 0):
            text = f"tl.broadcast_to({text}, {self._shape(level)})"
        mask = self._mask(level) or "None"
        line = f"tl.store({self._argument(buffer.name)} + ({self._block_index(index, level)}), {text}, {mask})"
        if after_loop:
            self.loop_after.append(line)
        elif level == 2 and self.loop is not None:
            self.loop.append(line)
        else:
            self.top.append(line)

    def generate(self, buffer_dtypes: dict[str, torch.dtype], reads: BufferReads) -> KernelSource:
        self.buffer_dtypes = buffer_dtypes
        contiguous = self._reduction_contiguous(reads)
        # A row held in registers must be contiguous in memory to load well; a strided
        # (column) reduction walks its rows in a loop over tiles wide along the outputs.
        self.persistent = self.persistent and (contiguous or self.rnumel <= 64)
        with use_handler(self):
            for buffer in self.group.nodes:
                self._codegen_node(buffer, reads.of(buffer))
        self._close_loop()
        parameters = list(self.arguments.values()) + ["xnumel"] + (["rnumel"] if self.is_reduction else [])
        header = [f"def KERNEL({', '.join(parameters)}, "
                  f"XBLOCK: tl.constexpr{', RBLOCK: tl.constexpr' if self.is_reduction else ''}):"]
        offset = "tl.program_id(0).to(tl.int64) * XBLOCK" if self.int64 else "tl.program_id(0) * XBLOCK"
        prologue = [f"xoffset = {offset}"]
        if self.is_reduction:
            prologue += ["xindex = xoffset + tl.arange(0, XBLOCK)[:, None]", "xmask = xindex < xnumel",
                         "rbase = tl.arange(0, RBLOCK)[None, :]"]
            if self.int64:
                prologue[-1] = "rbase = tl.arange(0, RBLOCK)[None, :].to(tl.int64)"
            if self.persistent:
                prologue += ["rindex = rbase", "rmask = rindex < rnumel"]
        else:
            prologue += ["xindex = xoffset + tl.arange(0, XBLOCK)", "xmask = xindex < xnumel"]
        body = header + ["    " + line for line in prologue + self.top]
        kind = "pointwise" if not self.is_reduction else ("persistent" if self.persistent else "looped")
        text, symbols = _size_parameters("\n".join(body))
        name = f"aot_{kind}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        arguments = tuple(self.arguments)
        numel, rnumel = _number(self.numel), _number(self.rnumel)
        hints = tuple(self.hint(s) for s in symbols) + (self.hint(numel), self.hint(rnumel))
        return KernelSource(self.group.name, name, text.replace("def KERNEL(", f"def {name}(", 1), arguments,
                            tuple(buffer_dtypes[a] for a in arguments), numel, rnumel, kind,
                            any(n.mutates is not None for n in self.group.nodes), contiguous,
                            symbols, hints, self.int64)

    def _reduction_contiguous(self, reads: BufferReads) -> bool:
        for buffer in self.group.nodes:
            if isinstance(buffer.body, ReductionBody):
                stride = _rindex_coefficient(reads, buffer, self.numel, self.rnumel)
                return stride in (None, 1)
        return True


def emit_kernels(lowered: LoweredGraph, plan: KernelPlan, reads: BufferReads) -> tuple[KernelSource, ...]:
    """The codegen stage for kernels: one Triton source per kernel group of the plan."""
    hint = lowered.sizes.hint if lowered.sizes is not None else int
    buffers = lowered.buffers()
    dtypes = {name: b.dtype for name, b in buffers.items()}
    numels = {name: hint(b.layout.storage_numel()) for name, b in buffers.items()}
    return tuple(TritonKernel(group, plan.stored, numels, hint).generate(dtypes, reads) for group in plan.kernels())


_SIZE_SYMBOL = re.compile(rf"\b{SIZE_SYMBOL_NAME.pattern}\b")


def _size_parameters(text: str) -> tuple[str, tuple]:
    """Name the size symbols a kernel's text uses by position (``s77`` -> ``ks0``), as its
    buffers are, so that the same kernel of two graphs has one source; add them as
    parameters before ``xnumel``. Returns the text and the symbol of each parameter."""
    symbols: list = []
    for match in _SIZE_SYMBOL.finditer(text):
        symbol = sympy.Symbol(match.group(0), integer=True, positive=True)
        if symbol not in symbols:
            symbols.append(symbol)
    if not symbols:
        return text, ()
    names = {s.name: f"ks{i}" for i, s in enumerate(symbols)}
    text = _SIZE_SYMBOL.sub(lambda m: names[m.group(0)], text)
    text = text.replace(", xnumel", "".join(f", {names[s.name]}" for s in symbols) + ", xnumel", 1)
    return text, tuple(symbols)


def _number(expr: Any) -> Any:
    """A size as an int when it is one (static kernels keep plain numbers in their records)."""
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else expr


def _rindex_coefficient(reads: BufferReads, buffer, numel: Any, rnumel: Any) -> Optional[Any]:
    for _, index in reads.in_kernel(buffer, numel, rnumel) or []:
        coefficient = sympy.expand(index).coeff(RINDEX)
        if coefficient != 0 and not coefficient.free_symbols & {XINDEX, RINDEX}:
            return int(coefficient) if coefficient.is_Integer else coefficient
    return None


def module_prelude(interpret: bool) -> str:
    libdevice = ("from aotforge.compiler.runtime.interpret_math import libdevice" if interpret
                 else "from triton.language.extra import libdevice")
    return f"import triton\nimport triton.language as tl\n{libdevice}\n\n{HELPERS}\n"
