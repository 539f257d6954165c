"""Triton's binaries in aotforge's cache folder (issue 33): unless TRITON_CACHE_DIR names a
folder of the user's, Triton's cache is ``<aotforge cache>/triton``, so one AOTFORGE_CACHE_DIR
restores every compiled kernel, the compile pool's workers write there, and
``python -m aotforge cache info|clear`` count and clear it. (No GPU here: that a warm process
then launches its kernels without compiling them is checked on a GPU only.)"""
import os

import pytest

from aotforge.compiler.runtime import compile_pool, disk_cache
from aotforge.config import config


@pytest.fixture
def no_triton_folder(monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(disk_cache, "_triton_ours", None)
    yield
    os.environ.pop("TRITON_CACHE_DIR", None)  # (ours, set by the test: monkeypatch restores the rest)


def test_triton_caches_inside_our_folder(cache_dir, no_triton_folder):
    folder = disk_cache.cache_directory()
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(folder, "triton")
    assert oct(cache_dir.stat().st_mode & 0o777) == "0o700"  # (Triton makes the subfolder in our private one)
    try:
        from triton import knobs
    except ImportError:
        return
    assert knobs.cache.dir == os.path.join(folder, "triton")  # what Triton compiles into
    assert compile_pool._triton_environment() == {"TRITON_CACHE_DIR": os.path.join(folder, "triton")}


def test_it_follows_the_configured_folder(cache_dir, no_triton_folder, tmp_path, monkeypatch):
    disk_cache.cache_directory()
    other = tmp_path / "other"
    monkeypatch.setattr(config, "cache_dir", str(other))
    disk_cache.cache_directory()
    assert os.environ["TRITON_CACHE_DIR"] == str(other / "triton")


def test_the_users_triton_folder_is_kept(cache_dir, no_triton_folder, tmp_path, monkeypatch):
    mine = str(tmp_path / "my_triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", mine)
    disk_cache.cache_directory()
    assert os.environ["TRITON_CACHE_DIR"] == mine
    assert not (cache_dir / "triton").exists()


def test_a_planted_triton_subfolder_is_not_used(cache_dir, no_triton_folder):
    cache_dir.mkdir(mode=0o700, exist_ok=True)
    (cache_dir / "triton").mkdir(mode=0o777)
    (cache_dir / "triton").chmod(0o777)
    disk_cache.cache_directory()
    assert "TRITON_CACHE_DIR" not in os.environ


def test_cache_info_and_clear_count_triton_binaries(cache_dir, no_triton_folder, capsys):
    from aotforge.cli import main

    triton = disk_cache.cache_directory()
    kernel = os.path.join(triton, "triton", "A3F1")  # Triton's layout: a folder per kernel hash
    os.makedirs(kernel)
    for name in ("k.cubin", "k.json", "__grp__k.json"):
        with open(os.path.join(kernel, name), "wb") as file:
            file.write(b"x" * 10)
    (cache_dir / "notes.txt").write_text("not ours")
    capsys.readouterr()
    assert main(["cache", "info"]) == 0
    info = capsys.readouterr().out
    counts = {line.split("  ")[1].strip(): line.split()[-4] for line in info.splitlines()[1:]}
    assert counts["Triton's cache (triton/)"] == "3", info
    assert main(["cache", "clear"]) == 0
    assert "removed 3 entries" in capsys.readouterr().out
    assert sorted(p.name for p in cache_dir.iterdir()) == ["notes.txt"]
