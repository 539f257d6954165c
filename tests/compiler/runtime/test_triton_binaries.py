"""Triton binaries inside our entries (runtime/triton_binaries.py), on the CPU: Triton's objects
are stand-ins (the interpreter compiles nothing), Triton's cache folder is a folder of files.
What is checked: a graph's kernels' folders are stored once every kernel launched, restored into
an empty Triton folder on a hit, a damaged Triton file is replaced from the entry, and a
truncated, bit-flipped or swapped entry is refused with a warning (Triton then compiles as
before). Not checked here (no GPU): that Triton loads the restored cubins without compiling."""
import json
import os
import types

import pytest

from aotforge.compiler.runtime import disk_cache, triton_binaries
from aotforge.compiler.runtime.disk_cache import CacheEntryWarning

KERNEL_FILES = {"k.cubin": b"\x7fELF" + bytes(range(200)), "k.json": b'{"name": "k"}'}


def group_file(folder, digest):  # Triton's: the kernel's files by absolute path
    paths = {name: os.path.join(folder, digest, name) for name in KERNEL_FILES}
    return json.dumps({"child_paths": paths}).encode()


@pytest.fixture
def triton_folder(cache_dir, monkeypatch):
    folder = disk_cache.cache_directory()
    triton = os.path.join(folder, "triton_stand_in")
    monkeypatch.setenv("TRITON_CACHE_DIR", triton)
    monkeypatch.setattr(triton_binaries, "_watched", {})
    return triton


class Graph:  # (a CompiledGraph stand-in: what the store reads, weakly referenced)
    def __init__(self, launchers):
        self.launchers = launchers


def compiled_graph(hashes, launched=True):
    kernels = {("key", i): types.SimpleNamespace(hash=h) for i, h in enumerate(hashes)}
    launcher = types.SimpleNamespace(best={"XBLOCK": 64} if launched else None,
                                     fn=types.SimpleNamespace(device_caches={0: (kernels, {}, None, None, None)}))
    return Graph({"k": launcher})


def write_kernel(folder, digest, files=None):
    files = dict(KERNEL_FILES, **{"__grp__k.json": group_file(folder, digest)}) if files is None else files
    os.makedirs(os.path.join(folder, digest), exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(folder, digest, name), "wb") as file:
            file.write(data)


def read_kernel(folder, digest):
    path = os.path.join(folder, digest)
    return {name: open(os.path.join(path, name), "rb").read() for name in os.listdir(path)}


def stored(triton_folder, graph_key="a" * 64, digest="abc123"):
    write_kernel(triton_folder, digest)
    graph = compiled_graph([digest])
    triton_binaries.watch(graph_key, graph)
    triton_binaries.sweep()
    return graph


def test_stored_once_launched_and_restored_into_an_empty_folder(triton_folder):
    graph = compiled_graph(["abc123"], launched=False)
    write_kernel(triton_folder, "abc123")
    triton_binaries.watch("a" * 64, graph)
    triton_binaries.sweep()
    assert not os.path.exists(triton_binaries.entry_path("a" * 64))  # its kernel has not launched yet
    graph.launchers["k"].best = {"XBLOCK": 64}
    triton_binaries.sweep()
    assert os.path.exists(triton_binaries.entry_path("a" * 64))
    for name in os.listdir(os.path.join(triton_folder, "abc123")):
        os.unlink(os.path.join(triton_folder, "abc123", name))
    assert triton_binaries.restore("a" * 64) == 3
    assert read_kernel(triton_folder, "abc123") == dict(KERNEL_FILES, **{"__grp__k.json": group_file(triton_folder,
                                                                                                     "abc123")})
    assert triton_binaries.restore("a" * 64) == 0  # already there: nothing written


def test_restored_into_another_folder_the_group_file_names_it(triton_folder, monkeypatch, tmp_path):
    stored(triton_folder)
    elsewhere = str(tmp_path / "elsewhere")
    monkeypatch.setenv("TRITON_CACHE_DIR", elsewhere)
    assert triton_binaries.restore("a" * 64) == 3
    group = json.loads(open(os.path.join(elsewhere, "abc123", "__grp__k.json")).read())
    assert group["child_paths"] == {name: os.path.join(elsewhere, "abc123", name) for name in KERNEL_FILES}


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "swapped"])
def test_a_damaged_triton_file_is_replaced_from_the_entry(triton_folder, damage):
    stored(triton_folder)
    write_kernel(triton_folder, "other", {"k.cubin": b"another kernel's cubin"})
    path = os.path.join(triton_folder, "abc123", "k.cubin")
    good = open(path, "rb").read()
    if damage == "truncated":
        bad = good[: len(good) // 2]
    elif damage == "bit-flipped":
        bad = bytearray(good)
        bad[10] ^= 0x01
        bad = bytes(bad)
    else:
        bad = open(os.path.join(triton_folder, "other", "k.cubin"), "rb").read()
    open(path, "wb").write(bad)
    with pytest.warns(CacheEntryWarning, match="differs from the one our entry sealed"):
        assert triton_binaries.restore("a" * 64) == 1
    assert open(path, "rb").read() == good


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "swapped"])
def test_a_damaged_entry_is_refused(triton_folder, damage):
    stored(triton_folder, "b" * 64, "other")
    stored(triton_folder)
    path = triton_binaries.entry_path("a" * 64)
    data = open(path, "rb").read()
    if damage == "truncated":
        data = data[:-20]
    elif damage == "bit-flipped":
        data = bytearray(data)
        data[len(data) // 2] ^= 0x02
        data = bytes(data)
    else:  # another graph's well-sealed entry under this one's name
        data = open(triton_binaries.entry_path("b" * 64), "rb").read()
    open(path, "wb").write(data)
    os.unlink(os.path.join(triton_folder, "abc123", "k.cubin"))
    with pytest.warns(CacheEntryWarning):
        assert triton_binaries.restore("a" * 64) == 0
    assert not os.path.exists(os.path.join(triton_folder, "abc123", "k.cubin"))  # Triton compiles it again


def test_names_that_leave_the_folder_are_never_written(triton_folder):
    from aotforge.compiler.runtime import keys

    keys.write_entry(triton_binaries.entry_path("c" * 64), "c" * 64, triton_binaries.FORMAT,
                     {"kernels": {"../escape": {"x": "eA=="}, "ok": {"../../x": "eA==", ".hidden": "eA=="}}})
    assert triton_binaries.restore("c" * 64) == 0
    assert not os.path.exists(os.path.join(os.path.dirname(triton_folder), "escape"))


def test_the_interpreter_stores_nothing(triton_folder):
    graph = Graph({"k": types.SimpleNamespace(best={}, fn=types.SimpleNamespace())})
    triton_binaries.watch("d" * 64, graph)
    triton_binaries.sweep()
    assert not os.path.exists(triton_binaries.entry_path("d" * 64))
    assert triton_binaries._watched == {}
