"""No deprecation warning from torch reaches users (issue 36): a cold compile of a dynamic-shape
graph, with the caches on (the tests' default turns them off), in a fresh process whose
FutureWarnings and DeprecationWarnings are errors; then a warm one that loads it all from the
cache. Every torch API aotforge calls on the way runs under that filter.

The cache turns an error while computing its key into "not cached" (it must never cost the
compile), so a warning turned error there would pass silently: the log must show each graph
stored, and the warm process must load them."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import torch
import aotforge
from aotforge.compiler.runtime import keys

# The key hashes aotforge's source: a checkout edited between the two processes would miss.
keys._source_digest = "the same aotforge in both processes"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                            torch.nn.Linear(16, 4))
compiled = torch.compile(model, backend="aotforge", dynamic=True)
for rows in (5, 7):  # training: forward and backward graphs over a size symbol
    x = torch.randn(rows, 8)
    out = compiled(x)
    torch.testing.assert_close(out, model(x))
    grads = torch.autograd.grad(out.sum(), list(model.parameters()))
    expected = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    torch.testing.assert_close(grads, expected)
with torch.no_grad():  # inference graph
    x = torch.randn(6, 8)
    torch.testing.assert_close(compiled(x), model(x))
print("worker done")
"""


def _run(cache_dir) -> str:
    environment = dict(os.environ, AOTFORGE_CACHE="1", AOTFORGE_CACHE_DIR=str(cache_dir), AOTFORGE_LOG="cache",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-W", "error::DeprecationWarning", "-c", WORKER],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0 and "worker done" in result.stdout, log[-4000:]
    for line in log.splitlines():
        assert "Warning" not in line, log[-4000:]
        assert "failed" not in line and "not cached" not in line, line
    return log


def test_cold_and_warm_compile_with_caches_raise_no_deprecation(tmp_path):
    log = _run(tmp_path)  # cold: everything compiled and stored
    assert "compiled-graph miss" in log, log
    assert any(name.startswith("graph_") for name in os.listdir(tmp_path)), os.listdir(tmp_path)
    log = _run(tmp_path)  # warm: everything loaded
    assert "compiled-graph hit" in log, log
    assert "compiled-graph miss" not in log, log
