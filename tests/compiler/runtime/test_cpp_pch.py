"""The generated units' prelude, precompiled once per kept folder (compiler/runtime/cpp_pch.py):
a unit is built after ``-include`` of it, into the same code as the whole unit; an entry that
does not verify is rebuilt; a build that fails with it is built again whole, so that errors
read as before; and no precompiled header is made where nothing is kept."""
import json
import os
import pathlib
import shutil
import subprocess
import warnings

import pytest
import torch

from aotforge.compiler.codegen.cpp import UNIT_PRELUDE
from aotforge.compiler.runtime import cpp_build, cpp_pch, disk_cache
from aotforge.config import config

from .test_cpp_build import check_add, forget


@pytest.fixture(autouse=True)
def needs_gcc():
    if cpp_build.compiler_problem() is not None:
        pytest.skip(f"no C++ compiler: {cpp_build.compiler_problem()}")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A kept library folder of this test, the caches off (as the suite runs), and no
    precompiled header remembered from earlier tests."""
    folder = tmp_path / "libraries"
    monkeypatch.setattr(config, "cache", False)
    monkeypatch.setattr(config, "library_cache_dir", str(folder))
    monkeypatch.setattr(disk_cache, "_warned", set())
    monkeypatch.setattr(cpp_pch, "_headers", {})
    yield folder


@pytest.fixture
def builds(monkeypatch):
    """(header or None, source given to the compiler) of each compile from now on."""
    seen = []
    run = cpp_build._run_compiler

    def recorded(command, source):
        seen.append((command[command.index("-include") + 1] if "-include" in command else None, source))
        return run(command, source)

    monkeypatch.setattr(cpp_build, "_run_compiler", recorded)
    return seen


def unit(tag: str) -> str:
    """A unit as the code generator starts every one (the prelude), with an ``add`` kernel."""
    return (UNIT_PRELUDE + f"// {tag}\n"
            'extern "C" void add(const float* a, const float* b, float* out, int64_t n) {\n'
            "#pragma omp parallel for\n"
            "    for (int64_t i = 0; i < n; ++i) out[i] = aot_maximum(a[i] + b[i], a[i] + b[i]);\n"
            "}\n")


def pch_files(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("cpp_pch_"))


def sidecar_of(header: str) -> pathlib.Path:
    """The sidecar naming a header: ``cpp_pch_<key>.json`` for ``cpp_pch_<key>_<build>.h``."""
    return pathlib.Path(header[: -len("_0123456789abcdef.h")] + ".json")


def text_section(path, tmp_path) -> bytes:
    out = tmp_path / "text.bin"
    subprocess.run(["objcopy", "-O", "binary", "--only-section=.text", str(path), str(out)], check=True)
    return out.read_bytes()


def test_units_are_built_after_the_precompiled_prelude_into_the_same_code(folder, builds, tmp_path, monkeypatch):
    source = unit("same code")
    library = cpp_build.load_library(source, "add", UNIT_PRELUDE)
    check_add(library)
    if not cpp_build._probed().version or "clang" in cpp_build._probed().version:
        pytest.skip("GCC's precompiled headers only")  # (after the build: another compiler still builds)
    (header, given), = builds
    assert header is not None and given == source[len(UNIT_PRELUDE):]
    stem = os.path.basename(header)[: -len(".h")]
    assert pch_files(folder) == sorted([f"{stem}.h", f"{stem}.h.gch", sidecar_of(header).name])
    assert (folder / f"{stem}.h").read_text() == UNIT_PRELUDE
    assert (folder / f"{stem}.h.gch").read_bytes().startswith(cpp_pch.MAGIC)
    # a second unit uses the same precompiled header; nothing is precompiled again
    cpp_build.load_library(unit("second unit"), "add", UNIT_PRELUDE)
    assert [h for h, _ in builds] == [header, header] and len(pch_files(folder)) == 3
    # the whole unit built plainly (nothing kept: no precompiled header) has the same code
    plain_copy = tmp_path / "with_header.so"
    shutil.copy(library.path, plain_copy)
    forget(library)
    monkeypatch.setattr(config, "library_cache_dir", "")
    plain = cpp_build.load_library(source, "add", UNIT_PRELUDE)
    assert builds[-1] == (None, source) and os.path.dirname(plain.path) != str(folder)
    assert text_section(plain.path, tmp_path) == text_section(plain_copy, tmp_path)


def test_a_damaged_precompiled_header_is_rebuilt(folder, builds):
    forget(cpp_build.load_library(unit("damaged: first"), "add", UNIT_PRELUDE))
    (header, _), = builds
    if header is None:
        pytest.skip("GCC's precompiled headers only")
    compiled = header + ".gch"
    data = bytearray(open(compiled, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(compiled, "wb").write(bytes(data))
    cpp_pch._headers.clear()  # as a new process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library = cpp_build.load_library(unit("damaged: second"), "add", UNIT_PRELUDE)
    assert [w.category for w in caught] == [disk_cache.CacheEntryWarning] and "prelude" in str(caught[0].message)
    check_add(library)
    (rebuilt, _), = builds[1:]
    assert rebuilt != header  # a new pair, named by the sidecar
    sidecar = json.loads(sidecar_of(header).read_text())
    assert sidecar["stem"] + ".h" == os.path.basename(rebuilt)
    assert sidecar["sha256"] == disk_cache.digest(open(rebuilt + ".gch", "rb").read())


def test_a_failed_build_with_the_header_is_built_whole(folder, builds, tmp_path, monkeypatch):
    broken = tmp_path / "broken.h"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(cpp_pch, "header", lambda *args: str(broken))
    source = unit("header fails")
    library = cpp_build.load_library(source, "add", UNIT_PRELUDE)
    assert builds == [(str(broken), source[len(UNIT_PRELUDE):]), (None, source)]
    check_add(library)


def test_a_compile_error_names_the_whole_unit(folder, builds):
    source = unit("compile error").replace("a[i] + b[i], a[i] + b[i]", "a[i] + , b[i]")
    with pytest.raises(cpp_build.CppCompileError) as raised:
        cpp_build.load_library(source, "broken", UNIT_PRELUDE)
    assert builds[-1] == (None, source)  # the error is the compiler's on the unit itself
    (kept,) = [name for name in os.listdir(folder) if name.endswith(".failed.cpp")]
    assert (folder / kept).read_text() == source and str(folder / kept) in str(raised.value)


def test_nothing_is_precompiled_where_nothing_is_kept(folder, builds, monkeypatch):
    monkeypatch.setattr(config, "library_cache_dir", "")
    source = unit("not kept")
    check_add(cpp_build.load_library(source, "add", UNIT_PRELUDE))
    assert builds == [(None, source)] and not os.path.exists(folder)


def test_a_compiler_that_writes_no_gcc_header_builds_whole(folder, builds, tmp_path, monkeypatch):
    fake = tmp_path / "c++-without-pch"
    # writes an empty file for -x c++-header (no GCC precompiled header), compiles the rest
    fake.write_text('#!/bin/sh\ncase "$*" in *c++-header*) for a; do [ "$p" = -o ] && : > "$a"; p="$a"; done; '
                    'exit 0;; esac\nexec c++ "$@"\n')
    fake.chmod(0o700)
    monkeypatch.setenv("CXX", str(fake))
    cpp_build._reset_probe_for_tests()
    try:
        source = unit("no gcc header")
        check_add(cpp_build.load_library(source, "add", UNIT_PRELUDE))
    finally:
        monkeypatch.delenv("CXX")
        cpp_build._reset_probe_for_tests()
    assert builds == [(None, source)] and not [n for n in pch_files(folder) if n.endswith(".gch")]


def test_compiled_graphs_compute_like_eager_with_the_precompiled_prelude(folder):
    from aotforge.compiler import compile_fx_inner
    import aotforge

    def f(x, w):
        return torch.nn.functional.layer_norm((x @ w).sin() * 2 + 1, (16,)).relu().sum(0)

    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    out = aotforge.aot_function(f, compile_fx_inner)(x, w)
    out.sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    expected = f(x2, w2)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    assert any(name.endswith(".gch") for name in pch_files(folder)) or "clang" in cpp_build._probed().version


def test_two_builds_of_one_prelude_leave_a_sidecar_naming_a_whole_pair(folder, builds):
    """As two processes building at once: each build writes a pair of its own; the sidecar
    names the last one, and a new process uses it without a warning."""
    forget(cpp_build.load_library(unit("two builds: first"), "add", UNIT_PRELUDE))
    (first, _), = builds
    if first is None:
        pytest.skip("GCC's precompiled headers only")
    key = json.loads(sidecar_of(first).read_text())["key"]
    second = cpp_pch._build(UNIT_PRELUDE, list(cpp_build._probed().command), key, str(folder))
    assert second != first and os.path.exists(first + ".gch")  # the first pair is never rewritten
    cpp_pch._headers.clear()  # a new process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_add(cpp_build.load_library(unit("two builds: later"), "add", UNIT_PRELUDE))
    assert builds[-1][0] == second
