"""Symbolic sizes on CUDA (issue 14): compiled Triton (not the interpreter) with sizes as
kernel arguments, grids from the actual sizes, direct launches across sizes; one compiled
graph per direction, equal to eager."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and compiled, not interpreted, Triton)")

import aotforge  # noqa: E402,F401
from aotforge.compiler.pipeline import observe  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "compiler"))
from models import TinyGPT, train_step  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_gpt_every_size_one_graph_per_direction(dtype):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = TinyGPT(vocab=96, width=64, context=256).cuda()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aotforge", dynamic=True)
    graphs = []
    for batch in (2, 5):
        for length in (64, 100, 256):
            idx = torch.randint(0, 96, (batch, length), device="cuda")
            targets = torch.randint(0, 96, (batch, length), device="cuda")
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32), observe() as seen:
                loss, grads = train_step(compiled, idx, targets)
                expected, expected_grads = train_step(eager, idx, targets)
            tolerance = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(loss, expected, **tolerance)
            for got, want in zip(grads, expected_grads):
                torch.testing.assert_close(got, want, **tolerance)
            graphs += seen
    assert sorted(g.kind for g in graphs) == ["backward", "forward"]
    assert all(g.path == "triton" and g.lowered.sizes.dynamic and not g.stats["lowering_errors"] for g in graphs)
    # after the first call every kernel launches directly (past Triton's dispatch), whatever the size
    launchers = [k for g in graphs for k in g.launchers.values()]
    assert launchers and all(k.direct is not None and all(k.direct.launches.values()) for k in launchers)
