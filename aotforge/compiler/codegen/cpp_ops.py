"""How each ``ops`` instruction is spelled in C++ (the CPU target, ``cpp.py``), keyed by
instruction name, as ``triton_ops.py`` spells them for Triton.

A row is a format string over the operands (``{0}``, ``{1}``; ``{T}`` is the C++ type the
result is held in), or a function of the operand strings and their dtype. Arithmetic results
are cast back to their dtype (``int8 + int8`` is an ``int`` in C++, and wraps as eager's
int8 only once cast). Integer division by zero and ``INT_MIN / -1`` trap on x86: the helpers
below test for them, record an error the wrapper raises as eager does, and never trap.
"""
from __future__ import annotations

from typing import Callable, Union

import torch

# the C++ type a value is held in (half types are held as float: dtypes.compute_dtype)
CPP_TYPE = {
    torch.float32: "float", torch.float64: "double", torch.int8: "int8_t", torch.int16: "int16_t",
    torch.int32: "int32_t", torch.int64: "int64_t", torch.uint8: "uint8_t", torch.bool: "bool",
}
# the C++ type of a buffer's elements (bfloat16 as its 16 bits: C++17 has no bfloat16 type)
CPP_STORAGE_TYPE = {**CPP_TYPE, torch.float16: "_Float16", torch.bfloat16: "uint16_t"}

# error codes a kernel returns (the wrapper raises them: runtime/cpp_launch.py)
ERRORS = {1: "ZeroDivisionError: integer division or remainder by zero",
          2: "index out of bounds in an indexing operation (an index tensor holds a value outside the "
             "indexed dimension's size)"}


def _float_or_int(float_form: str, int_form: str) -> Callable[[list[str], torch.dtype], str]:
    def spell(args: list[str], dtype: torch.dtype) -> str:
        form = float_form if dtype.is_floating_point else int_form
        return form.format(*args, T=CPP_TYPE.get(dtype, "float"))
    return spell


Spelling = Union[str, Callable[[list[str], torch.dtype], str]]

# instructions whose result has the operands' dtype (the printer casts the result to it)
ARITHMETIC: dict[str, Spelling] = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "rsub": "{1} - {0}", "mul": "{0} * {1}",
    "truediv": _float_or_int("{0} / {1}", "aot_truncdiv({0}, {1}, &aot_error)"),
    "neg": "-{0}",
    "abs": _float_or_int("std::abs({0})", "({0} < 0 ? -{0} : {0})"),
    "maximum": "aot_maximum({0}, {1})", "minimum": "aot_minimum({0}, {1})",
    "relu": "({0} < 0 ? {T}(0) : {0})",
    "reciprocal": "{T}(1) / {0}",
    "floordiv": _float_or_int("aot_floordiv_float({0}, {1})", "aot_floordiv({0}, {1}, &aot_error)"),
    "truncdiv": _float_or_int("std::trunc({0} / {1})", "aot_truncdiv({0}, {1}, &aot_error)"),
    "remainder": _float_or_int("aot_remainder_float({0}, {1})", "aot_remainder_int({0}, {1}, &aot_error)"),
    "fmod": _float_or_int("std::fmod({0}, {1})", "aot_fmod_int({0}, {1}, &aot_error)"),
    "pow": _float_or_int("std::pow({0}, {1})", "aot_pow_int({0}, {1})"),
    "atan2": "std::atan2({0}, {1})", "copysign": "std::copysign({0}, {1})", "hypot": "std::hypot({0}, {1})",
    # fmax/fmin ignore a NaN operand (maximum/minimum propagate it), as std::fmax does
    "fmax": _float_or_int("std::fmax({0}, {1})", "std::max({0}, {1})"),
    "fmin": _float_or_int("std::fmin({0}, {1})", "std::min({0}, {1})"),
    "sign": "{T}(({0} > 0) - ({0} < 0))",
    "floor": _float_or_int("std::floor({0})", "{0}"), "ceil": _float_or_int("std::ceil({0})", "{0}"),
    "trunc": _float_or_int("std::trunc({0})", "{0}"), "round": _float_or_int("std::nearbyint({0})", "{0}"),
    "bitwise_and": "{0} & {1}", "bitwise_or": "{0} | {1}", "bitwise_xor": "{0} ^ {1}",
    "bitwise_not": lambda args, dtype: f"!{args[0]}" if dtype == torch.bool else f"~{args[0]}",
    "rsqrt": "{T}(1) / std::sqrt({0})", "sigmoid": "{T}(1) / ({T}(1) + std::exp(-{0}))",
    "erfinv": "aot_erfinv({0})",
    "fma": "std::fma({0}, {1}, {2})",  # (one rounding: -ffp-contract=off leaves a * b + c two)
}
for _name in ["exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "sin", "cos", "tan", "asin", "acos",
              "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "lgamma"]:
    ARITHMETIC[_name] = f"std::{_name}({{0}})"

# instructions whose result is boolean
PREDICATES: dict[str, Spelling] = {
    "eq": "{0} == {1}", "ne": "{0} != {1}", "lt": "{0} < {1}", "le": "{0} <= {1}", "gt": "{0} > {1}",
    "ge": "{0} >= {1}",
    "logical_and": "({0} != 0) && ({1} != 0)", "logical_or": "({0} != 0) || ({1} != 0)",
    "logical_xor": "({0} != 0) != ({1} != 0)", "logical_not": "{0} == 0",
    "isnan": "{0} != {0}",
    "isinf": _float_or_int("std::isinf({0})", "false"),
    "signbit": _float_or_int("std::signbit({0})", "{0} < 0"),
}

# reductions (reduction_kinds.py), by their combine instruction: one step of an accumulator,
# and argmax/argmin's "replaces the best so far"
# (a masked load of a bool is an int, ``m ? ptr[i] : 0``: cast to the accumulator's type, so that
# max and min deduce one type)
ACCUMULATE = {"add": "{a} + {v}", "mul": "{a} * {v}", "maximum": "aot_maximum({a}, aot_as({a}, {v}))",
              "minimum": "aot_minimum({a}, aot_as({a}, {v}))"}
BEATS = {"maximum": "aot_beats_for_max", "minimum": "aot_beats_for_min"}

# what every translation unit starts with: the helpers above, half-type conversions, Philox
PRELUDE = r'''
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>

#ifdef AOT_MVEC
// the SIMD variants glibc's libmvec has (x86-64): loops calling these vectorize
#define AOT_SIMD __attribute__((simd("notinbranch")))
extern "C" {
AOT_SIMD float expf(float); AOT_SIMD double exp(double); AOT_SIMD float logf(float); AOT_SIMD double log(double);
AOT_SIMD float erff(float); AOT_SIMD double erf(double); AOT_SIMD float erfcf(float); AOT_SIMD double erfc(double);
AOT_SIMD float tanhf(float); AOT_SIMD double tanh(double); AOT_SIMD float expm1f(float); AOT_SIMD double expm1(double);
AOT_SIMD float log1pf(float); AOT_SIMD double log1p(double); AOT_SIMD float exp2f(float); AOT_SIMD double exp2(double);
AOT_SIMD float log2f(float); AOT_SIMD double log2(double); AOT_SIMD float log10f(float); AOT_SIMD double log10(double);
AOT_SIMD float sinf(float); AOT_SIMD double sin(double); AOT_SIMD float cosf(float); AOT_SIMD double cos(double);
AOT_SIMD float tanf(float); AOT_SIMD double tan(double); AOT_SIMD float sinhf(float); AOT_SIMD double sinh(double);
AOT_SIMD float coshf(float); AOT_SIMD double cosh(double); AOT_SIMD float asinf(float); AOT_SIMD double asin(double);
AOT_SIMD float acosf(float); AOT_SIMD double acos(double); AOT_SIMD float atanf(float); AOT_SIMD double atan(double);
AOT_SIMD float powf(float, float); AOT_SIMD double pow(double, double);
AOT_SIMD float atan2f(float, float); AOT_SIMD double atan2(double, double);
}
#endif

// an error a kernel met (ERRORS in cpp_ops.py), into the kernel's own ``aot_error`` (a local of
// the call, shared by its threads: two calls at once keep their errors apart); returned by it
static inline void aot_fail(int* error, int code) { __atomic_store_n(error, code, __ATOMIC_RELAXED); }
static int aot_num_threads = 1;
extern "C" void aot_set_num_threads(int n) { aot_num_threads = n > 0 ? n : 1; }

// ``v`` in the type of ``a`` (an accumulator, a scalar or an element of a tile's array)
#define aot_as(a, v) static_cast<std::remove_reference_t<decltype(a)>>(v)
// max and min propagate NaN as eager does (a > NaN is false, so NaN in b wins too)
template <typename T> static inline T aot_maximum(T a, T b) { return (a > b || a != a) ? a : b; }
template <typename T> static inline T aot_minimum(T a, T b) { return (a < b || a != a) ? a : b; }
// argmax/argmin: a strictly better value or the first NaN replaces the best (ties keep the first)
template <typename T> static inline bool aot_beats_for_max(T v, T best) { return v > best || (v != v && best == best); }
template <typename T> static inline bool aot_beats_for_min(T v, T best) { return v < best || (v != v && best == best); }

#pragma omp declare reduction(aot_max: float, double, int8_t, int16_t, int32_t, int64_t, uint8_t, bool: \
    omp_out = aot_maximum(omp_out, omp_in)) initializer(omp_priv = omp_orig)
#pragma omp declare reduction(aot_min: float, double, int8_t, int16_t, int32_t, int64_t, uint8_t, bool: \
    omp_out = aot_minimum(omp_out, omp_in)) initializer(omp_priv = omp_orig)

template <typename T> static inline T aot_truncdiv(T a, T b, int* error) {
    if (b == 0) { aot_fail(error, 1); return 0; }
    if (b == T(-1)) return T(-a);  // INT_MIN / -1 traps; eager's result wraps
    return T(a / b);
}
template <typename T> static inline T aot_fmod_int(T a, T b, int* error) {
    if (b == 0) { aot_fail(error, 1); return 0; }
    if (b == T(-1)) return 0;
    return T(a % b);
}
template <typename T> static inline T aot_floordiv(T a, T b, int* error) {
    T q = aot_truncdiv(a, b, error);
    return (b != 0 && b != T(-1) && (a % b) != 0 && ((a < 0) != (b < 0))) ? T(q - 1) : q;
}
template <typename T> static inline T aot_remainder_int(T a, T b, int* error) {
    T r = aot_fmod_int(a, b, error);
    return (r != 0 && ((r < 0) != (b < 0))) ? T(r + b) : r;
}
template <typename T> static inline T aot_remainder_float(T a, T b) {
    T r = std::fmod(a, b);
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
// eager's float floor division (c10's div_floor_floating, Python's rule): -5.0 // inf == -1.0,
// inf // 2.0 is NaN, where floor(a / b) gives -0.0 and inf
template <typename T> static inline T aot_floordiv_float(T a, T b) {
    if (b == 0) return a / b;
    T mod = std::fmod(a, b);
    T div = (a - mod) / b;
    if (mod != 0 && ((b < 0) != (mod < 0))) div -= T(1);
    if (div == 0) return std::copysign(T(0), a / b);
    T floordiv = std::floor(div);
    return div - floordiv > T(0.5) ? floordiv + T(1) : floordiv;
}
// eager's float-to-integer conversion. C++ leaves NaN and out-of-range values undefined, and a
// compiler may fold a constant one to anything (a NaN constant became 0); eager's kernels run
// x86's truncating conversion, to 32 or 64 bits, which gives that width's lowest value (a
// narrower type keeps the low bits). Spelled out on x86, so that it holds however it compiles.
template <typename I, typename F> static inline I aot_float_to_int(F v) {
#if defined(__x86_64__) || defined(__i386__)
    using W = typename std::conditional<(sizeof(I) > 4), int64_t, int32_t>::type;
    constexpr F low = F(std::numeric_limits<W>::min());  // -2^31 or -2^63: exact in float
    return static_cast<I>((v >= low && v < -low) ? static_cast<W>(v) : std::numeric_limits<W>::min());
#else
    return static_cast<I>(v);
#endif
}
template <typename T> static inline T aot_pow_int(T base, T exponent) {
    if (exponent < 0) return base == 1 ? T(1) : base == T(-1) ? T((exponent & 1) ? -1 : 1) : T(0);
    T result = 1;
    while (exponent) { if (exponent & 1) result = T(result * base); base = T(base * base); exponent >>= 1; }
    return result;
}
template <typename T> static inline T aot_erfinv(T y) {
    // Giles' single-precision approximation, then two Newton steps on erf (float64-accurate)
    if (y <= -1) return y == -1 ? -std::numeric_limits<T>::infinity() : std::numeric_limits<T>::quiet_NaN();
    if (y >= 1) return y == 1 ? std::numeric_limits<T>::infinity() : std::numeric_limits<T>::quiet_NaN();
    double w = -std::log((1.0 - y) * (1.0 + y)), x;
    if (w < 5.0) {
        w -= 2.5;
        x = 2.81022636e-08; x = 3.43273939e-07 + x * w; x = -3.5233877e-06 + x * w; x = -4.39150654e-06 + x * w;
        x = 0.00021858087 + x * w; x = -0.00125372503 + x * w; x = -0.00417768164 + x * w; x = 0.246640727 + x * w;
        x = 1.50140941 + x * w;
    } else {
        w = std::sqrt(w) - 3.0;
        x = -0.000200214257; x = 0.000100950558 + x * w; x = 0.00134934322 + x * w; x = -0.00367342844 + x * w;
        x = 0.00573950773 + x * w; x = -0.0076224613 + x * w; x = 0.00943887047 + x * w; x = 1.00167406 + x * w;
        x = 2.83297682 + x * w;
    }
    x *= y;
    for (int i = 0; i < 2; ++i) x -= (std::erf(x) - y) / (1.1283791670955126 * std::exp(-x * x));
    return T(x);
}

static inline float aot_bf16_to_float(uint16_t bits) {
    uint32_t word = uint32_t(bits) << 16; float value; std::memcpy(&value, &word, 4); return value;
}
static inline uint16_t aot_float_to_bf16(float value) {  // round to nearest even, NaN stays NaN
    uint32_t word; std::memcpy(&word, &value, 4);
    if (value != value) return uint16_t((word >> 16) | 0x40);
    return uint16_t((word + 0x7FFF + ((word >> 16) & 1)) >> 16);
}

// Philox4x32-10's first output word for (seed, counter): Triton's tl.randint (aotforge/philox.py)
static inline int64_t aot_philox_bits(int64_t seed, int64_t counter) {
    uint32_t k0 = uint32_t(seed), k1 = uint32_t(uint64_t(seed) >> 32);
    uint32_t c0 = uint32_t(counter), c1 = uint32_t(uint64_t(counter) >> 32), c2 = 0, c3 = 0;
    for (int round = 0; round < 10; ++round) {
        uint64_t b = uint64_t(0xCD9E8D57u) * c2, a = uint64_t(0xD2511F53u) * c0;
        uint32_t n0 = uint32_t(b >> 32) ^ c1 ^ k0, n2 = uint32_t(a >> 32) ^ c3 ^ k1;
        c1 = uint32_t(b); c3 = uint32_t(a); c0 = n0; c2 = n2;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return int64_t(c0);
}
// ... as a uniform float in [0, 1): reinterpreted as int32, negatives folded (~x), scaled
static inline float aot_philox_uniform(int64_t seed, int64_t counter) {
    int32_t bits = int32_t(uint32_t(aot_philox_bits(seed, counter)));
    return float(bits < 0 ? ~bits : bits) * 4.6566127342e-10f;
}

// an index read from a tensor, checked against its dimension's size under the op's rule
// (compiler/index_checks.py: bit 0-1 the rule, 0 = advanced indexing, whose negatives count from
// the end). A bad one records error 2 and, for the first thread to fail, its details, from which
// the launcher raises eager's exception and message; it is never used to read (0 instead).
static inline int64_t aot_check_index(int64_t index, int64_t size, int64_t check, int* error, int64_t* detail) {
    int64_t position = (index < 0 && (check & 3) == 0) ? index + size : index;
    if (position >= 0 && position < size) return position;
    int expected = 0;
    if (__atomic_compare_exchange_n(error, &expected, 2, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        detail[0] = index; detail[1] = size; detail[2] = check;  // (read after the parallel region)
    }
    return 0;
}
// the details of the calling thread's last failed call (the kernel's own threads are gone)
static thread_local int64_t aot_last_detail[3];
static inline int aot_finish(int error, const int64_t* detail) {
    if (error) { aot_last_detail[0] = detail[0]; aot_last_detail[1] = detail[1]; aot_last_detail[2] = detail[2]; }
    return error;
}
extern "C" void aot_error_detail(int64_t* out) { out[0] = aot_last_detail[0]; out[1] = aot_last_detail[1]; out[2] = aot_last_detail[2]; }
'''


def spell(table_entry: Spelling, args: list[str], dtype: torch.dtype) -> str:
    if callable(table_entry):
        return table_entry(args, dtype)
    return table_entry.format(*args, T=CPP_TYPE.get(dtype, "float"))
