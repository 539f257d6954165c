"""Training under CPU autocast: layer norm's CPU kernel returns float32 statistics for a
bfloat16 input with float32 weights, where its fake implementation says bfloat16."""
from __future__ import annotations

import pytest
import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge import aot_function, nop


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("backend", ["aotforge_eager", "aotforge"])
def test_layer_norm_under_cpu_autocast_trains_as_eager(backend):
    model, reference = _model(), _model()
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, expected = compiled(x), reference(x)
        out.float().square().sum().backward()
        expected.float().square().sum().backward()
        assert out.dtype == expected.dtype
        # aotforge's kernels hold a fused chain's values in float32 and round to bfloat16 once,
        # where eager rounds after each op: bfloat16's tolerance, a few of its ulps
        tolerance = {} if backend == "aotforge_eager" else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out, expected, **tolerance)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tolerance)


def test_a_compiler_returning_another_integer_dtype_is_still_refused():
    def bad_compiler(gm, example_inputs):
        return lambda *args: tuple(t.to(torch.int32) for t in gm(*args))

    compiled = aot_function(lambda x: x.to(torch.int64) + 1, fw_compiler=bad_compiler, bw_compiler=nop)
    with pytest.raises(RuntimeError, match="returned output 0"):
        compiled(torch.ones(3))
