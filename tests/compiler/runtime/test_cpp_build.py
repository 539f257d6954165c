"""Building generated C++ and loading it (compiler/runtime/cpp_build.py): the kernels compute what
eager computes, the disk cache serves a new process and rebuilds entries that do not verify, a
compiler error or a missing compiler says what went wrong, and concurrent builds of one source
(threads and processes) all end with a valid library. Each test uses a source of its own (a
library stays loaded for the whole process, remembered by the source's key)."""
import ctypes
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import warnings

import pytest
import torch

from aotforge.compiler.runtime import cpp_build, disk_cache
from aotforge.config import config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]



@pytest.fixture(autouse=True)
def needs_compiler(request):
    """Every test but the one that hides the compiler needs one (CI installs g++)."""
    if "no_compiler" not in request.node.name and cpp_build.compiler_problem() is not None:
        pytest.skip(f"no C++ compiler: {cpp_build.compiler_problem()}")


def add_source(tag: str) -> str:
    """out = a + b over n floats, parallel; ``tag`` makes the source (and its key) unique."""
    return (f"// {tag}\n#include <cstdint>\n"
            'extern "C" void add(const float* a, const float* b, float* out, int64_t n) {\n'
            "#pragma omp parallel for\n"
            "    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];\n"
            "}\n")


def check_add(library: cpp_build.Library, n: int = 1000) -> None:
    """The library's ``add`` gives eager's a + b, bit for bit."""
    a, b = torch.randn(n), torch.randn(n)
    out = torch.full((n,), float("nan"))
    library.function("add", ARGTYPES)(a.data_ptr(), b.data_ptr(), out.data_ptr(), n)
    assert torch.equal(out, a + b)


def entry_files(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("cpp_"))


def worker_environment(folder, **extra) -> dict:
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       AOTFORGE_CACHE_DIR=str(folder), **extra)
    environment.pop("AOTFORGE_CACHE", None)
    return environment


# A fresh process loads ``add_source(tag)``, checks it against eager and prints how it got it.
WORKER = """
import json, sys, torch
from aotforge.compiler.runtime import cpp_build
sys.path.insert(0, {tests!r})
from test_cpp_build import add_source, check_add
assert cpp_build.compiler_problem() is None, cpp_build.compiler_problem()
print("ready", flush=True)
sys.stdin.readline()  # the test starts every worker's build at once
library = cpp_build.load_library(add_source({tag!r}), "worker")
check_add(library)
print(json.dumps(dict(cached=library.cached, seconds=library.seconds, path=library.path)))
"""


def start_worker(tag: str, folder, **extra) -> subprocess.Popen:
    script = WORKER.format(tests=os.path.dirname(os.path.abspath(__file__)), tag=tag)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=worker_environment(folder, **extra),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready", process.stderr.read()[-3000:]
    return process


def finish_worker(process: subprocess.Popen) -> dict:
    out, err = process.communicate("go\n", timeout=120)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    # the global values, not a patch: patches are per thread, and some tests load from threads
    monkeypatch.setattr(config, "cache_dir", str(folder))
    monkeypatch.setattr(config, "cache", True)
    # the suite's library folder (tests/conftest.py) off: a test here that turns the cache off
    # sees what a user without one gets (test_library_cache.py tests the folder)
    monkeypatch.setattr(config, "library_cache_dir", "")
    monkeypatch.setattr(disk_cache, "_warned", set())
    yield folder


@pytest.fixture
def fresh_probe():
    """For tests that change the compiler: the probe runs again, and once more afterwards."""
    cpp_build._reset_probe_for_tests()
    yield
    cpp_build._reset_probe_for_tests()


def forget(library: cpp_build.Library) -> str:
    """Make this process forget ``library`` (which is never loaded again from its path: dlopen
    would hand back the old one); returns its key."""
    key = os.path.basename(library.path)[len("cpp_"):-len(".so")]
    del cpp_build._libraries[key]
    return key


def test_builds_loads_and_computes_like_eager(cache):
    source = add_source("builds")
    library = cpp_build.load_library(source, "add")
    assert not library.cached and library.seconds > 0
    assert os.path.dirname(library.path) == str(cache)
    check_add(library)
    check_add(library, n=1)
    # the same source again in this process: the same library, nothing compiled
    assert cpp_build.load_library(source, "add") is library
    key = os.path.basename(library.path)[len("cpp_"):-len(".so")]
    assert entry_files(cache) == [f"cpp_{key}.json", f"cpp_{key}.so"]
    sidecar = json.loads((cache / f"cpp_{key}.json").read_text())
    assert sidecar["key"] == key and sidecar["sha256"] == disk_cache.digest((cache / f"cpp_{key}.so").read_bytes())
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    with pytest.raises(cpp_build.CppCompileError, match="has no function 'sub'"):
        library.function("sub", ARGTYPES)


def test_key_covers_source_and_flags(cache, monkeypatch, fresh_probe):
    probe = cpp_build._probed()
    assert cpp_build._key("a", probe) != cpp_build._key("b", probe)
    monkeypatch.setenv("AOTFORGE_CXXFLAGS", "-DAOTFORGE_TEST_FLAG=1")
    cpp_build._reset_probe_for_tests()
    flagged = cpp_build._probed()
    assert flagged.command[-1] == "-DAOTFORGE_TEST_FLAG=1"
    assert cpp_build._key("a", flagged) != cpp_build._key("a", probe)
    assert "flags" in cpp_build._cpu_identity() or "Features" in cpp_build._cpu_identity()


def test_a_new_process_loads_from_disk(cache):
    first = cpp_build.load_library(add_source("new process"), "add")
    report = finish_worker(start_worker("new process", cache))
    assert report == dict(cached=True, seconds=0.0, path=first.path)


def test_two_processes_building_at_once_both_get_a_valid_library(cache, tmp_path):
    # a compiler that takes half a second, so that the two builds overlap
    slow = tmp_path / "slow-c++"
    slow.write_text('#!/bin/sh\ncase "$*" in *-shared*) sleep 0.5;; esac\nexec c++ "$@"\n')
    slow.chmod(0o700)
    workers = [start_worker("two processes", cache, CXX=str(slow)) for _ in range(2)]
    for worker in workers:
        worker.stdin.write("go\n")
        worker.stdin.flush()
    reports = [finish_worker(worker) for worker in workers]
    assert [report["cached"] for report in reports] == [False, False]
    (library,) = [name for name in entry_files(cache) if name.endswith(".so")]
    sidecar = json.loads((cache / library.replace(".so", ".json")).read_text())
    assert sidecar["sha256"] == disk_cache.digest((cache / library).read_bytes())
    assert not [name for name in os.listdir(cache) if name.startswith(".tmp-")]


@pytest.mark.parametrize("damage", ["library edited", "sidecar edited", "sidecar cut short", "library is a folder",
                                    "sidecar is a folder"])
def test_a_damaged_entry_is_rebuilt(cache, tmp_path, monkeypatch, damage):
    source = add_source(f"damaged: {damage}")
    key = forget(cpp_build.load_library(source, "add"))
    # a copy of the entry in a folder whose library this process never loaded, then damaged
    folder = tmp_path / "second"
    folder.mkdir(mode=0o700)
    for name in entry_files(cache):
        shutil.copy(cache / name, folder / name)
    library_file, sidecar_file = folder / f"cpp_{key}.so", folder / f"cpp_{key}.json"
    if damage == "library edited":
        data = library_file.read_bytes()
        library_file.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif damage == "sidecar edited":
        sidecar_file.write_text(json.dumps(dict(json.loads(sidecar_file.read_text()), key="0" * 64)))
    elif damage == "sidecar cut short":
        sidecar_file.write_text(sidecar_file.read_text()[:20])
    else:
        damaged = library_file if damage == "library is a folder" else sidecar_file
        damaged.unlink()
        damaged.mkdir()
    monkeypatch.setattr(config, "cache_dir", str(folder))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library = cpp_build.load_library(source, "add")
    assert [w.category for w in caught] and all(w.category is disk_cache.CacheEntryWarning for w in caught)
    assert str(folder) in str(caught[0].message)
    assert not library.cached and library.seconds > 0
    check_add(library)
    if damage in ("library edited", "sidecar edited", "sidecar cut short"):  # the entry was rewritten
        assert library.path == str(library_file)
        sidecar = json.loads(sidecar_file.read_text())
        assert sidecar["key"] == key and sidecar["sha256"] == disk_cache.digest(library_file.read_bytes())


def test_a_compile_error_names_the_kept_source(cache):
    source = add_source("syntax error").replace("out[i] = a[i] + b[i];", "out[i] = a[i] + ;")
    with pytest.raises(cpp_build.CppCompileError) as raised:
        cpp_build.load_library(source, "broken")
    message = str(raised.value)
    (kept,) = [name for name in entry_files(cache) if name.endswith(".failed.cpp")]
    assert str(cache / kept) in message and (cache / kept).read_text() == source
    assert "error" in message and "-O3" in message and "broken" in message
    assert not [name for name in os.listdir(cache) if name.startswith(".tmp-") or name.endswith(".so")]


def test_no_compiler(cache, monkeypatch, fresh_probe):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    problem = cpp_build.compiler_problem()
    assert "/nonexistent/c++" in problem and "CXX" in problem and "install" in problem
    assert not cpp_build.openmp()
    with pytest.raises(cpp_build.CppUnavailable, match="/nonexistent/c\\+\\+"):
        cpp_build.load_library(add_source("no compiler"), "add")


def test_bad_extra_flags(cache, monkeypatch, fresh_probe):
    monkeypatch.setenv("AOTFORGE_CXXFLAGS", "--no-such-flag-aotforge")
    problem = cpp_build.compiler_problem()
    assert "--no-such-flag-aotforge" in problem and "AOTFORGE_CXXFLAGS" in problem


def test_a_compiler_without_openmp_is_used_single_threaded(cache, monkeypatch, tmp_path, fresh_probe):
    no_openmp = tmp_path / "c++-without-openmp"
    no_openmp.write_text('#!/bin/sh\nfor a; do [ "$a" = -fopenmp ] && { echo "no -fopenmp" >&2; exit 1; }; done\n'
                         'exec c++ "$@"\n')
    no_openmp.chmod(0o700)
    monkeypatch.setenv("CXX", str(no_openmp))
    assert cpp_build.compiler_problem() is None and not cpp_build.openmp()
    library = cpp_build.load_library(add_source("without openmp"), "add")
    check_add(library)


def test_cache_off_builds_in_a_private_folder(cache, monkeypatch):
    source = add_source("cache off")
    # an entry for this source that verifies but is not a library: read, it would fail to load
    cache.mkdir(mode=0o700)
    key = cpp_build._key(source, cpp_build._probed())
    (cache / f"cpp_{key}.so").write_bytes(b"not a library")
    (cache / f"cpp_{key}.json").write_text(json.dumps(dict(format=cpp_build.CPP_FORMAT, key=key,
                                                           sha256=disk_cache.digest(b"not a library"))))
    monkeypatch.setattr(config, "cache", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        library = cpp_build.load_library(source, "add")
    assert not library.cached and os.path.dirname(library.path) != str(cache)
    assert stat.S_IMODE(os.stat(os.path.dirname(library.path)).st_mode) == 0o700
    check_add(library)
    assert (cache / f"cpp_{key}.so").read_bytes() == b"not a library"


def test_two_threads_build_once(cache, monkeypatch):
    compiles = []
    compile_once = cpp_build._compile

    def counted(*args):
        compiles.append(args)
        return compile_once(*args)

    monkeypatch.setattr(cpp_build, "_compile", counted)
    source, barrier, libraries = add_source("two threads"), threading.Barrier(2), []

    def load():
        barrier.wait()
        libraries.append(cpp_build.load_library(source, "add"))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(compiles) == 1 and len(libraries) == 2 and libraries[0] is libraries[1]
    check_add(libraries[0])


def test_a_compile_past_the_time_limit_is_stopped(cache, monkeypatch):
    monkeypatch.setattr(cpp_build, "COMPILE_TIMEOUT_S", 0.001)
    with pytest.raises(cpp_build.CppCompileError, match="did not finish within 0.001 s") as raised:
        cpp_build.load_library(add_source("time limit"), "slow")
    assert "failed.cpp" in str(raised.value)
    assert not [name for name in os.listdir(cache) if name.startswith(".tmp-") or name.endswith(".so")]
