"""The C++ library folder that outlives a compile while the caches are off
(config.library_cache_dir, AOTFORGE_LIBRARY_CACHE_DIR; compiler/runtime/cpp_build.py): a
translation unit compiled once is loaded, not compiled, the next time; a changed source, compiler
or flag is compiled; an entry that does not verify is rebuilt, never loaded; and only libraries
go there (no compiled graph, no AOT compile), so a graph is still compiled every time.

The suite itself runs with such a folder (tests/conftest.py); each test here uses its own."""
import json
import os
import stat
import warnings
import weakref

import pytest
import torch

import aotforge
from aotforge.compiler import compile_fx_inner
from aotforge.compiler.runtime import cpp_build, disk_cache
from aotforge.config import config

from .test_cpp_build import add_source, check_add, forget


@pytest.fixture(autouse=True)
def needs_compiler():
    if cpp_build.compiler_problem() is not None:
        pytest.skip(f"no C++ compiler: {cpp_build.compiler_problem()}")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The caches off, the library folder on: as the suite runs (the global values, not a
    patch: patches are per thread)."""
    folder = tmp_path / "libraries"
    monkeypatch.setattr(config, "cache", False)
    monkeypatch.setattr(config, "cache_dir", str(tmp_path / "cache"))
    monkeypatch.setattr(config, "library_cache_dir", str(folder))
    monkeypatch.setattr(disk_cache, "_warned", set())
    yield folder


@pytest.fixture
def compiles(monkeypatch):
    """The sources handed to the C++ compiler from now on."""
    seen = []
    compile_once = cpp_build._compile

    def counted(command, output, source, *rest):
        seen.append(source)
        return compile_once(command, output, source, *rest)

    monkeypatch.setattr(cpp_build, "_compile", counted)
    return seen


def entries(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if not name.startswith("."))


def test_the_suite_runs_with_a_library_folder_and_the_caches_off():
    assert config.library_cache_dir and not config.cache
    assert os.environ["AOTFORGE_LIBRARY_CACHE_DIR"] == config.library_cache_dir


def test_a_second_identical_compile_is_a_hit(folder, compiles):
    source = add_source("library folder: hit")
    first = cpp_build.load_library(source, "add")
    assert not first.cached and first.seconds > 0 and compiles == [source]
    key = forget(first)  # as a new process, or a later test after the graphs that held it died
    assert entries(folder) == [f"cpp_{key}.json", f"cpp_{key}.so"]
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    second = cpp_build.load_library(source, "add")
    assert second.cached and second.seconds == 0.0 and second.path == first.path
    assert compiles == [source]  # not compiled again
    check_add(second)


def test_a_changed_source_is_a_miss(folder, compiles):
    source = add_source("library folder: changed")
    forget(cpp_build.load_library(source, "add"))
    changed = source.replace("a[i] + b[i]", "b[i] + a[i]")
    library = cpp_build.load_library(changed, "add")
    assert not library.cached and library.seconds > 0 and compiles == [source, changed]
    check_add(library)
    assert len([name for name in entries(folder) if name.endswith(".so")]) == 2


def test_changed_flags_are_a_miss(folder, compiles, monkeypatch):
    source = add_source("library folder: flags")
    forget(cpp_build.load_library(source, "add"))
    monkeypatch.setenv("AOTFORGE_CXXFLAGS", "-DAOTFORGE_LIBRARY_FOLDER_TEST=1")
    cpp_build._reset_probe_for_tests()
    try:
        library = cpp_build.load_library(source, "add")
    finally:
        monkeypatch.delenv("AOTFORGE_CXXFLAGS")
        cpp_build._reset_probe_for_tests()
    assert not library.cached and compiles == [source, source]
    check_add(library)


@pytest.mark.parametrize("damage", ["library edited", "library cut short", "sidecar names another key"])
def test_a_corrupt_entry_is_rebuilt_not_loaded(folder, compiles, damage):
    source = add_source(f"library folder: {damage}")
    key = forget(cpp_build.load_library(source, "add"))
    # the damaged entry moves to a folder whose library this process never loaded (dlopen would
    # hand back the loaded one for its path, whatever the file holds now)
    moved = folder.parent / "moved"
    os.rename(folder, moved)
    config.library_cache_dir = str(moved)
    library_file, sidecar_file = moved / f"cpp_{key}.so", moved / f"cpp_{key}.json"
    data = library_file.read_bytes()
    if damage == "library edited":
        library_file.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif damage == "library cut short":
        library_file.write_bytes(data[: len(data) // 2])
    else:
        sidecar_file.write_text(json.dumps(dict(json.loads(sidecar_file.read_text()), key="0" * 64)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library = cpp_build.load_library(source, "add")
    assert [w.category for w in caught] == [disk_cache.CacheEntryWarning]
    assert not library.cached and library.seconds > 0 and compiles == [source, source]
    check_add(library)
    sidecar = json.loads(sidecar_file.read_text())  # the entry was rewritten whole
    assert sidecar["key"] == key and sidecar["sha256"] == disk_cache.digest(library_file.read_bytes())


def test_a_compile_error_is_not_kept_as_an_entry(folder, compiles):
    source = add_source("library folder: error").replace("a[i] + b[i];", "a[i] + ;")
    for _ in range(2):  # raised each time: a failure is never remembered as a library
        with pytest.raises(cpp_build.CppCompileError):
            cpp_build.load_library(source, "broken")
    assert compiles == [source, source]
    assert not [name for name in entries(folder) if name.endswith((".so", ".json"))]


def test_ignored_while_the_cache_is_on(folder, compiles, monkeypatch):
    monkeypatch.setattr(config, "cache", True)
    library = cpp_build.load_library(add_source("library folder: cache on"), "add")
    assert os.path.dirname(library.path) == config.cache_dir and not os.path.exists(folder)


def test_an_unusable_folder_costs_the_folder_not_the_compile(folder, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setattr(config, "library_cache_dir", str(not_a_folder))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library = cpp_build.load_library(add_source("library folder: unusable"), "add")
    assert [w.category for w in caught] == [disk_cache.CacheDirectoryWarning]
    check_add(library)


def test_graphs_are_compiled_every_time_only_the_library_is_shared(folder, compiles, monkeypatch):
    """Two separate compiles of one function: both go through the compiler (trace, lower,
    generate), the second loads the first one's library; the folder holds libraries only."""
    def f(x):
        return (x.sin() * 2 + 1).relu()

    x = torch.randn(64)
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return compile_fx_inner(gm, example_inputs)

    outputs = [aotforge.aot_function(f, compiler)(x)]
    # the second compile as in a later test or process: this process's loaded libraries forgotten
    monkeypatch.setattr(cpp_build, "_libraries", weakref.WeakValueDictionary())
    outputs.append(aotforge.aot_function(f, compiler)(x))
    for output in outputs:
        torch.testing.assert_close(output, f(x))
    assert len(graphs) == 2 and len(compiles) == 1
    assert entries(folder) and all(name.startswith("cpp_") for name in entries(folder))
