"""Fixtures for the runtime's on-disk files: a private cache folder per test, and a process
that has forgotten every generated module (so that the next compile loads from disk)."""
import sys

import pytest

from aotforge.compiler.runtime import compiled, disk_cache, launch
from aotforge.config import config


def forget_loaded_modules() -> None:
    for name in [n for n in sys.modules if n.startswith("aotforge_generated_")]:
        del sys.modules[name]
    launch._loaded_paths.clear()
    compiled._launchers.clear()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setattr(disk_cache, "_warned", set())
    forget_loaded_modules()
    # the global value, not a patch: patches are per thread, and some tests load from threads
    monkeypatch.setattr(config, "cache_dir", str(directory))
    yield directory
    forget_loaded_modules()
