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
  setting it mid-process takes effect), its in-memory code caches cleared, and its FX graph
  cache and AOTAutograd cache turned off (they would only ever hit on a graph this process
  compiled before);
- Triton (GPU): ``TRITON_CACHE_DIR``, where both compilers' kernel binaries go.

Config modules are changed only when torch has already imported them (``import torch`` does):
the package never imports ``torch._inductor`` itself.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

from aotforge.config import config

ENVIRONMENT = ("AOTFORGE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# (module, attribute) switched off: caches that outlive a cache folder's contents in a process.
SWITCHED_OFF = (
    ("torch._inductor.config", "fx_graph_cache"),
    ("torch._functorch.config", "enable_autograd_cache"),
)

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
    for module_name, attribute in SWITCHED_OFF:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attribute):
            setattr(module, attribute, False)
    inductor_utils = sys.modules.get("torch._inductor.utils")
    clear = getattr(inductor_utils, "clear_caches", None)
    if clear is not None:
        clear()  # compiled modules and C++ libraries inductor keeps in memory, by source hash
    return folders
