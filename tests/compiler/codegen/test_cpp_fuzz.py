"""Random programs through the C++ path, against eager (issue 37).

Each program is a short random sequence of pointwise ops, reductions, views and broadcasts over
one or two inputs of a random shape (size-0 and size-1 dimensions included) and dtype (float32,
float64, int8, int32, int64, bool), with NaN and infinities among float inputs; float programs
also run their backward. CI runs 30 programs with a fixed seed; set AOTFORGE_FUZZ_COUNT (and
AOTFORGE_FUZZ_SEED) for a longer run, e.g. ``AOTFORGE_FUZZ_COUNT=500``. A failure names the
seed and the program, which replays it alone."""
from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler.runtime import cpp_build
from aotforge.config import config

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")

SEED = int(os.environ.get("AOTFORGE_FUZZ_SEED", "37"))
COUNT = int(os.environ.get("AOTFORGE_FUZZ_COUNT", "30"))

FLOAT_UNARY = ["exp", "tanh", "sigmoid", "abs", "neg", "sin", "relu", "sqrt_abs", "log1p_abs", "square"]
INT_UNARY = ["abs", "neg", "square", "floordiv3", "remainder3"]
BINARY = ["add", "sub", "mul", "maximum", "minimum", "where"]
FLOAT_REDUCTIONS = ["sum", "amax", "amin", "mean", "softmax", "log_softmax", "var"]
INT_REDUCTIONS = ["sum", "amax", "amin"]
VIEWS = ["transpose", "flip_stride", "flatten", "unsqueeze_expand"]


def random_program(rng: random.Random) -> dict:
    dtype = rng.choice([torch.float32, torch.float64, torch.float32, torch.int32, torch.int64, torch.bool, torch.int8])
    shape = [rng.choice([0, 1, 3, 8, 17, 64]) if rng.random() < 0.2 else rng.choice([1, 3, 8, 17, 64])
             for _ in range(rng.randint(1, 3))]
    steps = []
    values = 2  # the inputs
    for _ in range(rng.randint(2, 6)):
        kind = rng.choice(["unary", "binary", "reduction", "view"])
        a, b = rng.randrange(values), rng.randrange(values)
        if kind == "unary":
            steps.append(("unary", rng.choice(FLOAT_UNARY if dtype.is_floating_point else INT_UNARY), a))
        elif kind == "binary":
            steps.append(("binary", rng.choice(BINARY), a, b))
        elif kind == "reduction":
            reductions = FLOAT_REDUCTIONS if dtype.is_floating_point else INT_REDUCTIONS
            steps.append(("reduction", rng.choice(reductions), a, rng.randrange(8), rng.random() < 0.5))
        else:
            steps.append(("view", rng.choice(VIEWS), a, rng.randrange(8)))
        values += 1
    return dict(dtype=dtype, shape=shape, steps=steps, seed=rng.randrange(2**31))


def _unary(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "sqrt_abs":
        return x.abs().sqrt()
    if name == "log1p_abs":
        return x.abs().log1p()
    if name == "square":
        return x * x
    if name == "floordiv3":
        return torch.div(x, 3, rounding_mode="floor")
    if name == "remainder3":
        return torch.remainder(x, 3)
    if x.dtype == torch.bool and name in ("abs", "neg", "square"):
        return ~x if name == "neg" else x
    return getattr(torch, name)(x)


def _binary(name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bool and name in ("add", "sub", "mul"):
        name = {"add": "logical_or", "sub": "logical_xor", "mul": "logical_and"}[name]
    if name == "where":
        return torch.where(x > y, x, y)
    return getattr(torch, name)(x, y)


def _broadcastable(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` made to broadcast against ``x``: as is when it does, else reduced to a scalar."""
    # (by the shapes, in plain Python: Dynamo traces this function)
    if all(p == q or q == 1 or p == 1 for p, q in zip(reversed(x.shape), reversed(y.shape))) and y.dim() <= x.dim():
        return y
    flat = y.reshape(-1)
    return flat[:1].reshape(()) if flat.numel() else torch.zeros((), dtype=y.dtype)


def run_program(program: dict, x: torch.Tensor, y: torch.Tensor) -> list:
    values = [x, y]
    for step in program["steps"]:
        kind, name, a = step[:3]
        v = values[a]
        if kind == "unary":
            out = _unary(name, v)
        elif kind == "binary":
            out = _binary(name, v, _broadcastable(v, values[step[3]]).to(v.dtype))
        elif kind == "reduction":
            if v.dim() == 0:
                out = v
            else:
                dim, keepdim = step[3] % v.dim(), step[4]
                if name in ("amax", "amin") and v.shape[dim] == 0:
                    out = v.sum(dim, keepdim=keepdim) if v.dtype != torch.bool else v.any(dim, keepdim=keepdim)
                elif name in ("softmax", "log_softmax"):
                    out = getattr(torch, name)(v, dim)
                elif name == "var":
                    out = v.var(dim, keepdim=keepdim, correction=0)
                else:
                    out = getattr(v, name)(dim, keepdim=keepdim)
        else:
            if v.dim() < 2 and name in ("transpose", "flatten"):
                out = v.unsqueeze(-1).expand(*v.shape, 2)
            elif name == "transpose":
                out = v.transpose(0, -1)
            elif name == "flip_stride":
                out = v[..., ::2]
            elif name == "flatten":
                out = v.flatten()
            else:
                out = v.unsqueeze(0).expand(2, *v.shape)
        values.append(out)
    return values[2:]


def make_inputs(program: dict) -> tuple:
    generator = torch.Generator().manual_seed(program["seed"])
    dtype, shape = program["dtype"], program["shape"]
    if dtype.is_floating_point:
        x, y = (torch.randn(shape, generator=generator, dtype=dtype) * 3 for _ in range(2))
        if x.numel() > 2 and program["seed"] % 3 == 0:  # special values
            x.view(-1)[0], x.view(-1)[1] = float("nan"), float("inf")
        return x.requires_grad_(True), y.requires_grad_(True)
    if dtype == torch.bool:
        return tuple(torch.rand(shape, generator=generator) > 0.5 for _ in range(2))
    return tuple(torch.randint(-50, 50, shape, generator=generator, dtype=dtype) for _ in range(2))


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)


def _outputs_and_grads(fn, program: dict):
    x, y = make_inputs(program)
    outputs = fn(x, y)
    grads = []
    if program["dtype"].is_floating_point:
        total = sum((o.double().nan_to_num(0.0, 0.0, 0.0) * (i + 1)).sum()
                    for i, o in enumerate(outputs) if o.requires_grad)
        if isinstance(total, torch.Tensor) and total.requires_grad:
            grads = list(torch.autograd.grad(total, [x, y], allow_unused=True))
    return [o.detach() for o in outputs], grads


def check_program(program: dict) -> None:
    def fn(x, y):
        return run_program(program, x, y)

    try:
        expected = _outputs_and_grads(fn, program)
    except Exception as error:  # noqa: BLE001  (eager refuses: ours must refuse the same way)
        torch._dynamo.reset()
        with pytest.raises(type(error)), config.patch(cpu_codegen=True):
            _outputs_and_grads(torch.compile(fn, backend="aotforge", dynamic=False), program)
        return
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, config.patch(cpu_codegen=True):
        warnings.simplefilter("always")
        actual = _outputs_and_grads(torch.compile(fn, backend="aotforge", dynamic=False), program)
    fallbacks = [str(w.message) for w in caught if "runs as ATen calls" in str(w.message)]
    assert not fallbacks, fallbacks  # C++ that does not compile, a lowering that crashed
    for what, have, want in zip(("outputs", "gradients"), actual, expected):
        assert len(have) == len(want), what
        for h, w in zip(have, want):
            if w is None:
                assert h is None, what
                continue
            assert h.dtype == w.dtype and h.shape == w.shape, what
            torch.testing.assert_close(h, w, equal_nan=True, msg=what, **_tolerance(program["dtype"]))


def _programs():
    rng = random.Random(SEED)
    return [random_program(rng) for _ in range(COUNT)]


@pytest.mark.parametrize("number", range(COUNT))
def test_random_program_equals_eager(number):
    program = _programs()[number]
    try:
        check_program(program)
    except BaseException as failure:
        raise AssertionError(f"program {number} of seed {SEED}: {program}") from failure
    finally:
        torch._dynamo.reset()
