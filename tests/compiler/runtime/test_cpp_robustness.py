"""The C++ path's files and libraries when things around it go wrong (issue 37): a cache folder
that cannot be written costs one warning and the cache, never the compile or the kernels; a
compiler that builds libraries without the kernels costs the kernels (eager's, with a notice),
never the compile; a compiled graph's libraries are unloaded once it is freed; temporary files
a killed process left in the cache folder are removed by a later one. Results against eager."""
from __future__ import annotations

import errno
import gc
import os
import tempfile
import time
import warnings

import pytest
import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler import observe
from aotforge.compiler.runtime import cpp_build, disk_cache
from aotforge.config import config

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    # the global values, not a patch: patches are per thread
    monkeypatch.setattr(config, "cache_dir", str(folder))
    monkeypatch.setattr(config, "cache", True)
    monkeypatch.setattr(disk_cache, "_warned", set())
    monkeypatch.setattr(disk_cache, "_replacements", {})
    torch._dynamo.reset()
    yield folder
    torch._dynamo.reset()


def step(x, w):
    return (torch.relu(x * w + 1) * 2).sum(1).exp()


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(8, 16, dtype=torch.float64, generator=generator, requires_grad=True),
            torch.randn(8, 16, dtype=torch.float64, generator=generator))


def _train_and_compare(compiled) -> None:
    x, w = _inputs()
    out = compiled(x, w)
    out.sum().backward()
    x_eager = x.detach().clone().requires_grad_(True)
    expected = step(x_eager, w)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x_eager.grad)


def _aotforge_warnings(caught) -> list[str]:
    return [f"{w.category.__name__}: {w.message}" for w in caught if "aotforge" in str(w.message)]


def test_an_unwritable_cache_folder_costs_one_warning_not_the_kernels(cache, monkeypatch):
    """Mode 0500 or a read-only mount: every write into the folder fails (as the OS fails it
    for a user who is not root; tests may run as root, whom mode bits do not stop)."""
    cache.mkdir(mode=0o700)
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir) == str(cache):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    with warnings.catch_warnings(record=True) as caught, config.patch(cpu_codegen=True), observe() as graphs:
        warnings.simplefilter("always")
        for shape_seed in range(2):  # a second compile warns no more
            torch._dynamo.reset()
            _train_and_compare(torch.compile(step, backend="aotforge"))
    messages = _aotforge_warnings(caught)
    assert len(messages) == 1 and "CacheDirectoryWarning" in messages[0] and "cannot be written" in messages[0], \
        messages
    assert [g.path for g in graphs] == ["cpp"] * 4, graphs  # forward and backward, twice: C++ kernels
    assert os.listdir(cache) == []


@pytest.mark.skipif(os.getuid() == 0, reason="mode bits do not stop root")
def test_a_read_only_cache_folder_is_replaced_up_front(cache):
    cache.mkdir(mode=0o500)
    with pytest.warns(disk_cache.CacheDirectoryWarning, match="not writable"):
        assert disk_cache.cache_directory() != str(cache)


@pytest.fixture
def fresh_probe():
    cpp_build._reset_probe_for_tests()
    yield
    cpp_build._reset_probe_for_tests()


def test_a_compiler_that_builds_libraries_without_the_kernels_falls_back(cache, monkeypatch, tmp_path, fresh_probe):
    """A broken toolchain: the probe's library works, the kernels' library has none of its
    functions. The graph runs as eager's kernels, with the notice of every other broken setup."""
    broken = tmp_path / "c++-that-drops-code"
    broken.write_text('#!/bin/sh\nsource=$(cat)\n'
                      'case "$source" in *aotforge_probe*) printf "%s\\n" "$source" | c++ "$@"; exit $?;; esac\n'
                      'printf "int aot_nothing;\\n" | c++ "$@"\n')
    broken.chmod(0o700)
    monkeypatch.setenv("CXX", str(broken))
    assert cpp_build.compiler_problem() is None
    # an earlier test's libraries of the same kernels, freed but not yet collected, would be
    # reused without building anything
    gc.collect()
    with warnings.catch_warnings(record=True) as caught, config.patch(cpu_codegen=True), observe() as graphs:
        warnings.simplefilter("always")
        _train_and_compare(torch.compile(step, backend="aotforge"))
    messages = [m for m in _aotforge_warnings(caught) if "runs as ATen calls" in m]
    assert messages and all("has no function" in m for m in messages), _aotforge_warnings(caught)
    assert graphs and all(g.path == "aten" for g in graphs), graphs


def _mapped_libraries() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if line.rstrip().endswith(".so") and "/cpp_" in line}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_a_freed_graph_unloads_its_libraries(cache):
    gc.collect()  # (earlier tests' graphs of the same source, freed but not yet collected)
    before = _mapped_libraries()
    with config.patch(cpu_codegen=True):
        compiled = torch.compile(step, backend="aotforge")
        _train_and_compare(compiled)
    loaded = _mapped_libraries() - before
    assert len(loaded) == 2, loaded  # the forward's and the backward's
    del compiled
    torch._dynamo.reset()
    gc.collect()
    assert not loaded & _mapped_libraries()
    # compiled again: loaded again from the cache entries (a copy of each library kept in its
    # entry), and correct
    with config.patch(cpu_codegen=True):
        _train_and_compare(torch.compile(step, backend="aotforge"))
    assert len(_mapped_libraries() - before) == 2


def test_stale_temporary_files_are_removed_by_a_later_process(cache):
    cache.mkdir(mode=0o700)
    stale, fresh, entry = cache / ".tmp-killed.part", cache / ".tmp-writing.part", cache / "cpp_entry.so"
    for path in (stale, fresh, entry):
        path.write_bytes(b"x")
    old = time.time() - disk_cache.STALE_TEMPORARY_S - 60
    os.utime(stale, (old, old))
    os.utime(entry, (old, old))
    assert disk_cache.cache_directory() == str(cache)
    assert sorted(os.listdir(cache)) == [".tmp-writing.part", "cpp_entry.so"]  # a live write stays
