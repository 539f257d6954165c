"""AOTFORGE_VERIFY's accuracy bisector: a planted wrong kernel is found, reported with the
user's source line, and its repro script runs on its own."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")  # the generated Triton kernels run on the CPU

import pytest
import torch

import aotforge
from aotforge.compiler.lowering.registry import LOWERINGS
from aotforge.config import config
from aotforge.verify import AccuracyError, TOLERANCES, difference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(aotforge.__file__)))
aten = torch.ops.aten

# Planted bug: sin lowered as cos. Used in this process and in the repro's process.
PLANT = ("from aotforge.compiler.lowering.registry import LOWERINGS\n"
         "import torch\n"
         "LOWERINGS[torch.ops.aten.sin.default] = LOWERINGS[torch.ops.aten.cos.default]\n")


def model(x, w):
    a = x * 3
    b = a.sin()  # the planted wrong kernel computes this line
    c = b + w
    return c.relu().sum(-1)


def _run(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO, TRITON_INTERPRET="1", **(env or {}))
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_planted_wrong_kernel_is_found_with_source_line_and_repro(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTFORGE_DUMP_DIR", str(tmp_path))
    monkeypatch.setitem(LOWERINGS, aten.sin.default, LOWERINGS[aten.cos.default])
    torch._dynamo.reset()
    x, w = torch.randn(4, 16), torch.randn(4, 16)
    compiled = torch.compile(model, backend="aotforge", options={"triton_on_cpu": True, "verify": True})
    with pytest.raises(AccuracyError) as caught:
        compiled(x, w)
    report = caught.value.report
    message = str(caught.value)
    assert "compiled inference graph differs from eager ATen" in message
    assert report.node is not None and report.node.target == aten.sin.default, message
    assert "first diverging node: sin" in message
    assert any("test_verify.py" in line and "b = a.sin()" in line for line in report.source), report.source
    repro = report.repro_path
    assert repro and repro.startswith(str(tmp_path / str(os.getpid()))), repro
    assert os.path.exists(os.path.join(os.path.dirname(repro), "repro_inputs.pt"))

    # Standalone, the repro compiles the prefix with a correct compiler: they agree (exit 0).
    fixed = _run("", repro)
    assert fixed.returncode == 0 and "compiled and eager agree" in fixed.stdout, fixed.stderr[-2000:]
    # With the bug planted in its process it reproduces the mismatch (exit 1).
    broken = _run(PLANT + f"import runpy; runpy.run_path({repro!r}, run_name='__main__')")
    assert broken.returncode == 1, broken.stderr[-2000:]
    assert "compiled differs from eager at sin" in broken.stdout


def test_verify_passes_correct_graphs_through_unchanged():
    torch._dynamo.reset()
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(4, 16)
    compiled = torch.compile(model, backend="aotforge", options={"triton_on_cpu": True, "verify": True})
    out = compiled(x, w)
    expected = model(x, w)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    expected.sum().backward()
    torch.testing.assert_close(grad, x.grad)


def test_verify_from_the_environment():
    code = PLANT + textwrap.dedent("""
        import aotforge
        from aotforge.verify import AccuracyError
        assert aotforge.config.verify and aotforge.config.triton_on_cpu

        def g(x):
            return (x * 2).sin().sum()

        try:
            torch.compile(g, backend="aotforge")(torch.randn(8))
        except AccuracyError as error:
            print("FOUND", error.report.node.name)
    """)
    result = _run(code, env={"AOTFORGE_VERIFY": "1", "AOTFORGE_TRITON_ON_CPU": "1"})
    assert "FOUND sin" in result.stdout, result.stderr[-2000:]


def test_tolerance_is_dtype_aware():
    a = torch.ones(3, dtype=torch.float16)
    assert difference(a + 1e-3, a) is None  # within half precision's tolerance
    assert difference(a.double() + 1e-3, a.double()) is not None
    assert "exact comparison" in difference(torch.tensor([1, 2]), torch.tensor([1, 3]))
    assert TOLERANCES[torch.float64] < TOLERANCES[torch.float32] < TOLERANCES[torch.float16]
