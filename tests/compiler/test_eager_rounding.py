"""The table of ops whose eager CPU kernel rounds its own way (aotforge/eager_rounding.py),
grounded in what eager computes here (issue 37).

Every elementwise instruction and reduction the C++ printer spells (codegen/cpp_ops.py) is
computed by a compiled graph on the C++ path, with the default ``cpu_eager_bits``, on 10^5
values and a short tail (a vector body and its remainder), and compared with eager bit for
bit: an op not in the table must be computed by our kernel with eager's bits; an op in the
table must be an ATen call (which gives eager's bits by construction). The composite ops
whose decompositions the table holds back (GELU, LayerNorm, softmax, var...) are compared too,
forward and backward. With ``cpu_eager_bits`` off the table's ops fuse again."""
from __future__ import annotations

import pytest
import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge import eager_rounding
from aotforge.compiler import compile_fx_inner
from aotforge.compiler.decompositions import eager_rounding_active
from aotforge.compiler.codegen import cpp_ops
from aotforge.compiler.lowering.pointwise import POINTWISE_TABLE
from aotforge.compiler.runtime import cpp_build
from aotforge.config import config

from .helpers import trace

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")
aten = torch.ops.aten
F = torch.nn.functional


def _aten_ops_by_instruction() -> dict:
    """instruction -> the ATen op lowered to it (a Tensor/default overload where there is one)."""
    found: dict = {}
    for op, (name, _) in POINTWISE_TABLE.items():
        if name not in found or op._overloadname in ("Tensor", "default"):
            found[name] = op
    return found


BY_INSTRUCTION = _aten_ops_by_instruction()
# instructions some other lowering emits: how a program reaches them
OTHER_SOURCES = {
    "floordiv": aten.floor_divide.default, "remainder": aten.remainder.Tensor, "fmod": aten.fmod.Tensor,
    "truncdiv": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "fma": lambda a, b, c: torch.addcmul(c, a, b, value=0.5),
}
BINARY = {"add", "sub", "rsub", "mul", "truediv", "maximum", "minimum", "floordiv", "truncdiv", "remainder", "fmod",
          "pow", "atan2", "copysign", "hypot", "fmax", "fmin", "eq", "ne", "lt", "le", "gt", "ge",
          "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor"}
INTEGER_ONLY = {"bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not"}


def _domain(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` moved into the instruction's domain (exact steps: both sides compute them alike)."""
    if name in ("asin", "acos", "atanh", "erfinv"):
        return x.remainder(2.0) - 1.0
    if name == "acosh":
        return x.abs() + 1
    if name in ("log", "log2", "log10", "sqrt", "rsqrt", "lgamma", "pow"):
        return x.abs() * 8
    if name in ("exp", "exp2", "expm1", "sinh", "cosh"):
        return x * 8
    return x


def _instruction_program(names: list[str]):
    """One graph computing every instruction in ``names`` from the same inputs."""
    def program(x, y, z):
        outputs = []
        for name in names:
            op = BY_INSTRUCTION.get(name) or OTHER_SOURCES[name]
            a = _domain(name, x)
            args = (a, y, z) if name == "fma" else (a, y) if name in BINARY else (a,)
            outputs.append(op(*args))
        return tuple(outputs)
    return program


def _bitwise_equal(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    if not got.dtype.is_floating_point:
        return got == expected
    both_nan = got.isnan() & expected.isnan()
    return both_nan | ((got == expected) & (got.signbit() == expected.signbit()))


def _compile_cpp(fn, *args, **patches):
    with config.patch(triton_on_cpu=False, cpu_codegen=True, **patches):
        gm = trace(fn, *args)  # (the decompositions see the C++ path's config too)
        compiled = compile_fx_inner(gm, list(args))
    graph = compiled.compiled_graph
    assert graph.path == "cpp", graph
    return compiled, graph


def _op_name(op) -> str:
    return str(op) if isinstance(op, torch._ops.OpOverload) else ""


def _check_instructions(names: list[str], dtype: torch.dtype, length: int):
    generator = torch.Generator().manual_seed(length)
    if dtype.is_floating_point:
        x, y, z = (torch.randn(length, generator=generator, dtype=dtype) * 3 for _ in range(3))
        x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")], dtype=dtype)
    else:
        low = 0 if dtype == torch.uint8 else -100
        x, y, z = (torch.randint(low, 100, (length,), generator=generator, dtype=dtype) for _ in range(3))
    program = _instruction_program(names)
    compiled, graph = _compile_cpp(program, x, y, z)
    got, expected = compiled([x, y, z]), program(x, y, z)
    fused_but_different = []
    for name, g, e in zip(names, got, expected):
        op = BY_INSTRUCTION.get(name) or OTHER_SOURCES[name]
        in_table = isinstance(op, torch._ops.OpOverload) and eager_rounding.eager_rounding(op) is not None
        if in_table:  # an ATen call: eager's kernel itself
            assert graph.lowered.fallback_ops.get(_op_name(op)), (name, graph.lowered.fallback_ops)
        different = int((~_bitwise_equal(g, e)).sum())
        if different:
            fused_but_different.append(f"{name}: {different} of {length}")
    assert not fused_but_different, (
        f"{dtype}: these instructions are not eager's bits; if eager's kernel rounds its own way, "
        f"add their ATen op to eager_rounding.EAGER_ROUNDING: {fused_but_different}")


FLOAT_INSTRUCTIONS = [name for name in list(cpp_ops.ARITHMETIC) + list(cpp_ops.PREDICATES) if name not in INTEGER_ONLY]


def test_every_instruction_has_an_aten_source():
    for name in list(cpp_ops.ARITHMETIC) + list(cpp_ops.PREDICATES):
        assert name in BY_INSTRUCTION or name in OTHER_SOURCES, name


@pytest.mark.parametrize("length", [100_003, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_instructions_not_in_the_table_are_eagers_bits(dtype, length):
    _check_instructions(FLOAT_INSTRUCTIONS, dtype, length)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_instructions_are_eagers_bits(dtype):
    names = [n for n in list(cpp_ops.ARITHMETIC) + list(cpp_ops.PREDICATES)
             if n not in ("pow", "truediv", "floordiv", "truncdiv", "remainder", "fmod", "sign", "neg", "abs")
             and (n in INTEGER_ONLY or BY_INSTRUCTION.get(n) is not None and
                  eager_rounding.eager_rounding(BY_INSTRUCTION[n]) is None and n not in ("reciprocal", "rsqrt"))]
    if dtype == torch.uint8:
        names = [n for n in names if n not in ("rsub", "sub")]
    _check_instructions(names, dtype, 1003)


REDUCTIONS = {  # the reductions ACCUMULATE spells, over rows and over everything
    "add": lambda x: (x.sum(-1), x.sum(0), x.mean(-1)),
    "mul": lambda x: ((x * 0.01 + 1).prod(-1),),
    "maximum": lambda x: (x.amax(-1), x.amax(0), x.argmax(-1)),
    "minimum": lambda x: (x.amin(-1), x.amin(0), x.argmin(-1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("combine", list(cpp_ops.ACCUMULATE))
def test_reductions(combine, dtype):
    fn = REDUCTIONS[combine]
    for rows, columns in ((2701, 64), (3, 4)):
        x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows), dtype=dtype) * 2
        compiled, graph = _compile_cpp(fn, x)
        for got, expected in zip(compiled([x]), fn(x)):
            assert bool(_bitwise_equal(got, expected).all()), (combine, rows, (got - expected).abs().max())
        if combine == "mul":  # ATen's product multiplies in vector lanes
            assert graph.lowered.fallback_ops.get("aten.prod.dim_int"), graph.lowered.fallback_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2701, 37), (2701, 5), (17, 8), (8, 4), (300, 100), (300, 5, 7), (2701, 1)])
def test_column_sums_past_the_last_group_of_columns(shape, dtype):
    """ATen sums whole groups of four vectors of columns (of four columns, when there are fewer
    than a vector's) in multi_row_sum's order, the columns after them in row_sum's (rows
    interleaved by four): a Linear's bias gradient over 4 or 10 features took the wrong one
    (a float64 training loop drifted off eager's bits at step 100)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1]), dtype=dtype) * 2
    compiled, _ = _compile_cpp(lambda x: (x.sum(0),), x)
    assert torch.equal(compiled([x])[0], x.sum(0))


WEIGHT = torch.randn(37, generator=torch.Generator().manual_seed(3))
COMPOSITES = {  # composite ops the table keeps whole: forward and backward are eager's bits
    "gelu": lambda x: F.gelu(x) * 2, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh") * 2,
    "layer_norm": lambda x: F.layer_norm(x * 2, (37,), WEIGHT.to(x.dtype), WEIGHT.to(x.dtype) + 1),
    "softmax": lambda x: F.softmax(x * 2, -1), "log_softmax": lambda x: F.log_softmax(x * 2, -1),
    "var": lambda x: x.var(-1) + x.var(0).sum(), "std_mean": lambda x: torch.std_mean(x * 2, -1),
    "silu": lambda x: F.silu(x) + 1, "mish": lambda x: F.mish(x) + 1, "elu": lambda x: F.elu(x) + 1,
    "softplus": lambda x: F.softplus(x) + 1, "logsigmoid": lambda x: F.logsigmoid(x) + 1,
    "group_norm": lambda x: F.group_norm(x.view(-1, 37, 1), 1).view(-1) * 2,
    "vector_norm": lambda x: torch.linalg.vector_norm(x * 2, dim=-1),
    "cross_entropy": lambda x: F.cross_entropy(x * 2, torch.arange(x.shape[0]) % 37),
    "sqrt_pow": lambda x: (x.abs() + 1) ** 0.5 + x ** 2 + x.abs() ** 1.5,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(COMPOSITES))
def test_composites_forward_and_backward_are_eagers_bits(name, dtype):
    fn = COMPOSITES[name]
    x = torch.randn(67, 37, generator=torch.Generator().manual_seed(5), dtype=dtype, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aotforge")
    with config.patch(cpu_codegen=True):
        got = compiled(x)
        got = got if isinstance(got, tuple) else (got,)
        (got_grad,) = torch.autograd.grad(sum(g.sum() for g in got), x)
    expected = fn(x)
    expected = expected if isinstance(expected, tuple) else (expected,)
    (expected_grad,) = torch.autograd.grad(sum(e.sum() for e in expected), x)
    torch._dynamo.reset()
    for g, e in list(zip(got, expected)) + [(got_grad, expected_grad)]:
        assert bool(_bitwise_equal(g.detach(), e.detach()).all()), (name, (g - e).abs().max())


def test_off_the_table_ops_fuse_with_our_own_math():
    x = torch.rand(1000, dtype=torch.float32) + 0.5
    fn = lambda x: (F.gelu(x).exp().sqrt() + F.layer_norm(x.view(10, 100), (100,)).view(-1),)  # noqa: E731
    for eager_bits, expect_calls in ((True, True), (False, False)):
        compiled, graph = _compile_cpp(fn, x, cpu_eager_bits=eager_bits)
        calls = set(graph.lowered.fallback_ops)
        assert bool(calls & {"aten.gelu.default", "aten.exp.default", "aten.sqrt.default",
                             "aten.native_layer_norm.default"}) == expect_calls, calls
        torch.testing.assert_close(compiled([x])[0], fn(x)[0])


def test_the_table_is_off_on_the_aten_path_and_for_triton():
    with config.patch(cpu_codegen=False):
        assert not eager_rounding_active()
    with config.patch(cpu_eager_bits=False):
        assert not eager_rounding_active()
    with config.patch(triton_on_cpu=True):
        assert not eager_rounding_active()
    with config.patch(cpu_codegen=True, cpu_eager_bits=True):
        assert eager_rounding_active()


def test_the_backward_reads_saved_outputs_of_eager_kernels_not_recomputes_them():
    """GELU, LayerNorm, exp and sqrt stay eager's kernels: a backward that recomputed them
    would pay a whole unfused pass of each again (partition/op_costs.py saves them)."""
    from aotforge.compiler import observe

    x, w = torch.rand(64, 37, requires_grad=True), torch.randn(37)
    fn = lambda x, w: F.layer_norm(F.gelu(x * 2), (37,), w).exp().sum(-1) + x.sqrt().sum(-1)  # noqa: E731
    torch._dynamo.reset()
    with config.patch(cpu_codegen=True), observe() as graphs:
        out = torch.compile(fn, backend="aotforge")(x, w)
        (grad,) = torch.autograd.grad(out.sum(), x)
    torch._dynamo.reset()
    x_eager = x.detach().requires_grad_(True)
    expected = fn(x_eager, w)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x_eager)
    assert torch.equal(out, expected) and torch.equal(grad, expected_grad)
    forward, backward = graphs
    assert {"aten.gelu.default", "aten.native_layer_norm.default"} <= set(forward.lowered.fallback_ops)
    recomputed = {"aten.gelu.default", "aten.native_layer_norm.default", "aten.exp.default", "aten.sqrt.default"}
    assert not recomputed & set(backward.lowered.fallback_ops), backward.lowered.fallback_ops
