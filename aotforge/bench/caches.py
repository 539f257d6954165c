"""``--cold-caches``: every backend's first call measured with empty compile caches.

A compiler's first call in a new process can load its kernels from an on-disk cache that an
earlier run filled, and within one process a later row can reuse what an earlier row compiled.
Neither is what a user's first run costs. :func:`use_fresh_caches` points every compile cache at
a new empty folder (under one private temporary folder per process, removed at exit) before a
backend is compiled:

- aotforge: ``AOTFORGE_CACHE_DIR`` and ``aotforge.config.cache_dir`` (the config reads the
  environment once, at import, so the field is set too); its in-memory module table is keyed by
  file path, so a new folder misses it as well;
- inductor: ``TORCHINDUCTOR_CACHE_DIR`` (read by inductor's ``cache_dir()`` on every use, so
  setting it mid-process takes effect), and its FX graph cache and AOTAutograd cache turned
  off through their environment variables (read when inductor's configuration is first
  imported: by the run's first inductor compile, after the first call of this function);
- Triton (GPU): ``TRITON_CACHE_DIR``, where both compilers' kernel binaries go.

Only environment variables and aotforge's own config change: the package never imports
inductor. What a compiler keeps in memory by source hash (inductor's loaded modules,
aotforge's loaded C++ libraries) still serves a later row of the same process that compiles
the same kernels; the first row of each backend pays in full.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from aotforge.config import config

ENVIRONMENT = ("AOTFORGE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# caches that would only ever hit on a graph this process compiled before: off
SWITCHED_OFF = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}

_root: str | None = None
_count = 0


def _run_root() -> str:
    global _root
    if _root is None:
        _root = tempfile.mkdtemp(prefix=f"aotforge_bench_cold_{os.getuid()}_")  # 0700, new, ours
        atexit.register(shutil.rmtree, _root, True)
    return _root


def use_fresh_caches(label: str = "") -> dict[str, str]:
    """Point aotforge's, inductor's and Triton's caches at new empty folders; return the folder
    of each environment variable set. ``label`` names the folders (a workload, mode and backend)."""
    global _count
    _count += 1
    name = f"{_count:03d}" + (f"-{label}" if label else "")
    base = os.path.join(_run_root(), "".join(c if c.isalnum() or c in "-_." else "_" for c in name))
    folders = {
        "AOTFORGE_CACHE_DIR": os.path.join(base, "aotforge"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(base, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(base, "triton"),
    }
    for variable, folder in folders.items():
        os.makedirs(folder, mode=0o700)
        os.environ[variable] = folder
    config.cache_dir = folders["AOTFORGE_CACHE_DIR"]
    os.environ.update(SWITCHED_OFF)
    return folders
