"""The C++ printer: the CPU target's spelling of the kernel builder's lines (codegen/kernel.py),
beside Triton's (triton.py). Same kernel plan, same builder, another language.

A kernel is an ``extern "C"`` function of raw pointers and sizes. Triton works on blocks of
elements; C++ here works on one element at a time, in loops the C++ compiler vectorizes:

* pointwise: one loop over the outputs (``xindex``), parallel over threads with OpenMP when
  there is enough work;
* reductions: the same outer loop over rows, and for each row a loop over the reduced axis
  (``rindex``). Every reduction walks its row (``whole_rows = False``): a persistent Triton
  kernel holds a row in registers, a C++ one has no such registers, and the builder then
  gives the looped form (a value that needs a finished reduction starts a new loop).

Example (the sum of each row of a 16 x 64 float tensor)::

    extern "C" int aot_looped_...(float* ptr0, float* ptr1, int64_t xnumel, int64_t rnumel) {
        int aot_error = 0;
        #pragma omp parallel for if(xnumel * rnumel >= AOT_PARALLEL_WORK) num_threads(aot_num_threads)
        for (int64_t xindex = 0; xindex < xnumel; ++xindex) {
            constexpr bool xmask = true;
            auto acc_buf0 = static_cast<float>(0);
            for (int64_t rindex = 0; rindex < rnumel; ++rindex) {
                constexpr bool rmask = true;
                auto tmp0 = ptr0[64*xindex + rindex];
                if (xmask && rmask) acc_buf0 = static_cast<float>(acc_buf0 + tmp0);
            }
            auto tmp1 = acc_buf0;
            ptr1[xindex] = tmp1;
        }
        return aot_error;
    }

Masks: ``xmask`` and ``rmask`` are always true (the loops stop at the sizes); the masks of
``masked`` bodies guard loads (``m ? ptr[i] : 0``) and stores, so a masked-off element is
never read or written.
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional

import sympy
import torch

from ...config import config
from .. import index_checks
from ..dtypes import compute_dtype
from ..reduction_kinds import ReductionKind
from .kernel import KernelShape, Printer, RowLoop, print_index
from .cpp_nest import loop_nest
from .cpp_ops import ACCUMULATE, ARITHMETIC, BEATS, CPP_STORAGE_TYPE, CPP_TYPE, PREDICATES, PRELUDE, spell
from .cpp_sums import (SUM_PRELUDE, blocks_in_cascade, cascaded, column_groups, columns_in_cascade,
                       columns_in_row_sum_order, row_in_cascade, split_off_sums, split_rows_in_cascade, sum_accumulators)

# the OpenMP reduction of each combine instruction (aot_max/aot_min: the prelude's, which
# propagate NaN as eager does; OpenMP's max would drop it)
SIMD_REDUCTION = {"add": "+", "mul": "*", "maximum": "aot_max", "minimum": "aot_min"}

# a kernel's error word, a local of the call shared by its threads; a kernel that reads indices
# from tensors also keeps a bad index's details (value, size, check), which its return hands to
# the calling thread (aot_finish, the prelude) for eager's message
ERROR_LOCALS = "int aot_error = 0;"
RETURN = "return aot_error;"
INDEX_ERROR_LOCALS = "int aot_error = 0; int64_t aot_detail[3] = {0, 0, 0};"
INDEX_RETURN = "return aot_finish(aot_error, aot_detail);"

# elements (times the reduced size) below which a kernel runs on one thread: a parallel
# region costs a few microseconds
PARALLEL_WORK = 32768


def _literal(value: Any, dtype: torch.dtype) -> str:
    if isinstance(value, bool) or dtype == torch.bool:
        return "true" if value else "false"
    if isinstance(value, float) and not dtype.is_floating_point:
        value = int(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NAN"
        if math.isinf(value):
            return "INFINITY" if value > 0 else "-INFINITY"
        return repr(value)
    value = int(value)
    if value == -2**63:
        return "(-9223372036854775807LL - 1)"
    return f"{value}LL" if abs(value) > 2**31 - 1 else str(value)


class CppPrinter(Printer):
    """Spells the builder's lines in C++ (one statement per call)."""

    language = "cpp"
    whole_rows = False  # a persistent reduction is walked like a looped one (see the docstring)
    body_indent = "        "  # inside the loop over outputs
    # a long reduction over few outputs is not cut into partial reductions plus a second pass:
    # a GPU needs the pieces to fill its cores, a CPU thread walks a row at full speed
    lowering_config = {"split_reduction_threshold": 2**62}

    @property
    def keeps_eager_rounding(self) -> bool:  # type: ignore[override]
        # eager's CPU kernels round exp, sqrt, GELU, LayerNorm... their own way (MKL, Sleef,
        # Welford): with cpu_eager_bits those ops stay ATen calls (aotforge/eager_rounding.py)
        return config.cpu_eager_bits

    def __init__(self) -> None:
        # each index text of the kernel being built, with its expression: the loop nest of a
        # kernel over symbolic sizes (cpp_nest.py) rewrites its divisions
        self.printed: dict[str, sympy.Expr] = {}

    def index(self, expr: sympy.Expr) -> str:
        # every index variable is an int64_t, and sizes are non-negative: C++'s ``/`` floors
        text = print_index(expr, "/")
        self.printed[text] = expr
        return text

    def assign(self, name: str, expression: str) -> str:
        return f"auto {name} = {expression};"

    def mask_and(self, parts: list[str]) -> str:
        return " && ".join(parts)

    def block_index(self, index: str, level: int, is_reduction: bool, full: bool) -> str:
        return index  # one element at a time: nothing to widen

    def broadcast(self, value: str, level: int, is_reduction: bool) -> str:
        return value

    def load(self, pointer: str, index: str, mask: Optional[str]) -> str:
        # a masked-off element is not read: its index may be out of bounds
        return f"(({mask}) ? {pointer}[{index}] : 0)" if mask else f"{pointer}[{index}]"

    def upcast(self, load: str, dtype: torch.dtype) -> str:
        if dtype == torch.bfloat16:
            return f"aot_bf16_to_float({load})"
        if dtype == torch.float16:
            return f"static_cast<float>({load})"
        if dtype == torch.bool:  # (a byte, see header: back to a C++ bool at once)
            return f"static_cast<bool>({load})"
        if dtype in (torch.int8, torch.uint8, torch.int16) and "?" in load:
            # a masked load ``m ? ptr[i] : 0`` of a type narrower than int is an int: back to its
            # own type, so that max/min of it and its kind deduce one type
            return f"static_cast<{CPP_TYPE[dtype]}>({load})"
        return load

    def store(self, pointer: str, index: str, value: str, mask: Optional[str]) -> str:
        line = f"{pointer}[{index}] = {value};"
        return f"if ({mask}) {line}" if mask else line

    def downcast(self, value: str, held: torch.dtype, target: torch.dtype) -> str:
        if target == torch.bool and held != torch.bool:
            return f"({value} != 0)"
        if target == torch.bfloat16:
            return f"aot_float_to_bf16({value})"
        if target != held:
            return f"static_cast<{CPP_STORAGE_TYPE[target]}>({value})"
        return value

    def constant(self, value: Any, dtype: torch.dtype) -> str:
        return f"static_cast<{CPP_TYPE[dtype]}>({_literal(value, dtype)})"

    def to_dtype(self, value: str, dtype: torch.dtype) -> str:
        if dtype == torch.bool:
            return f"({value} != 0)"
        if dtype == torch.bfloat16:  # rounded through bfloat16, held as float
            return f"aot_bf16_to_float(aot_float_to_bf16({value}))"
        if dtype == torch.float16:
            return f"static_cast<float>(static_cast<_Float16>({value}))"
        return f"static_cast<{CPP_TYPE[dtype]}>({value})"

    def float_to_int(self, value: str, dtype: torch.dtype) -> str:
        return f"aot_float_to_int<{CPP_TYPE[dtype]}>({value})"  # (eager's x86 result: the prelude)

    def index_expr(self, index: str, dtype: torch.dtype, level: int) -> str:
        return f"static_cast<{CPP_TYPE[compute_dtype(dtype)]}>({index})"

    def indirect_index(self, value: str, size: str, check: Any) -> str:
        # bounds-checked (never a stray read), negatives counted from the end only where eager
        # does; a bad index's details go to aot_detail, for eager's message (index_checks.py)
        return f"aot_check_index({value}, {size}, {index_checks.encode(check)}, &aot_error, aot_detail)"

    def where(self, condition: str, a: str, b: str) -> str:
        return f"(({condition}) ? {a} : {b})"

    def philox_uniform(self, seed: str, counter: str) -> str:
        return f"aot_philox_uniform({seed}, {counter})"

    def instruction(self, name: str, args: list[str], dtype: torch.dtype) -> str:
        if name in PREDICATES:
            return f"({spell(PREDICATES[name], args, dtype)})"
        return f"static_cast<{CPP_TYPE[dtype]}>({spell(ARITHMETIC[name], args, dtype)})"

    # --- reductions and loops -----------------------------------------------------------------

    def accumulator(self, kind: ReductionKind, name: str, identity: str, dtype: torch.dtype, bound: str) -> list[str]:
        # the values' own type: sums of float32 in double were measured 28x slower (GCC does not
        # vectorize the widening); the SIMD lanes' partial sums keep a long row's error small
        lines = [f"{CPP_TYPE[dtype]} {name} = {identity};"]
        if kind.returns_index:
            lines.append(f"int64_t {name}_index = {bound};")
        return lines

    def accumulate(self, kind: ReductionKind, name: str, value: str, mask: str, bound: str, buffer: str) -> list[str]:
        if not kind.returns_index:
            step = ACCUMULATE[kind.combine].format(a=name, v=value)
            return [f"if ({mask}) {name} = {step};"]  # (converted back to the accumulator's type)
        return [f"if (({mask}) && ({BEATS[kind.combine]}({value}, {name}) || {name}_index == {bound})) "
                f"{{ {name}_index = rindex; {name} = {value}; }}"]

    def finish(self, kind: ReductionKind, values: str, result: str, indices: str, bound: str) -> list[str]:
        if kind.returns_index:
            return [f"auto {result} = {indices};"]
        return [f"auto {result} = {values};"]

    def loop(self, reductions: list) -> tuple[str, list[str]]:
        """A loop over a row. One whose reductions all fold values (no argmax) is marked for
        vectorization with its accumulators as SIMD reductions (partial results per lane,
        folded at the end: the order of a sum changes, as in eager's vectorized sums)."""
        header = "for (int64_t rindex = 0; rindex < rnumel; ++rindex) {"
        if reductions and not any(kind.returns_index for kind, _, _ in reductions):
            clauses = " ".join(f"reduction({SIMD_REDUCTION[kind.combine]}:{name})" for kind, name, _ in reductions)
            header = f"#pragma omp simd {clauses}\n{header}"
        return header, ["constexpr bool rmask = true;"]

    def end_loop(self) -> list[str]:
        return ["}"]

    # --- the kernel function --------------------------------------------------------------------

    numel_anchor = ", int64_t xnumel"  # size parameters go before it (kernel._size_parameters)

    def size_parameter(self, name: str) -> str:
        return f"int64_t {name}"

    def header(self, name: str, parameters: list[str], is_reduction: bool, dtypes: tuple = ()) -> list[str]:
        # bool buffers as bytes (torch stores a bool as one byte of 0 or 1): GCC has no vector type
        # for a C++ bool and left every kernel that loads or stores one scalar (the conv net's
        # ReLU + mask 1.9 ms a call, against 0.8 ms for ReLU alone)
        pointers = [f"{'uint8_t' if dtype == torch.bool else CPP_STORAGE_TYPE[dtype]}* {p}"
                    for p, dtype in zip(parameters, dtypes)]
        sizes = [f"int64_t {p}" for p in parameters[len(dtypes):]]
        return [f'extern "C" int {name}({", ".join(pointers + sizes)}) {{']

    def prologue(self, is_reduction: bool, persistent: bool, int64: bool) -> list[str]:
        work = "xnumel * rnumel" if is_reduction else "xnumel"
        return [ERROR_LOCALS,
                f"#pragma omp parallel for if({work} >= {PARALLEL_WORK}) num_threads(aot_num_threads)",
                "for (int64_t xindex = 0; xindex < xnumel; ++xindex) {",
                "    constexpr bool xmask = true;"]

    def epilogue(self) -> list[str]:
        return ["    }", f"    {RETURN}", "}"]

    def body(self, lines: list[str], loops: list[RowLoop], shape: KernelShape) -> list[str]:
        """Four arrangements of the same lines: a reduction down columns (its rows are not
        contiguous) walks a tile of columns per row, so that the columns' loads vectorize
        (``_columns``); a pointwise kernel over rows of a broadcast operand walks rows then
        columns, so that ``xindex % C`` becomes a plain loop counter (``_rows_of``), or, over
        symbolic sizes, as a nest of loops, one per dimension its indices divide ``xindex`` by
        (``cpp_nest.loop_nest``); else one loop over outputs, each walking its row (the builder's own order)."""
        arranged = None
        if shape.is_reduction and not shape.reduction_contiguous:
            arranged = _columns(lines, loops, shape)
        elif not shape.is_reduction:
            arranged = (loop_nest(lines, self.printed, shape.numel, ["    " + ERROR_LOCALS], [f"    {RETURN}", "}"],
                                  _parallel_for("xnumel"))
                        or _rows_of(lines, shape))
        self.printed = {}  # (the next kernel's)
        if arranged is None:
            arranged = super().body(_split_row_loops(lines, loops, shape), loops, shape)
        if any("aot_detail" in line for line in lines):
            arranged = [line.replace(ERROR_LOCALS, INDEX_ERROR_LOCALS).replace(RETURN, INDEX_RETURN)
                        for line in arranged]
        return arranged

    def rename(self, text: str, placeholder: str, name: str) -> str:
        return text.replace(f" int {placeholder}(", f" int {name}(", 1)


# columns a reduction down columns walks at once (a multiple of every SIMD width)
COLUMN_TILE = 64
_STORE = re.compile(r"\]\s*=[^=]")
_MODULUS = re.compile(r"\(xindex % (\d+)\)")
_DIVISION = re.compile(r"\(xindex / (\d+)\)")


def _parallel_for(work: str) -> str:
    return f"#pragma omp parallel for if({work} >= {PARALLEL_WORK}) num_threads(aot_num_threads)"


def _columns(lines: list[str], loops: list[RowLoop], shape: KernelShape) -> Optional[list[str]]:
    """A reduction down columns as tiles of ``COLUMN_TILE`` columns: each tile's accumulators
    are arrays, each row of the tile is one SIMD loop over its columns. Only for one loop
    over rows whose reductions fold values (no argmax), with no stores before it; the lines
    before the loop (per-column values) are recomputed in each of the tile's loops."""
    if len(loops) != 1:
        return None
    loop = loops[0]
    before = lines[:loop.start]
    # what follows the loop: its finished values, then the nodes after it (a mean's division,
    # a squeeze-excite's scale), all per column
    end = loop.start + len(loop.prelude) + len(loop.body) + 3
    after = lines[end:]
    if (any(kind.returns_index for kind, _, _ in loop.reductions) or any(_STORE.search(line) for line in before)
            or after[:len(loop.after)] != loop.after):
        return None
    names = [name for _, name, _ in loop.reductions]
    as_array = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b") if names else None

    def tiled(text: str) -> str:
        return as_array.sub(lambda m: f"{m.group(1)}[xi]", text) if as_array else text

    column = ["const int64_t xindex = xo + xi;", "constexpr bool xmask = true;"] + before
    initial = [tiled(re.sub(r"^\S+ (\w+) =", r"\1 =", line)) for line in loop.prelude]  # (declared above)
    # floating sums: each column's rows in steps whose partial sums move up a cascade (cpp_sums);
    # the columns after ATen's groups of columns take its row_sum order, in tiles of their own
    declare, header, cascade, fold = columns_in_cascade(loop.reductions, COLUMN_TILE)
    sums = bool(sum_accumulators(loop.reductions))
    groups = column_groups(loop.reductions) if sums else None
    out = ["    " + ERROR_LOCALS]
    if groups is None:
        out += ["    " + _parallel_for("xnumel * rnumel"),
                f"    for (int64_t xo = 0; xo < xnumel; xo += {COLUMN_TILE}) {{",
                f"        const int64_t xcount = std::min<int64_t>({COLUMN_TILE}, xnumel - xo);"]
    else:
        out += [f"    const int64_t aot_full = {groups};",
                f"    const int64_t aot_head = (aot_full + {COLUMN_TILE - 1}) / {COLUMN_TILE};",
                f"    const int64_t aot_tiles = aot_head + (xnumel - aot_full + {COLUMN_TILE - 1}) / {COLUMN_TILE};",
                "    " + _parallel_for("xnumel * rnumel"),
                "    for (int64_t aot_t = 0; aot_t < aot_tiles; ++aot_t) {",
                "        const bool aot_tail = aot_t >= aot_head;",
                f"        const int64_t xo = aot_tail ? aot_full + (aot_t - aot_head) * {COLUMN_TILE} : aot_t * {COLUMN_TILE};",
                f"        const int64_t xcount = std::min<int64_t>({COLUMN_TILE}, (aot_tail ? xnumel : aot_full) - xo);"]
    out += [f"        {CPP_TYPE[dtype]} {name}[{COLUMN_TILE}];" for _, name, dtype in loop.reductions]
    out += ["        for (int64_t xi = 0; xi < xcount; ++xi) {"] + ["            " + line for line in column + initial]
    out += ["        }"]
    row = (["constexpr bool rmask = true;", "#pragma omp simd", "for (int64_t xi = 0; xi < xcount; ++xi) {"]
           + ["    " + tiled(line) for line in column + loop.body] + ["}"])
    if groups is not None:
        out += ["        if (aot_tail) {"]
        out += ["            " + line for line in columns_in_row_sum_order(loop.reductions, COLUMN_TILE, row)]
        out += ["        } else {"]
    if sums:
        out += ["        " + line for line in declare] + ["        " + line for line in header.split("\n")]
    else:
        out += ["        for (int64_t rindex = 0; rindex < rnumel; ++rindex) {"]
    out += ["            " + line for line in row] + ["        }"]
    if sums:
        out += ["        " + line for line in cascade] + ["        }", "        for (int64_t xi = 0; xi < xcount; ++xi) {"]
        out += ["            " + line for line in fold] + ["        }"]
    if groups is not None:
        out += ["        }"]
    out += ["        for (int64_t xi = 0; xi < xcount; ++xi) {"]
    out += ["            " + tiled(line) for line in column + after]
    out += ["        }", "    }"]
    return (_column_rows(out, shape) or out) + [f"    {RETURN}", "}"]


def _column_rows(out: list[str], shape: KernelShape) -> Optional[list[str]]:
    """The tiles of a column reduction whose outputs are rows of C columns (``xindex / C`` and
    ``xindex % C``: a mean over H and W of an NHWC image, C its channels) walked within each
    row: ``xindex / C`` is the row's counter and ``xindex % C`` the tile's column, so the
    loads vectorize (per-element division kept GCC scalar: a squeeze-excite mean over
    8 x 4x4 x 240 NHWC values took 6x eager's time), and each row's columns take ATen's
    column groups as eager's reduction does, one row at a time. For a constant C; the count of
    rows may be symbolic (a dynamic batch)."""
    text = "\n".join(out)
    sizes = {int(k) for k in _DIVISION.findall(text)} | {int(k) for k in _MODULUS.findall(text)}
    if len(sizes) != 1 or _static_factor(shape.numel) % next(iter(sizes)):
        return None
    columns = next(iter(sizes))
    rows = _rows(shape.numel, columns)
    text = (text.replace(f"(xindex / {columns})", "aot_row").replace(f"(xindex % {columns})", "(xo + xi)")
            .replace("const int64_t xindex = xo + xi;", f"const int64_t xindex = aot_row * {columns} + xo + xi;")
            .replace("xnumel", str(columns)))
    inner = [line for line in text.split("\n")[1:] if "#pragma omp parallel" not in line]
    return (["    " + ERROR_LOCALS, "    " + _parallel_for(f"{rows} * {columns} * rnumel"),
             f"    for (int64_t aot_row = 0; aot_row < {rows}; ++aot_row) {{"]
            + ["    " + line for line in inner] + ["    }"])


def _static_factor(numel) -> int:
    """The whole number that divides a kernel's size for every value of its symbols: the size
    itself, or the coefficient of a product of symbols (``32768*s0`` for a dynamic batch)."""
    if isinstance(numel, int):
        return numel
    coefficient, _ = sympy.sympify(numel).as_coeff_Mul()
    return int(coefficient) if coefficient.is_Integer else 1


def _rows(numel, row: int) -> str:
    """The count of rows of ``row`` elements in a kernel of ``numel`` (a multiple of ``row``):
    a number, or the size passed at the launch divided (exactly) at run time."""
    return str(numel // row) if isinstance(numel, int) else f"(xnumel / {row})"


def _rows_of(lines: list[str], shape: KernelShape) -> Optional[list[str]]:
    """A pointwise kernel whose indices divide or take the remainder of ``xindex`` by
    constants (a broadcast operand: ``ptr[((xindex / 1024) % 32)]``, a channel's ``xindex % C``)
    as rows of R, R the greatest common divisor of those constants and the size: ``xindex / A``
    becomes ``x0 / (A / R)`` and ``xindex % M`` becomes ``(x0 % (M / R)) * R + x1``, exact
    identities for ``xindex = x0 * R + x1`` (0 <= x1 < R). Per-element division and remainder
    keep GCC from vectorizing the loop (a per-channel mean subtracted from 1M floats: 1.1 ms
    a call that way, 0.8 ms as rows); after it, the inner loop over ``x1`` is contiguous and the broadcast loads are
    loop-invariant. For constant divisors and rows of at least 4 elements; the size may have
    symbols (a dynamic batch: ``32768*s0`` walks ``xnumel / R`` rows)."""
    text = "\n".join(lines)
    divisors = [int(d) for d in _DIVISION.findall(text)]
    moduli = [int(m) for m in _MODULUS.findall(text)]
    if not (divisors or moduli):
        return None
    row = math.gcd(_static_factor(shape.numel), *divisors, *moduli)
    if row < 4:  # (4 floats: one 16-byte vector, the width GCC picks here for -march=native)
        return None

    def quotient(match: re.Match) -> str:
        outer = int(match.group(1)) // row
        return "x0" if outer == 1 else f"(x0 / {outer})"

    def remainder(match: re.Match) -> str:
        outer = int(match.group(1)) // row
        return "x1" if outer == 1 else f"((x0 % {outer})*{row} + x1)"

    text = _MODULUS.sub(remainder, _DIVISION.sub(quotient, text))
    out = ["    " + ERROR_LOCALS, "    " + _parallel_for("xnumel"),
           f"    for (int64_t x0 = 0; x0 < {_rows(shape.numel, row)}; ++x0) {{",
           f"        for (int64_t x1 = 0; x1 < {row}; ++x1) {{",
           f"            const int64_t xindex = x0 * {row} + x1;", "            constexpr bool xmask = true;"]
    out += ["            " + line for line in text.split("\n")]
    return out + ["        }", "    }", f"    {RETURN}", "}"]


_ROW_MODULUS = re.compile(r"\(rindex % (\d+)\)")


def _split_row_loops(lines: list[str], loops: list[RowLoop], shape: KernelShape) -> list[str]:
    """Each loop over a row whose indices take ``rindex % C`` (a reduction over several
    dimensions, such as batch norm's over N, H and W) walks the row as rows of C: the two
    counters replace ``rindex / C`` and ``rindex % C``, and the inner loop vectorizes.
    Floating sums (cpp_sums): a split row's rows fold their partial sums through a cascade;
    a loop that is not split and sums only floats walks its row in eager's order."""
    out = list(lines)
    for number, loop in reversed(list(enumerate(loops))):  # (later loops first: earlier positions stay valid)
        header = loop.start + len(loop.prelude)
        end = header + 2 + len(loop.body)  # the header, rmask's line, the body, then "}"
        if out[end] != "}":
            continue
        moduli = [int(m) for m in _ROW_MODULUS.findall("\n".join(loop.body))]
        row = max(set(moduli), key=moduli.count) if moduli else 0
        if row < 8 or not isinstance(shape.rnumel, int) or shape.rnumel % row:
            if cascaded(loop.reductions) is not None:
                out[header:end + 1] = row_in_cascade(out[header + 2:end], loop.reductions, number)
            elif sum_accumulators(loop.reductions):
                out[header:end + 1] = (split_off_sums(out[header], out[header + 2:end], loop.reductions, number)
                                       or blocks_in_cascade(out[header], out[header + 2:end], loop.reductions))
            continue
        *pragma, _ = out[header].split("\n")
        body = [line.replace(f"(rindex % {row})", "r1").replace(f"(rindex / {row})", "r0")
                for line in out[header + 2:end]]
        blocks = shape.rnumel // row
        if cascaded(loop.reductions) is not None:
            out[header:end + 1] = row_in_cascade(body, loop.reductions, number, (blocks, row))
            continue
        before, start, finish, totals = split_rows_in_cascade(loop.reductions, str(blocks))
        out[header:end + 1] = (before + [f"for (int64_t r0 = 0; r0 < {blocks}; ++r0) {{"]
                               + ["    " + line for line in start] + pragma
                               + [f"for (int64_t r1 = 0; r1 < {row}; ++r1) {{",
                                  f"    const int64_t rindex = r0 * {row} + r1;", "    constexpr bool rmask = true;"]
                               + body + ["}"] + ["    " + line for line in finish] + ["}"] + totals)
    return out


# GCC keeps a floating-point operation whose value only one side of a ``?:`` uses inside that
# branch (it might trap), and then leaves the loop scalar ("control flow in loop"): ReLU's,
# hardswish's and the clamps' backwards. Without trapping math it computes both sides and
# selects, which vectorizes: MobileNetV3's hardswish backward 250 -> 63 us for 131072 floats.
# Values are unchanged (each operation still rounds as IEEE says; nothing here reads the
# floating-point exception flags); -ffp-contract=off and -fno-math-errno stay in force.
NO_TRAPPING_MATH = '#if defined(__GNUC__) && !defined(__clang__)\n#pragma GCC optimize ("no-trapping-math")\n#endif\n'


# what every translation unit starts with, the same text for every graph (the runtime compiles
# it once per cache folder as a precompiled header: runtime/cpp_pch.py)
UNIT_PRELUDE = NO_TRAPPING_MATH + PRELUDE + SUM_PRELUDE + "\n\n"


def translation_unit(sources: list[str]) -> str:
    """One graph's kernels as one C++ file: the prelude, then each distinct kernel."""
    return UNIT_PRELUDE + "\n\n".join(sources) + "\n"
