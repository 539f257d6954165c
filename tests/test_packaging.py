"""Install: `pip install -e .` (no extras) is enough for the CPU demo; Triton is the `gpu`
extra (the tests need it for TRITON_INTERPRET); the torch range admits the installed torch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import aotforge

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = os.path.dirname(os.path.dirname(os.path.abspath(aotforge.__file__)))


def _project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["project"]


def test_triton_is_an_extra_not_a_dependency():
    project = _project()
    assert not any(d.startswith("triton") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["gpu"])
    assert any(d.startswith("triton") for d in extras["test"])  # CI's tests interpret kernels


def test_installed_torch_is_in_the_supported_range():
    from packaging.requirements import Requirement
    from packaging.version import Version

    (spec,) = [Requirement(d) for d in _project()["dependencies"] if d.startswith("torch")]
    installed = Version(torch.__version__.split("+")[0])
    assert installed in spec.specifier, f"torch {installed} outside {spec.specifier}"


def test_demo_runs_on_cpu_without_triton(tmp_path):
    # What `pip install -e .` then `python -m aotforge demo` gives on a CPU machine.
    code = ("import sys, runpy\n"
            "sys.modules['triton'] = None  # not installed\n"
            "sys.argv = ['aotforge', 'demo']\n"
            "runpy.run_module('aotforge', run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON", "AOTFORGE"))}
    env["PYTHONPATH"] = REPO
    env["AOTFORGE_CACHE_DIR"] = str(tmp_path)  # a fresh install's empty cache
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "aotforge" in result.stdout
    # Nothing of aotforge's asks for Triton. (A CUDA build of torch without Triton says that its
    # flop counter cannot count Triton kernels when torch.compile imports it: torch's, not ours.)
    lines = [line for line in result.stderr.lower().splitlines() if "triton" in line]
    assert all("flop counting will not work" in line for line in lines), result.stderr
