"""Fixtures for the runtime's on-disk files: a private cache folder per test, and a process
that has forgotten every generated module (so that the next compile loads from disk)."""
import sys

import pytest

from aotforge.compiler.runtime import compiled, disk_cache, modules
from aotforge.config import config


def forget_loaded_modules() -> None:
    for name in [n for n in sys.modules if n.startswith("aotforge_generated_")]:
        del sys.modules[name]
    modules._loaded_paths.clear()
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


def twice_in_a_thread(step, path, timeout: float) -> list:
    """Run ``step`` twice (loaded modules forgotten before each) in a thread, recording
    warnings; returns them. A regression that blocks reading the pipe at ``path`` fails the
    test instead of hanging the suite; an exception in ``step`` fails it too."""
    import os
    import stat
    import threading
    import warnings

    caught, errors = [], []

    def run():
        try:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                for _ in range(2):
                    forget_loaded_modules()
                    step()
            caught.extend(record)
        except Exception as error:  # reported below, in the test's thread
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=timeout)
    if thread.is_alive():
        if stat.S_ISFIFO(os.stat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the blocked read ends
            thread.join(timeout=10)
        pytest.fail(f"reading {path} blocked")
    assert errors == []
    return caught
