"""The optimizer's pointwise math on the C++ path, bit for bit eager's (issue 37).

A compiled training loop drifted off eager's bits on the C++ path. Found by comparing each
intermediate of AdamW's step (compiled against eager, same inputs): lerp (the first moment)
and addcmul (the second) are contracted to one fma in ATen's CPU kernels, which our kernels
(built with -ffp-contract=off) computed as a multiply and an add; addcdiv multiplies before it
divides on the CPU, torch's decomposition divided first. Each now matches eager exactly.

Eager's sqrt is MKL's (on this machine 14% of float32 roots one ulp away from the correctly
rounded value): with ``cpu_eager_bits`` (the default) it stays an ATen call on the C++ path
(aotforge/eager_rounding.py), so the parameters of an AdamW step are eager's bit for bit too."""
from __future__ import annotations

import pytest
import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler import compile_fx_inner
from aotforge.compiler.runtime import cpp_build
from aotforge.config import config

from ..helpers import trace

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")


def run_cpp(fn, *args):
    gm = trace(fn, *args)
    with config.patch(triton_on_cpu=False, cpu_codegen=True):
        compiled = compile_fx_inner(gm, list(args))
    assert compiled.compiled_graph.path == "cpp"
    return compiled([a.clone() for a in args])


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("size", [1000, 37])  # (a vector body and its tail)
def test_lerp_addcmul_addcdiv_are_eager_s_bits(size):
    a, b, c = rand(size, seed=1), rand(size, seed=2) * 1e-2, rand(size, seed=3).abs() + 0.5
    weight = rand(size, seed=4)  # both sides of 0.5, negative too
    fn = lambda a, b, c, w: (torch.lerp(a, b, 0.1), torch.lerp(a, b, 0.9), torch.lerp(a, b, w),  # noqa: E731
                             torch.addcmul(a * 1e-3, b, b, value=1e-3), torch.addcmul(a, b, c, value=-2.5),
                             torch.addcdiv(a, b, c, value=-1.23e-3), torch.addcdiv(a, b, c))
    for got, expected in zip(run_cpp(fn, a, b, c, weight), fn(a, b, c, weight)):
        assert torch.equal(got, expected), (got - expected).abs().max()


def _adamw(backend: str, steps: int):
    torch._dynamo.reset()
    params = [torch.nn.Parameter(rand(32, 16, seed=5)), torch.nn.Parameter(rand(37, seed=6))]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    step = torch.compile(optimizer.step, backend=backend)
    generator = torch.Generator().manual_seed(7)
    history = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-2
        step()
        history.append(([p.detach().clone() for p in params],
                        [optimizer.state[p][k].clone() for p in params for k in ("exp_avg", "exp_avg_sq")]))
    return history


def test_adamw_moments_bit_for_bit_over_many_steps():
    with config.patch(cpu_codegen=True):
        expected = _adamw("eager", 50)
        got = _adamw("aotforge", 50)
    torch._dynamo.reset()
    for number, ((params, moments), (eager_params, eager_moments)) in enumerate(zip(got, expected)):
        for m, e in zip(moments, eager_moments):
            assert torch.equal(m, e), f"step {number}: moments differ by {(m - e).abs().max()}"
        for p, e in zip(params, eager_params):  # (eager's sqrt, MKL's, is an ATen call)
            assert torch.equal(p, e), f"step {number}: parameters differ by {(p - e).abs().max()}"
