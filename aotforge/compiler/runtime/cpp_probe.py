"""The C++ compiler probe's result, remembered in the cache folder (cpp_build.py probes once per
process by compiling, linking and loading a small library: 0.2 s and more, which a restarted
job that loads every kernel from the cache would spend for nothing).

The entry is keyed by everything the probe reads: ``$CXX``, ``AOTFORGE_CXXFLAGS``, ``PATH``,
and the identity of each candidate compiler's executable (its real path, size, modification
time and inode), so that an upgraded or swapped compiler is probed again. It is a sealed entry
(keys.py): a damaged or swapped one is ignored with a warning, and the probe runs.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
from typing import Any, Optional

from ...config import config
from . import disk_cache, keys

COMPILERS = ["c++", "g++", "clang++"]  # tried in this order when $CXX is not set (cpp_build.py too)

FORMAT = 1


def _identity() -> str:
    chosen = os.environ.get("CXX", "").strip()
    names = shlex.split(chosen)[:1] if chosen else COMPILERS
    compilers = {}
    for name in names:
        found = shutil.which(name)
        if found is None:
            compilers[name] = None
            continue
        real = os.path.realpath(found)
        info = os.stat(real)
        compilers[name] = [found, real, info.st_size, info.st_mtime_ns, info.st_ino]
    return disk_cache.digest(json.dumps(dict(format=FORMAT, cxx=chosen, flags=os.environ.get("AOTFORGE_CXXFLAGS", ""),
                                             path=os.environ.get("PATH", ""), compilers=compilers), sort_keys=True))


def recall(probe_type: type) -> Optional[Any]:
    """The remembered probe of this compiler setup, or None."""
    if not config.cache:
        return None
    try:
        key = _identity()
        entry = keys.read_entry(keys.entry_path("cpp_probe", key), key, FORMAT)
        if entry is None:
            return None
        return probe_type(None, tuple(str(word) for word in entry["command"]), str(entry["version"]),
                          bool(entry["openmp"]))
    except (OSError, KeyError, TypeError, ValueError):
        return None


def remember(probe: Any) -> None:
    if not config.cache:
        return
    try:
        key = _identity()
    except OSError:
        return
    keys.write_entry(keys.entry_path("cpp_probe", key), key, FORMAT,
                     dict(command=list(probe.command), version=probe.version, openmp=probe.openmp))
