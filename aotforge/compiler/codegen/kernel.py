"""The backend-neutral kernel builder: one fused kernel (a ``KernelGroup``) as lines of code,
spelled by a target's printer (``triton.py``'s ``TritonPrinter`` is the first).

The builder decides everything that does not depend on the target; the printer only spells:

* levels: a value is the same for every element (0), varies along the kernel's outputs only
  (1, ``xindex``) or along the reduced axis too (2, ``rindex``);
* masks: ``xmask``, ``rmask`` and the masks of ``masked`` bodies, by level;
* the shape of the kernel, recorded by fusion on the group: pointwise (``XBLOCK`` outputs per
  program), persistent reduction (a row's ``rnumel`` elements at once) or looped reduction
  (rows walked in ``RBLOCK`` chunks; a value that needs a finished reduction starts a new
  loop, and values of an earlier loop are recomputed, never reloaded);
* reductions from the one reductions table (identity, combine, whether the result is an
  index), values shared by common subexpression, and which buffers are stored.

Every body is walked from its record (body.py): the builder is the ``ops`` handler the
record is replayed through. Values are held in float32 for half types (loads upcast, stores
downcast: ``dtypes.compute_dtype``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import re
from typing import Any, Optional, Sequence

import sympy
import torch

from ..dtypes import compute_dtype
from ..expr import FloorDiv, ModularIndexing
from ..indexing import RINDEX, XINDEX, node_indices, simplify_index, store_index
from ..ir import LoweredGraph, ReductionBody
from ..ops import ARITHMETIC, PREDICATES, use_handler
from ..reduction_kinds import REDUCTIONS
from ..schedule import BufferReads, KernelGroup, KernelPlan
from ..sizes import SIZE_SYMBOL_NAME, is_size_symbol

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
    """One kernel's source, in its target's language. Parameters are named by position
    (``ptr0``, ...) and the kernel by a hash of its text, so that structurally identical
    kernels (the same layer repeated, the forward of one graph and the backward of another)
    have identical sources and compile once."""

    group: str  # the kernel group this source computes (``kernel3``)
    name: str  # ``aot_<kind>_<hash of the source>``
    source: str  # one kernel function, as the target's loader takes it
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
    language: str = "triton"  # the printer's (``triton`` or ``cpp``): which loader loads it

    @property
    def dynamic(self) -> bool:
        """Whether the wrapper passes sizes at each launch (a size or an index uses a symbol)."""
        return bool(self.size_symbols) or not (sympy.sympify(self.numel).is_Integer
                                               and sympy.sympify(self.rnumel).is_Integer)


# --- the index printer (Python's integer syntax: Triton's, NumPy's and the wrapper's; C++'s
# with ``/`` for the floor division of non-negative integers) ---------------------------------

def texpr(expr: sympy.Expr) -> str:
    """Print an index expression (``//`` and ``%`` on non-negative integers)."""
    return print_index(expr, "//")


@functools.lru_cache(maxsize=65536)
def print_index(expr: sympy.Expr, floordiv: str) -> str:
    """An index expression, with ``floordiv`` for the division of non-negative integers."""
    def text(e: sympy.Expr) -> str:
        return print_index(e, floordiv)

    def atom_(e: sympy.Expr) -> str:
        return f"({text(e)})" if isinstance(e, (sympy.Add, sympy.Mul, sympy.Pow)) else text(e)

    if isinstance(expr, sympy.Symbol):
        return expr.name
    if isinstance(expr, sympy.Integer):
        return str(int(expr))
    if isinstance(expr, FloorDiv):
        return f"({atom_(expr.args[0])} {floordiv} {atom_(expr.args[1])})"
    if isinstance(expr, ModularIndexing):
        base, divisor, modulus = expr.args
        inner = atom_(base) if divisor == 1 else f"({atom_(base)} {floordiv} {atom_(divisor)})"
        return f"({inner} % {atom_(modulus)})"
    if isinstance(expr, sympy.Add):
        return " + ".join(text(a) for a in sorted(expr.args, key=str))
    if isinstance(expr, sympy.Mul):
        return "*".join(text(a) if not isinstance(a, sympy.Add) else f"({text(a)})" for a in expr.args)
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
        return "*".join([atom_(expr.base)] * int(expr.exp))
    if isinstance(expr, (sympy.Max, sympy.Min)):  # (sizes: Python's, Triton's and C++'s max/min)
        name = "max" if isinstance(expr, sympy.Max) else "min"
        function = f"std::{name}<int64_t>" if floordiv == "/" else name
        first, *rest = sorted(expr.args, key=str)
        result = text(first)
        for arg in rest:
            result = f"{function}({result}, {text(arg)})"
        return result
    raise NotImplementedError(f"cannot print index expression {expr!r} ({type(expr).__name__})")


@dataclasses.dataclass(frozen=True)
class RowLoop:
    """One loop over a row's elements as the builder closed it: it starts after ``start``
    lines of the kernel's body; accumulators are set up (``prelude``), the row is walked
    (``body``), then the finished values are used (``after``)."""
    start: int
    prelude: list
    body: list
    after: list
    reductions: list  # (ReductionKind, accumulator name, dtype)


@dataclasses.dataclass(frozen=True)
class KernelShape:
    is_reduction: bool
    persistent: bool
    int64: bool
    reduction_contiguous: bool  # the reduced axis is the fastest-moving in memory
    numel: Any
    rnumel: Any


class Printer:
    """What a target's printer spells beyond the lines it is asked for, with the answers of a
    target of Python syntax over blocks (Triton's; a printer subclasses this and overrides
    what differs: triton.py, cpp.py)."""

    language = "python"
    whole_rows = True  # a persistent reduction holds its whole row at once
    body_indent = "    "  # of the kernel's body lines, under the header
    lowering_config: dict = {}  # config the target lowers under (its own choices of loop shapes)
    keeps_eager_rounding = False  # ops eager rounds its own way stay ATen calls (eager_rounding.py)
    numel_anchor = ", xnumel"  # the header's text before which size parameters are added

    def index(self, expr: sympy.Expr) -> str:
        return texpr(expr)

    def size_parameter(self, name: str) -> str:
        return name

    def end_loop(self) -> list[str]:
        return []  # indentation ends a Python loop

    def epilogue(self) -> list[str]:
        return []

    def float_to_int(self, value: str, dtype: torch.dtype) -> str:
        """A floating value converted to the integer ``dtype`` (a target whose conversion of NaN
        and out-of-range values differs from eager's spells it out)."""
        return self.to_dtype(value, dtype)

    def indirect_index(self, value: str, size: str, check: Any) -> str:
        """An index read from a tensor, as a position in a dimension of ``size``; ``check`` is
        the lowering's bounds rule (ops.indirect_indexing). Here: negatives count from the end."""
        return self.wrap_negative(value, size)

    def body(self, lines: list[str], loops: list[RowLoop], shape: KernelShape) -> list[str]:
        """The kernel's body under its header: the prologue, the builder's ``lines`` (whose
        row loops are also given as ``loops``, for a target that arranges them otherwise)."""
        prologue = self.prologue(shape.is_reduction, shape.persistent, shape.int64)
        return ["    " + line for line in prologue] + [self.body_indent + line for line in lines] + self.epilogue()


class KernelBuilder:
    """Builds one kernel's lines through ``printer``; the object is the ``ops`` handler the
    group's bodies are replayed through."""

    def __init__(self, group: KernelGroup, stored: set[str], buffer_numels: dict[str, int], printer: Any, hint=int):
        self.group = group
        self.stored = stored
        self.hint = hint
        self.p = printer
        self.numel, self.rnumel = group.numel, group.rnumel
        self.is_reduction = group.rnumel != 1
        # decided by fusion, recorded on the group; a target without registers for a whole row
        # (C++) walks every reduction in loops
        self.persistent = group.kind == "persistent" and printer.whole_rows
        self.members = {n.name: n for n in group.nodes if n.mutates is None}
        self.arguments: dict[str, str] = {}
        self.top: list[str] = []
        self.loop: Optional[list[str]] = None
        self.loop_prelude: list[str] = []
        self.loop_after: list[str] = []
        self.loop_reductions: list = []  # (kind, accumulator, dtype) of the open loop
        self.row_loops: list[RowLoop] = []  # every closed loop, as its parts (for a printer's arrange)
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
        (self.loop if in_loop else self.top).append(self.p.assign(var.name, expression))
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
        return self.p.mask_and(parts) if parts else None

    def _block_index(self, index: sympy.Expr, level: int) -> str:
        """The index as a block of the full shape for its level (a load's or a store's pointer,
        mask and value have one shape): the printer widens an index that lacks a variable."""
        needed = set() if level == 0 else {XINDEX, RINDEX} if (level == 2 and self.is_reduction) else {XINDEX}
        full = level > 0 and needed <= index.free_symbols
        return self.p.block_index(self.p.index(index), level, self.is_reduction, full)

    def _argument(self, name: str) -> str:
        """The kernel parameter for buffer ``name``: named by position, not by buffer."""
        return self.arguments.setdefault(name, f"ptr{len(self.arguments)}")

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
            # a row-invariant read (a weight indexed by rindex alone) loads one row's worth and
            # broadcasts: no per-row copies of the same addresses
            parts = [m for m, symbol in (("xmask", XINDEX), ("rmask", RINDEX)) if symbol in varying]
            text = self.p.load(self._argument(name), self.p.index(index), self.p.mask_and(parts))
        else:
            text = self.p.load(self._argument(name), self._block_index(index, level), self._mask(level))
        return self._emit(self.p.upcast(text, buffer_dtype), compute_dtype(buffer_dtype), level)

    def _recompute(self, buffer, index: sympy.Expr) -> Var:
        if isinstance(buffer.body, ReductionBody):
            raise AssertionError(f"reduction {buffer.name} read before it was computed")
        indices, _ = node_indices(buffer, self.numel, self.rnumel)
        return buffer.body.walk(self, indices)

    def constant(self, value: Any, dtype: torch.dtype) -> Var:
        if isinstance(value, sympy.Expr) and not value.is_Number:  # a symbolic size as a number
            return self.to_dtype(self.index_expr(value, torch.int64), dtype, torch.int64)
        if isinstance(value, sympy.Number):
            value = int(value) if value.is_Integer else float(value)
        dtype = compute_dtype(dtype)
        if isinstance(value, float) and not dtype.is_floating_point and value == int(value):
            value = int(value)
        return self._emit(self.p.constant(value, dtype), dtype, 0)

    def to_dtype(self, value: Var, dtype: torch.dtype, source: Optional[torch.dtype] = None) -> Var:
        if dtype == value.dtype and dtype != torch.bool:
            return value
        # to bool: a test against zero; to a half type: rounded through it, held as float32
        if value.dtype.is_floating_point and not dtype.is_floating_point and dtype != torch.bool:
            return self._emit(self.p.float_to_int(value.name, dtype), dtype, value.level)
        return self._emit(self.p.to_dtype(value.name, dtype), compute_dtype(dtype), value.level)

    def index_expr(self, expr: sympy.Expr, dtype: torch.dtype) -> Var:
        expr = simplify_index(sympy.sympify(expr))
        level = self._level_of_index(expr)
        if level == 0 and expr.is_Integer:
            return self.constant(int(expr), dtype)
        return self._emit(self.p.index_expr(self.p.index(expr), dtype, level), dtype, level)

    def indirect_indexing(self, value: Var, size: Any, check: bool = True) -> sympy.Symbol:
        var = self._emit(self.p.indirect_index(value.name, f"({self.p.index(sympy.sympify(size))})", check),
                         value.dtype, value.level)
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

    def philox_uniform(self, seed: Var, counter: Var) -> Var:
        return self._emit(self.p.philox_uniform(seed.name, counter.name), torch.float32, max(seed.level, counter.level))

    def where(self, condition: Var, a: Var, b: Var) -> Var:
        return self._emit(self.p.where(condition.name, a.name, b.name), a.dtype,
                          max(condition.level, a.level, b.level))

    def __getattr__(self, name: str):
        if name not in ARITHMETIC and name not in PREDICATES:
            raise AttributeError(f"the kernel builder has no instruction {name!r}")

        def op(*args: Var) -> Var:
            dtype = args[0].dtype
            text = self.p.instruction(name, [str(a) for a in args], dtype)
            return self._emit(text, torch.bool if name in PREDICATES else dtype, max(a.level for a in args))
        return op

    # --- reductions -----------------------------------------------------------------------

    def _reduce(self, buffer, value: Var) -> Var:
        kind = REDUCTIONS[buffer.body.reduction_type]
        dtype = value.dtype
        mask = self.p.mask_and(["xmask", "rmask"])
        if value.level < 2:
            value = self._emit(self.p.broadcast(value.name, 2, True), dtype, 2)
        identity = self.constant(kind.identity_value(dtype), dtype)
        final = Var(next(self.names), torch.int64 if kind.returns_index else dtype, 1)
        index_bound = self.p.index(sympy.sympify(self.rnumel))
        if self.persistent:
            masked = self._emit(self.p.where(mask, value.name, identity.name), dtype, 2)
            self.top.extend(self.p.finish(kind, masked.name, final.name, "rindex", index_bound))
            self.cache_top[f"reduction:{buffer.name}"] = final
            return final
        accumulator = f"acc_{buffer.name}"
        self.loop_reductions.append((kind, accumulator, dtype))
        self.loop_prelude.extend(self.p.accumulator(kind, accumulator, identity.name, dtype, index_bound))
        self.loop.extend(self.p.accumulate(kind, accumulator, value.name, mask, index_bound, buffer.name))
        self.loop_after.extend(self.p.finish(kind, accumulator, final.name, f"{accumulator}_index", index_bound))
        self.open_reductions.add(buffer.name)
        return final

    # --- nodes and loops ----------------------------------------------------------------------

    def _open_loop(self) -> None:
        self.loop, self.cache_loop, self.values_loop = [], {}, {}
        self.loop_prelude, self.loop_after, self.loop_reductions = [], [], []

    def _close_loop(self) -> None:
        if self.loop is None:
            return
        self.row_loops.append(RowLoop(len(self.top), list(self.loop_prelude), list(self.loop),
                                      list(self.loop_after), list(self.loop_reductions)))
        self.top.extend(self.loop_prelude)
        header, prologue = self.p.loop(self.loop_reductions)
        self.top.append(header)
        self.top.extend("    " + line for line in prologue + self.loop)
        self.top.extend(self.p.end_loop())
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
            value = self._reduce(buffer, buffer.body.walk(self, *indices))
        else:
            value = buffer.body.walk(self, indices[0])
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

    def _value_of(self, buffer) -> tuple:
        """(index, value, level) of a pointwise write into a buffer: not kept as that buffer's
        value (a read of it still means the value before the write)."""
        indices = node_indices(buffer, self.numel, self.rnumel)
        per_element = any(RINDEX in i.free_symbols for i in indices[0])
        return store_index(buffer, indices[0]), buffer.body.walk(self, indices[0]), 2 if per_element else 1

    def _store(self, buffer, index, value: Var, level: int, after_loop: bool) -> None:
        text = self.p.downcast(value.name, value.dtype, buffer.dtype)
        if value.level < level or (not self.is_reduction and value.level == 0):
            text = self.p.broadcast(text, level, self.is_reduction)
        line = self.p.store(self._argument(buffer.name), self._block_index(index, level), text, self._mask(level))
        if after_loop:
            self.loop_after.append(line)
        elif level == 2 and self.loop is not None:
            self.loop.append(line)
        else:
            self.top.append(line)

    def generate(self, buffer_dtypes: dict[str, torch.dtype], reads: BufferReads) -> KernelSource:
        self.buffer_dtypes = buffer_dtypes
        # Every read of a buffer means its value before the graph's writes into it (the graph is
        # functional: a later op reads the written value under its own name), so the writes into
        # inputs come last, all computed before any is stored: a member recomputed after a
        # write would read the new value (``x.add_(y); return x * 2`` gave (x + 2y) * 2).
        writes = [buffer for buffer in self.group.nodes if buffer.mutates is not None]
        with use_handler(self):
            for buffer in self.group.nodes:
                if buffer.mutates is None:
                    self._codegen_node(buffer, reads.of(buffer))
            values = [self._value_of(buffer) for buffer in writes]
            for buffer, (index, value, level) in zip(writes, values):
                self._store(buffer, index, value, level=level, after_loop=False)
        self._close_loop()
        parameters = list(self.arguments.values()) + ["xnumel"] + (["rnumel"] if self.is_reduction else [])
        pointer_dtypes = tuple(buffer_dtypes[a] for a in self.arguments)
        body = self.p.header("KERNEL", parameters, self.is_reduction, pointer_dtypes)
        shape = KernelShape(self.is_reduction, self.persistent, self.int64, self.group.reduction_contiguous,
                            _number(self.numel), _number(self.rnumel))
        body += self.p.body(self.top, self.row_loops, shape)
        kind = self.group.kind
        text, symbols = _size_parameters("\n".join(body), self.p)
        name = kernel_name(kind, self.group.nodes, hashlib.sha256(text.encode()).hexdigest()[:16])
        arguments = tuple(self.arguments)
        numel, rnumel = _number(self.numel), _number(self.rnumel)
        hints = tuple(self.hint(s) for s in symbols) + (self.hint(numel), self.hint(rnumel))
        return KernelSource(self.group.name, name, self.p.rename(text, "KERNEL", name), arguments,
                            pointer_dtypes, numel, rnumel, kind,
                            any(n.mutates is not None for n in self.group.nodes), self.group.reduction_contiguous,
                            symbols, hints, self.int64, self.p.language)


# kernel kinds as the prefix of their names (as inductor's triton_poi_/per_/red_, so that a
# profile reads the same way)
KIND_PREFIX = {"pointwise": "aot_poi", "persistent": "aot_per", "looped": "aot_red"}
# ATen ops named in a kernel's name, at most (the rest are in the kernel plan)
NAMED_OPS = 6


def kernel_name(kind: str, nodes: Sequence[Any], digest: str) -> str:
    """``aot_per_fused_native_layer_norm_gelu_<hash>``: the kernel's kind, the ATen ops it
    computes (in the order they first appear, at most NAMED_OPS), and a hash of its source, so
    that a profile reads without a lookup table and identical kernels still share a name."""
    ops: list[str] = []
    for node in nodes:
        for origin in getattr(node, "origins", ()):
            parts = origin.split(".")  # aten.native_layer_norm.default -> native_layer_norm
            op = (parts[1] if len(parts) > 1 and parts[0] in ("aten", "prims", "aotforge") else parts[0]).strip("_")
            if op and op not in ops:
                ops.append(op)
    fused = "_fused_" + "_".join(ops[:NAMED_OPS]) if ops else ""
    return f"{KIND_PREFIX.get(kind, 'aot_' + kind)}{fused}_{digest}"


def emit_kernels(lowered: LoweredGraph, plan: KernelPlan, reads: BufferReads, printer: Any) -> tuple[KernelSource, ...]:
    """The codegen stage for kernels: one source per kernel group of the plan, in the language
    ``printer`` spells."""
    hint = lowered.sizes.hint if lowered.sizes is not None else int
    buffers = lowered.buffers()
    dtypes = {name: b.dtype for name, b in buffers.items()}
    numels = {name: hint(b.layout.storage_numel()) for name, b in buffers.items()}
    return tuple(KernelBuilder(group, plan.stored, numels, printer, hint).generate(dtypes, reads)
                 for group in plan.kernels())


_SIZE_SYMBOL = re.compile(rf"\b{SIZE_SYMBOL_NAME.pattern}\b")


def _size_parameters(text: str, printer: Any) -> tuple[str, tuple]:
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
    anchor = printer.numel_anchor
    text = text.replace(anchor, "".join(f", {printer.size_parameter(names[s.name])}" for s in symbols) + anchor, 1)
    return text, tuple(symbols)


def _number(expr: Any) -> Any:
    """A size as an int when it is one (static kernels keep plain numbers in their records)."""
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else expr
