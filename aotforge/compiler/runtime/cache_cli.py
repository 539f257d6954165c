"""``python -m aotforge cache info|clear``: what the cache folder holds, per kind of entry, and
removing it. Only aotforge's own entries are counted and removed (by their names), never
anything else in the folder, and Triton's binaries in its ``triton`` subfolder (where aotforge
points Triton's cache unless TRITON_CACHE_DIR names another folder)."""
from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import tempfile

from ...config import config
from . import disk_cache

# kind -> file name pattern, in print order
KINDS = {
    "kernel modules": "*.py",
    "autotune choices": "autotune_*.json",
    "compiled graphs": "graph_*.json",
    "Triton binaries, sealed": "triton_*.json",  # a GPU graph's kernels (triton_binaries.py)
    "AOT compiles": "compile_*.json",
    "AOT compiles by sizes": "sizes_*.json",  # a dynamic aot_function compile, named at a call's sizes
    "miss explanations": "index_*.json",
    "C++ libraries": "cpp_*",  # the library, its sidecar, a source the compiler rejected, the probe
    "unfinished writes": ".tmp-*.part",
}
TRITON = "Triton's cache (triton/)"  # every file under <folder>/triton


def _triton_files(directory: str) -> list[str]:
    root = os.path.join(directory, disk_cache.TRITON_SUBFOLDER)
    if not os.path.isdir(root) or os.path.islink(root):
        return []
    return [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names]


def folder() -> str:
    """The configured folder (not a process's temporary replacement for an unusable one)."""
    configured = config.cache_dir or os.path.join(tempfile.gettempdir(), f"aotforge_{os.getuid()}")
    return os.path.abspath(configured)


def entries(directory: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        for kind, pattern in KINDS.items():
            if fnmatch.fnmatchcase(name, pattern):
                found[kind].append(path)
                break
    found[TRITON] = _triton_files(directory)
    return found


def _size(paths: list[str]) -> int:
    total = 0
    for path in paths:
        try:
            total += os.stat(path).st_size
        except OSError:
            pass  # removed meanwhile by another process
    return total


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aotforge cache",
                                     description="aotforge's on-disk cache (AOTFORGE_CACHE_DIR, or aotforge.config.cache_dir)")
    parser.add_argument("action", choices=["info", "clear"], help="info: sizes and entry counts per kind; "
                        "clear: remove every aotforge entry")
    arguments = parser.parse_args(argv)
    directory = folder()
    if not os.path.exists(directory):
        print(f"{directory}: no cache yet")
        return 0
    problem = disk_cache.private_problem(directory)
    if problem is not None:
        print(f"{directory} is not used as aotforge's cache: {problem}")
        return 1
    found = entries(directory)
    if arguments.action == "info":
        print(f"cache folder: {directory} (caching {'on' if config.cache else 'off: aotforge.config.cache = False'})")
        width = max(len(k) for k in found)
        for kind, paths in found.items():
            print(f"  {kind:<{width}}  {len(paths):6d} entries  {_human(_size(paths)):>10}")
        everything = [p for paths in found.values() for p in paths]
        print(f"  {'total':<{width}}  {len(everything):6d} entries  {_human(_size(everything)):>10}")
        return 0
    removed = 0
    for paths in found.values():
        for path in paths:
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
    triton = os.path.join(directory, disk_cache.TRITON_SUBFOLDER)
    if found[TRITON]:
        shutil.rmtree(triton, ignore_errors=True)  # (its subfolders too)
    print(f"removed {removed} entries from {directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
