"""Floating-point sums in the C++ kernels, accumulated in blocks as eager's are (issue 37).

One accumulator walking a row of 10^6 float32 values loses about log2(10^6) more bits than
eager's cascade summation (ATen's ``SumKernel.cpp``): sums, means and the statistics of var and
LayerNorm drifted from float64 8 to 8,000 times further than eager's. Every arrangement of a
reduction loop (``cpp.py``) therefore sums floats in blocks whose partial sums move up a short
cascade of levels, so that only numbers of a similar size are added together:

* a row (the builder's own loop over ``rindex``): ATen's order for a contiguous row, exactly
  (``vectorized_inner_sum``, or ``scalar_inner_sum`` for a row shorter than one vector): lanes
  of vectors of ``VEC`` values in groups of four, whose lane sums move up four levels every
  2^power groups (power = max(4, ceil(log2(groups)) / 4)); the vectors after the last group go
  into the first vector's lanes, the four vectors' lanes are folded, then the values after the
  last vector and the lanes are added one by one. A single-threaded float32 or float64 sum of a
  contiguous row is then bit for bit eager's (eager splits a sum of over 32,768 values into one
  piece per thread; there the two orders differ, with the same accuracy). The lanes are
  independent, so the loop over them vectorizes without reordering any addition;
* a row split into rows of ``C`` (a reduction over several dimensions, ``rindex % C``): each
  row of C is summed in SIMD lanes, and the rows' partial sums go through the same cascade;
* columns (``_columns``, a reduction down columns): each column's sum over rows takes the
  cascade of levels, as ATen's ``vectorized_outer_sum`` does.

Only sums of floating values are changed (integer sums are exact in any order; max, min and
argmax do not round). A row loop that also holds another kind of reduction (a sum beside a max
or an argmax) becomes two loops, the sums' in eager's order; one that also stores walks its
row in blocks of ``BLOCK`` values, each sum's block partials through the cascade.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from .cpp_ops import CPP_TYPE


def _vector_bytes() -> int:
    """The width of ATen's ``Vectorized`` on this CPU (the lanes of eager's sums): 64 bytes
    with AVX-512 kernels, else 32 (AVX2, and ATen's default vectors, are 32 bytes)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # (a build without the query: ATen's default width)
        return 32
    return 64 if "AVX512" in capability.upper() else 32


VECTOR_BYTES = _vector_bytes()
CASCADE_TYPES = (torch.float32, torch.float64)  # (half types are held, and summed, as float)

SUM_PRELUDE = r'''
// ---- floating-point sums in eager's cascade order (codegen/cpp_sums.py) ----
static inline int64_t aot_ceil_log2(int64_t x) {  // ATen's CeilLog2: 1 for x <= 2
    return x <= 2 ? 1 : 64 - __builtin_clzll(uint64_t(x) - 1);
}
// K sums of one row of n values in ATen's order (SumKernel.cpp's row_sum over vectors of W
// lanes, four vectors at a time, then the vectors and values left over): element(rindex, acc,
// stride) adds element rindex's K values to acc[0], acc[stride], ...
template <int64_t W, int64_t K, typename T, typename F>
static inline void aot_cascade_lanes(int64_t n, T* result, F& element) {
    constexpr int64_t L = 4 * W;
    alignas(64) T acc[4][K * L];
    for (int64_t i = 0; i < 4 * K * L; ++i) (&acc[0][0])[i] = T(0);
    const int64_t vectors = n / W, groups = vectors / 4;
    const int64_t power = std::max<int64_t>(4, aot_ceil_log2(groups) / 4);
    const int64_t step = int64_t(1) << power, mask = step - 1;
    int64_t g = 0;
    while (g + step <= groups) {
        for (int64_t j = 0; j < step; ++j, ++g) {
            #pragma omp simd
            for (int64_t l = 0; l < L; ++l) element(g * L + l, &acc[0][l], L);
        }
        for (int64_t level = 1; level < 4; ++level) {  // 2^power groups done: up a level
            for (int64_t i = 0; i < K * L; ++i) { acc[level][i] += acc[level - 1][i]; acc[level - 1][i] = T(0); }
            if ((g & (mask << (level * power))) != 0) break;
        }
    }
    for (; g < groups; ++g) {
        #pragma omp simd
        for (int64_t l = 0; l < L; ++l) element(g * L + l, &acc[0][l], L);
    }
    for (int64_t level = 1; level < 4; ++level)
        for (int64_t i = 0; i < K * L; ++i) acc[0][i] += acc[level][i];
    for (int64_t v = groups * 4; v < vectors; ++v)  // vectors after the last group of four
        for (int64_t l = 0; l < W; ++l) element(v * W + l, &acc[0][l], L);
    for (int64_t k = 0; k < K; ++k)
        for (int64_t b = 1; b < 4; ++b)
            for (int64_t l = 0; l < W; ++l) acc[0][k * L + l] += acc[0][k * L + b * W + l];
    T tail[K];
    for (int64_t k = 0; k < K; ++k) tail[k] = T(0);
    for (int64_t e = vectors * W; e < n; ++e) element(e, tail, 1);  // values after the last vector
    for (int64_t k = 0; k < K; ++k) {
        for (int64_t l = 0; l < W; ++l) tail[k] += acc[0][k * L + l];
        result[k] = tail[k];
    }
}
// a row shorter than one vector is summed as scalars (ATen's scalar_inner_sum: lanes of one)
template <int64_t VEC, int64_t K, typename T, typename F>
static inline void aot_cascade_row(int64_t n, T* result, F&& element) {
    if (n >= VEC) aot_cascade_lanes<VEC, K>(n, result, element);
    else aot_cascade_lanes<1, K>(n, result, element);
}
// partial sums of blocks (rows of a split row) folded through the same cascade of levels
template <typename T> struct aot_cascade {
    T level[4] = {T(0), T(0), T(0), T(0)};
    int64_t count = 0, power, mask;
    explicit aot_cascade(int64_t blocks)
        : power(std::max<int64_t>(4, aot_ceil_log2(blocks) / 4)), mask((int64_t(1) << power) - 1) {}
    inline void add(T value) {
        level[0] += value;
        if ((++count & mask) != 0) return;
        for (int64_t j = 1; j < 4; ++j) {
            level[j] += level[j - 1]; level[j - 1] = T(0);
            if ((count & (mask << (j * power))) != 0) break;
        }
    }
    inline T total() const { return ((level[0] + level[1]) + level[2]) + level[3]; }
};
'''


def cascaded(reductions: list) -> Optional[torch.dtype]:
    """The accumulators' dtype when every reduction of a loop is a floating sum (the loops
    this module rearranges), else None."""
    if not reductions:
        return None
    dtypes = {dtype for _, _, dtype in reductions}
    if any(kind.combine != "add" or kind.returns_index for kind, _, _ in reductions) or len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    return dtype if dtype in CASCADE_TYPES else None


def sum_accumulators(reductions: list) -> list[str]:
    """The accumulators of a loop's floating sums (others in the loop are left alone)."""
    return [name for kind, name, dtype in reductions
            if kind.combine == "add" and not kind.returns_index and dtype in CASCADE_TYPES]


def row_in_cascade(body: list[str], reductions: list, number: int, split: Optional[tuple[int, int]] = None) -> list[str]:
    """A row loop's ``body`` lines (after its ``rmask`` line, indented under the loop) as a
    lambda over one element, run by ``aot_cascade_row`` in eager's order; its K accumulators
    are set from the row's sums after it. ``split`` = (blocks, C): the row as ``blocks``
    rows of C (``r0``, ``r1``; the body's indices use them), each summed in eager's order,
    the rows' sums folded through ``aot_cascade``."""
    dtype = cascaded(reductions)
    ctype = CPP_TYPE[dtype]
    names = [name for _, name, _ in reductions]
    slots = {name: f"aot_acc[{k} * aot_stride]" for k, name in enumerate(names)}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    lanes = VECTOR_BYTES // dtype.itemsize
    element, sums = f"aot_row{number}", f"aot_sums{number}"
    counter, count = ("r1", str(split[1])) if split else ("rindex", "rnumel")
    # values captured by copy: a captured reference to a pointer is reloaded after every store
    # the compiler cannot prove does not alias it (-fno-strict-aliasing), and the loop over lanes
    # then does not vectorize; the error word and a bad index's details are shared
    shared = ", &aot_error" + (", &aot_detail" if any("aot_detail" in line for line in body) else "")
    out = [f"auto {element} = [={shared}](int64_t {counter}, {ctype}* aot_acc, int64_t aot_stride) {{"]
    if split:
        out.append(f"    const int64_t rindex = r0 * {split[1]} + r1;")
    out.append("    constexpr bool rmask = true;")
    out += [pattern.sub(lambda m: slots[m.group(1)], line) for line in body]
    out += ["};", f"{ctype} {sums}[{len(names)}];",
            f"aot_cascade_row<{lanes}, {len(names)}>({count}, {sums}, {element});"]
    if not split:
        return out + [f"{name} = {sums}[{k}];" for k, name in enumerate(names)]
    return ([f"aot_cascade<{ctype}> {name}_cascade({split[0]});" for name in names]
            + [f"for (int64_t r0 = 0; r0 < {split[0]}; ++r0) {{"] + ["    " + line for line in out]
            + [f"    {name}_cascade.add({sums}[{k}]);" for k, name in enumerate(names)] + ["}"]
            + [f"{name} = {name}_cascade.total();" for name in names])


def split_off_sums(header: str, body: list[str], reductions: list, number: int) -> Optional[list[str]]:
    """A row loop (its ``header`` line, pragma included, and ``body`` lines after ``rmask``'s)
    whose floating sums share it with other reductions (a max, an argmax), and which stores
    nothing: two loops over the row, the sums in eager's order (``row_in_cascade``), then the
    other reductions under the loop's own pragma. Each loop computes only what its
    reductions use (the compiler drops the rest); one loop of both kinds, or one in blocks,
    was measured 1.6x slower (its SIMD reductions of two kinds no longer vectorized well)."""
    sums = sum_accumulators(reductions)
    summed = [r for r in reductions if r[1] in sums]
    if cascaded(summed) is None or any(re.search(r"\]\s*=[^=]", line) for line in body):
        return None
    others = [r[1] for r in reductions if r[1] not in sums]

    def without(names: list[str], lines: list[str]) -> list[str]:
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
        return [line for line in lines if not pattern.search(line)]

    sum_loop = row_in_cascade(without(others, body), summed, number)
    *pragma, loop_header = header.split("\n")
    pragma = [re.sub(r"\s*reduction\(\+:(" + "|".join(map(re.escape, sums)) + r")\)", "", line) for line in pragma]
    return sum_loop + pragma + [loop_header, "    constexpr bool rmask = true;"] + without(sums, body) + ["}"]


# values a loop that sums floats beside other reductions and stores sums per block before the
# blocks' partial sums go through the cascade (the other reductions run on undisturbed)
BLOCK = 256


def blocks_in_cascade(header: str, body: list[str], reductions: list) -> list[str]:
    """A row loop (its ``header`` line, pragma included, and ``body`` lines after ``rmask``'s)
    whose floating sums share it with other reductions: the row in blocks of ``BLOCK``, each
    sum reset per block and its partial folded through ``aot_cascade``."""
    names = sum_accumulators(reductions)
    dtypes = {name: dtype for _, name, dtype in reductions}
    *pragma, _ = header.split("\n")
    out = [f"aot_cascade<{CPP_TYPE[dtypes[n]]}> {n}_cascade((rnumel + {BLOCK - 1}) / {BLOCK});" for n in names]
    out += [f"for (int64_t aot_b = 0; aot_b < rnumel; aot_b += {BLOCK}) {{"] + [f"    {n} = 0;" for n in names]
    out += pragma + [f"for (int64_t rindex = aot_b; rindex < std::min<int64_t>(rnumel, aot_b + {BLOCK}); ++rindex) {{",
                     "    constexpr bool rmask = true;"]
    out += body + ["}"] + [f"    {n}_cascade.add({n});" for n in names] + ["}"]
    return out + [f"{n} = {n}_cascade.total();" for n in names]


def split_rows_in_cascade(reductions: list, blocks: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """For a row split into ``blocks`` rows: (before the loop over rows, at the start of each
    row, after each row) lines that fold each row's partial sum through the cascade, and
    (fourth) the lines after the loop that set the accumulators to the totals."""
    names = sum_accumulators(reductions)
    dtypes = {name: dtype for _, name, dtype in reductions}
    before = [f"aot_cascade<{CPP_TYPE[dtypes[n]]}> {n}_cascade({blocks});" for n in names]
    start = [f"{n} = 0;" for n in names]
    end = [f"{n}_cascade.add({n});" for n in names]
    return before, start, end, [f"{n} = {n}_cascade.total();" for n in names]


def columns_in_cascade(reductions: list, tile: int) -> tuple[list[str], str, list[str], list[str]]:
    """For tiles of columns summed down rows (``cpp._columns``): the declarations of each
    floating sum's upper levels (per tile), the row loop's header (rows in steps of 2^power,
    then the rows left over), the cascade after each full step, and the fold of the levels.
    Per column this is ATen's ``multi_row_sum`` order."""
    names = sum_accumulators(reductions)
    dtypes = {name: dtype for _, name, dtype in reductions}
    declare = [f"{CPP_TYPE[dtypes[n]]} {n}_up[3][{tile}] = {{}};" for n in names]
    declare += ["const int64_t aot_power = std::max<int64_t>(4, aot_ceil_log2(rnumel) / 4);",
                "const int64_t aot_step = int64_t(1) << aot_power, aot_mask = aot_step - 1;"]
    header = ("for (int64_t aot_r = 0; aot_r < rnumel; aot_r += aot_step) {\n"
              "const int64_t aot_end = std::min<int64_t>(rnumel, aot_r + aot_step);\n"
              "for (int64_t rindex = aot_r; rindex < aot_end; ++rindex) {")
    cascade = ["if (aot_end - aot_r == aot_step) {",
               "    for (int64_t aot_level = 1; aot_level < 4; ++aot_level) {",
               "        for (int64_t xi = 0; xi < xcount; ++xi) {"]
    for n in names:
        cascade += [f"            auto& aot_low_{n} = aot_level == 1 ? {n}[xi] : {n}_up[aot_level - 2][xi];",
                    f"            {n}_up[aot_level - 1][xi] += aot_low_{n}; aot_low_{n} = 0;"]
    cascade += ["        }", "        if ((aot_end & (aot_mask << (aot_level * aot_power))) != 0) break;", "    }", "}"]
    fold = [f"{n}[xi] += {n}_up[{level}][xi];" for n in names for level in range(3)]
    return declare, header, cascade, fold


def column_groups(reductions: list) -> Optional[str]:
    """How many leading columns (of ``xnumel``) ATen sums in ``multi_row_sum``'s order: whole
    groups of four vectors (``vectorized_outer_sum``), or of four columns when there are fewer
    columns than one vector holds (``scalar_outer_sum``). The columns after them take
    ``row_sum``'s order (``columns_in_row_sum_order``). None: one order for all (no floating
    sum, or sums of two dtypes)."""
    names = sum_accumulators(reductions)
    dtypes = {dtype for _, name, dtype in reductions if name in names}
    if len(dtypes) != 1:
        return None
    lanes = VECTOR_BYTES // next(iter(dtypes)).itemsize
    # (one column is a contiguous row to ATen: its own cascade, which the tiles give it)
    return (f"(xnumel < 2 ? xnumel : xnumel >= {lanes} ? xnumel / {4 * lanes} * {4 * lanes} "
            f": xnumel / 4 * 4)")


def columns_in_row_sum_order(reductions: list, tile: int, row_lines: list[str]) -> list[str]:
    """A tile of columns after ATen's groups (``column_groups``), each column summed in
    ``row_sum``'s order: the rows interleaved by four (rindex % 4, each class with its own
    cascade of levels over rnumel / 4 rows), the rows left over added to the first class after
    its levels are folded, then the four classes added in order. ``row_lines`` are one row's
    lines over the tile (its SIMD loop over ``xi``), which add into the accumulator arrays:
    each sum's name is a pointer to its class's array while they run."""
    names = sum_accumulators(reductions)
    dtypes = {name: dtype for _, name, dtype in reductions}
    out = []
    for n in names:
        out += [f"{CPP_TYPE[dtypes[n]]} {n}_cls[4][{tile}] = {{}};", f"{CPP_TYPE[dtypes[n]]} {n}_ilp[4][3][{tile}] = {{}};"]
    out += ["const int64_t aot_ilp = rnumel / 4;",
            "const int64_t aot_ipower = std::max<int64_t>(4, aot_ceil_log2(aot_ilp) / 4);",
            "const int64_t aot_istep = int64_t(1) << aot_ipower, aot_imask = aot_istep - 1;",
            "for (int64_t aot_i0 = 0; aot_i0 < aot_ilp; aot_i0 += aot_istep) {",
            "    const int64_t aot_iend = std::min<int64_t>(aot_ilp, aot_i0 + aot_istep);",
            "    for (int64_t aot_i = aot_i0; aot_i < aot_iend; ++aot_i) {",
            "        for (int64_t aot_c = 0; aot_c < 4; ++aot_c) {",
            "            const int64_t rindex = aot_i * 4 + aot_c;"]
    out += [f"            {CPP_TYPE[dtypes[n]]}* {n} = {n}_cls[aot_c];" for n in names]
    out += ["            " + line for line in row_lines] + ["        }", "    }"]
    out += ["    if (aot_iend - aot_i0 == aot_istep) {",
            "        for (int64_t aot_level = 1; aot_level < 4; ++aot_level) {",
            "            for (int64_t aot_c = 0; aot_c < 4; ++aot_c) {",
            "                for (int64_t xi = 0; xi < xcount; ++xi) {"]
    for n in names:
        out += [f"                    auto& aot_low_{n} = aot_level == 1 ? {n}_cls[aot_c][xi] "
                f": {n}_ilp[aot_c][aot_level - 2][xi];",
                f"                    {n}_ilp[aot_c][aot_level - 1][xi] += aot_low_{n}; aot_low_{n} = 0;"]
    out += ["                }", "            }",
            "            if ((aot_iend & (aot_imask << (aot_level * aot_ipower))) != 0) break;",
            "        }", "    }", "}",
            "for (int64_t aot_c = 0; aot_c < 4; ++aot_c) {", "    for (int64_t xi = 0; xi < xcount; ++xi) {"]
    out += [f"        {n}_cls[aot_c][xi] += {n}_ilp[aot_c][{level}][xi];" for n in names for level in range(3)]
    out += ["    }", "}", "for (int64_t rindex = aot_ilp * 4; rindex < rnumel; ++rindex) {"]
    out += [f"    {CPP_TYPE[dtypes[n]]}* {n} = {n}_cls[0];" for n in names]
    out += ["    " + line for line in row_lines] + ["}", "for (int64_t xi = 0; xi < xcount; ++xi) {"]
    out += [f"    {n}[xi] = (({n}_cls[0][xi] + {n}_cls[1][xi]) + {n}_cls[2][xi]) + {n}_cls[3][xi];" for n in names]
    return out + ["}"]
