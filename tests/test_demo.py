"""``python -m aotforge demo``: trains through torch.compile(backend="aotforge"), and says
what it compared and what the compiler did."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import aotforge

REPO = os.path.dirname(os.path.dirname(os.path.abspath(aotforge.__file__)))


def _demo(cache_dir, **environment) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON", "AOTFORGE"))}
    env["PYTHONPATH"] = REPO
    env["AOTFORGE_CACHE_DIR"] = str(cache_dir)  # the default cache, in a folder of this test's own
    env.update(environment)
    return subprocess.run([sys.executable, "-m", "aotforge", "demo", "--steps", "4", "--graphs"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


def _kernels(out: str) -> list[tuple[str, int]]:
    return [(kind, int(n)) for kind, n in re.findall(r"graph 0 (forward|backward) .*-> (\d+) generated", out)]


def test_demo_compares_losses_and_says_what_aotforge_did(tmp_path):
    result = _demo(tmp_path)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]
    assert 'torch.compile(model, backend="aotforge")' in out
    # Both losses per step, side by side, and equal within float32's tolerance.
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+$", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], out
    assert all(abs(float(a) - float(b)) <= 1e-4 * float(a) for _, a, b in rows), rows
    assert float(rows[-1][1]) < float(rows[0][1])  # it trains
    assert "losses match" in out
    # What the compiler did: the Dynamo graph, its forward and backward and their C++ kernels.
    assert "Dynamo graphs compiled: 1" in out
    # (the forward's ops are all library calls or eager's own CPU kernels under cpu_eager_bits)
    assert re.search(r"graph 0 forward\s+\d+ ATen ops -> no kernels: each op is a library call or keeps "
                     r"eager's CPU kernel", out), out
    assert re.search(r"graph 0 backward\s+\d+ ATen ops -> [1-9]\d* generated C\+\+ kernels", out), out
    assert re.search(r"compile time: the first step took \d+\.\d+ s", out), out
    assert re.search(r"eager\s+\d+\.\d+ ms", out) and re.search(r"aotforge\s+\d+\.\d+ ms", out)
    # --graphs: the captured graphs, as the first demo printed them.
    assert "===== graph 0: forward =====" in out and "===== graph 0: backward =====" in out
    assert "torch.ops.aten.native_layer_norm" in out  # (kept whole: eager's kernel, eager's bits)
    assert "graphs on CPU tensors run as plain ATen calls" not in result.stderr, result.stderr


def test_demo_without_cpu_codegen_says_why_once(tmp_path):
    result = _demo(tmp_path, AOTFORGE_CPU_CODEGEN="0")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert re.search(r"graph 0 forward\s+\d+ ATen ops -> no kernels: on CPU", result.stdout), result.stdout
    notice = "graphs on CPU tensors run as plain ATen calls"
    assert result.stderr.count(notice) == 1 and "config.cpu_codegen is off" in result.stderr, result.stderr


def test_demo_run_again_says_its_graphs_came_from_the_cache(tmp_path):
    first, again = _demo(tmp_path), _demo(tmp_path)
    assert first.returncode == 0 and again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert "loaded from aotforge's on-disk cache" not in first.stdout
    assert "graph 0: loaded from aotforge's on-disk cache" in again.stdout, again.stdout
    # the same compiled graphs are described, and their programs printed
    assert "Dynamo graphs compiled: 1" in again.stdout
    assert _kernels(again.stdout) == _kernels(first.stdout) and len(_kernels(first.stdout)) == 1, again.stdout
    assert "===== graph 0: backward (its compiled program, from the cache) =====" in again.stdout
    assert "launch_kernels(" in again.stdout  # (the C++ kernels, one call per run of them)
