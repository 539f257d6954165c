"""Kernel binaries inside compiled-graph entries (issue 33): a CPU graph's C++ library is kept
in its entry (sealed with the rest), so that a hit loads it without the compiler; the file it
is loaded from is checked against the entry's digest, and a truncated, bit-flipped or swapped
file is refused with a warning and rewritten from the entry. The compiler probe's result is
remembered too, so that a process loading every graph from the cache compiles nothing."""
import os

import pytest
import torch

from aotforge.compiler import compile_fx_inner
from aotforge.compiler.runtime import cpp_build, cpp_probe, disk_cache
from aotforge.compiler.runtime.disk_cache import CacheEntryWarning
from aotforge.config import config

from ..helpers import trace

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")


@pytest.fixture
def cache_on(cache_dir, monkeypatch):
    monkeypatch.setattr(config, "cache", True)
    monkeypatch.setattr(config, "cpu_codegen", True)
    monkeypatch.setattr(config, "triton_on_cpu", False)
    monkeypatch.setenv("AOTFORGE_LOG", "cache")
    forget_libraries()
    yield cache_dir
    forget_libraries()


def forget_libraries() -> None:
    """As a new process: no library loaded or adopted (files stay on disk)."""
    cpp_build._adopted.clear()
    cpp_build._libraries.clear()


def row_softmax(x, y):
    return ((x * 2.0 + y.sin()).softmax(-1),)


def row_gelu(x, y):
    return (torch.nn.functional.gelu(x - y).sum(-1),)


X = torch.randn(8, 32)
Y = torch.randn(8, 32)


def run(fn, capsys) -> str:
    forget_libraries()
    capsys.readouterr()
    compiled = compile_fx_inner(trace(fn, X, Y), [X, Y])
    (got,) = compiled([X.clone(), Y.clone()])
    torch.testing.assert_close(got, fn(X, Y)[0])
    assert compiled.compiled_graph.path == "cpp"
    return capsys.readouterr().err


def replace_file(path, data: bytes) -> None:
    """Change a file as another process would: a new file renamed into place (this process
    may have the old one mapped: writing into it would change code that is loaded)."""
    temporary = path.with_suffix(".new")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def graph_library(directory):
    (path,) = directory.glob("cpp_graph_*.so")
    return path


def test_a_hit_loads_the_library_from_its_entry_without_the_compiler(cache_on, capsys, monkeypatch):
    cpp_build._reset_probe_for_tests()  # probed in this cache folder, which remembers it
    assert "C++ library built" in run(row_softmax, capsys)
    for path in cache_on.glob("cpp_*.so"):
        if not path.name.startswith("cpp_graph_"):
            path.unlink()  # the C++ library cache's copy: the hit must not need it

    def no_compiler(*args, **kwargs):
        raise AssertionError("a hit ran the C++ compiler")

    monkeypatch.setattr(cpp_build, "_compile", no_compiler)
    monkeypatch.setattr(cpp_build, "_run_probe", no_compiler)
    cpp_build._reset_probe_for_tests()  # a new process: the probe comes from its remembered result
    log = run(row_softmax, capsys)
    assert "compiled-graph hit" in log and "C++ library" not in log, log
    assert graph_library(cache_on).read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "swapped"])
def test_a_damaged_library_file_is_refused_and_rewritten(cache_on, capsys, damage):
    run(row_gelu, capsys)
    run(row_softmax, capsys)
    run(row_softmax, capsys)  # a hit: writes the library file the entry names
    path = graph_library(cache_on)
    good = path.read_bytes()
    if damage == "truncated":
        replace_file(path, good[: len(good) // 2])
    elif damage == "bit-flipped":
        flipped = bytearray(good)
        flipped[len(flipped) // 2] ^= 0x10
        replace_file(path, bytes(flipped))
    else:  # another graph's library under this name
        run(row_gelu, capsys)
        other = [p for p in cache_on.glob("cpp_graph_*.so") if p != path][0]
        replace_file(path, other.read_bytes())
    with pytest.warns(CacheEntryWarning, match="does not match the digest"):
        log = run(row_softmax, capsys)
    assert "compiled-graph hit" in log, log
    assert path.read_bytes() == good  # rewritten from the entry


def test_the_probe_is_remembered_per_compiler(cache_on, monkeypatch):
    cpp_build._reset_probe_for_tests()
    first = cpp_build._probed()
    assert first.problem is None
    assert list(cache_on.glob("cpp_probe_*.json"))
    remembered = cpp_probe.recall(type(first))
    assert remembered == first
    monkeypatch.setenv("AOTFORGE_CXXFLAGS", "-O2")  # another setup: probed again
    assert cpp_probe.recall(type(first)) is None
    cpp_build._reset_probe_for_tests()


def test_a_damaged_probe_entry_is_ignored(cache_on):
    cpp_build._reset_probe_for_tests()
    probe = cpp_build._probed()
    (path,) = cache_on.glob("cpp_probe_*.json")
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.warns(CacheEntryWarning, match="does not match its hash"):
        assert cpp_probe.recall(type(probe)) is None
    cpp_build._reset_probe_for_tests()
    assert disk_cache.digest(b"") and cpp_build._probed() == probe
