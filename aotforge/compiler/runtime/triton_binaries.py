"""Triton's compiled kernels inside our entries (issue 33): a compiled graph's Triton binaries
(each kernel's folder in Triton's cache: the cubin, its JSON metadata, the group file and the
intermediate IRs) are kept in a sealed entry of ours, ``triton_<graph key>.json``, so that a hit
neither recompiles its kernels nor trusts Triton's cache folder on its own.

* Store: a graph's kernels compile at their first launch, after its compiled-graph entry was
  written. So ``graph_cache.store`` hands the compiled graph to ``watch``; once every kernel of
  a watched graph has launched (checked at the next cache lookup or store, and at exit),
  ``sweep`` reads the folders of the kernels Triton compiled for it (the ``hash`` of each
  ``CompiledKernel`` in the JITFunction's ``device_caches``) and writes the entry.
* Restore: ``restore(graph key)`` on a compiled-graph hit, before the first launch: each file
  is written into Triton's cache folder (``TRITON_CACHE_DIR``, by default inside ours) unless
  the file there already has the entry's bytes; one that differs (cut short, bit-flipped, or
  another kernel's) is replaced, with one warning. The entry itself is checked like every
  other (keys.read_entry): a damaged or swapped one is ignored with a warning, and Triton
  compiles the kernel as before.

With the Triton interpreter (the CPU tests) nothing is compiled and nothing stored: the store
and restore of the files are tested with stand-ins for Triton's objects, and what a GPU process
does with them (Triton finding each kernel in its cache and launching it uncompiled) has not
been run here.
"""
from __future__ import annotations

import atexit
import base64
import json
import os
import threading
import weakref
from typing import Any, Iterable, Optional

from ... import debug
from . import disk_cache, keys

FORMAT = 1
MAX_BYTES = 64 << 20  # a graph's binaries beyond this are left to Triton's cache alone

_watched: "dict[str, weakref.ref]" = {}  # graph key -> its CompiledGraph, until its kernels compiled
_lock = threading.Lock()


def triton_folder() -> Optional[str]:
    """Triton's cache folder now (TRITON_CACHE_DIR, which disk_cache points into ours)."""
    folder = os.environ.get("TRITON_CACHE_DIR")
    if folder:
        return folder
    try:
        from triton import knobs

        return knobs.cache.dir
    except (ImportError, AttributeError):
        return None


def kernel_hashes(launchers: Iterable[Any]) -> Optional[set]:
    """The Triton cache keys of the kernels these launchers compiled; None while one has not
    launched yet."""
    hashes: set = set()
    for launcher in launchers:
        if getattr(launcher, "best", None) is None:
            return None
        caches = getattr(getattr(launcher, "fn", None), "device_caches", None) or {}
        for entry in list(caches.values()):
            kernels = entry[0] if isinstance(entry, tuple) and entry else {}
            for kernel in list(getattr(kernels, "values", lambda: [])()):
                digest = getattr(kernel, "hash", None)
                if isinstance(digest, str) and digest and os.sep not in digest and not digest.startswith("."):
                    hashes.add(digest)
    return hashes


def collect(hashes: Iterable[str], folder: str) -> Optional[dict]:
    """{hash: {file name: bytes as base64}} of these kernels' folders; None when a folder is
    missing or the files exceed MAX_BYTES."""
    files: dict = {}
    total = 0
    for digest in sorted(hashes):
        kernel = os.path.join(folder, digest)
        try:
            names = sorted(n for n in os.listdir(kernel) if not n.startswith(".tmp"))
        except OSError:
            return None
        files[digest] = {}
        for name in names:
            data = disk_cache.read_bytes(os.path.join(kernel, name))
            if data is None:
                return None
            total += len(data)
            if total > MAX_BYTES:
                return None
            if name.startswith("__grp__"):
                data = _group_by_names(data, kernel)
                if data is None:
                    return None
            files[digest][name] = base64.b64encode(data).decode()
    return files


# Triton's group file (``__grp__<kernel>.json``) names the kernel's files by absolute path; the
# entry keeps their names, and a restore writes the paths of the folder restored into (another
# AOTFORGE_CACHE_DIR, another machine).

def _group_by_names(data: bytes, kernel: str) -> Optional[bytes]:
    try:
        group = json.loads(data)
        paths = group["child_paths"]
        names = {}
        for child, path in paths.items():
            if os.path.dirname(os.path.abspath(path)) != os.path.abspath(kernel):
                return None  # a file outside the kernel's folder: left to Triton's cache
            names[child] = os.path.basename(path)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return json.dumps({"child_paths": names}).encode()


def _group_by_paths(data: bytes, kernel: str) -> Optional[bytes]:
    try:
        names = json.loads(data)["child_paths"]
        paths = {child: os.path.join(kernel, name) for child, name in names.items()
                 if isinstance(name, str) and os.sep not in name and not name.startswith(".")}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if len(paths) != len(names):
        return None
    return json.dumps({"child_paths": paths}).encode()


def entry_path(graph_key: str) -> str:
    return keys.entry_path("triton", graph_key)


def store(graph_key: str, files: dict) -> None:
    """Write (or extend: the variants of one graph under other shape guards) the entry."""
    path = entry_path(graph_key)
    existing = keys.read_entry(path, graph_key, FORMAT) if disk_cache.read_bytes(path) is not None else None
    kernels = dict(existing["kernels"]) if existing and isinstance(existing.get("kernels"), dict) else {}
    if all(kernels.get(digest) == named for digest, named in files.items()):
        return
    kernels.update(files)
    keys.write_entry(path, graph_key, FORMAT, {"kernels": kernels})


def restore(graph_key: str, name: str = "graph") -> int:
    """Write the binaries stored for the graph into Triton's cache folder; returns how many
    files were written (0 when none are stored)."""
    path = entry_path(graph_key)
    if disk_cache.read_bytes(path) is None:
        return 0
    entry = keys.read_entry(path, graph_key, FORMAT)
    folder = triton_folder()
    if entry is None or folder is None or not isinstance(entry.get("kernels"), dict):
        return 0
    written = 0
    for digest, named in entry["kernels"].items():
        if not isinstance(named, dict) or os.sep in digest or digest.startswith("."):
            continue
        kernel = os.path.join(folder, digest)
        for file_name, encoded in named.items():
            if os.sep in file_name or file_name.startswith("."):
                continue
            data = base64.b64decode(encoded)
            if file_name.startswith("__grp__"):
                data = _group_by_paths(data, kernel)
                if data is None:
                    continue
            target = os.path.join(kernel, file_name)
            current = disk_cache.read_bytes(target) if os.path.lexists(target) else None
            if current == data:
                continue
            if current is not None:
                disk_cache.warn_bad_entry(target, "Triton's file differs from the one our entry sealed (cut short, "
                                                  "edited, or another kernel's)")
            try:
                os.makedirs(kernel, exist_ok=True)
                disk_cache.atomic_write(target, data)
                written += 1
            except OSError as error:
                debug.note("cache", f"{name}: Triton binary not restored ({error})")
                return written
    if written:
        debug.note("cache", f"{name}: {written} Triton binary files restored")
    return written


def watch(graph_key: str, compiled: Any) -> None:
    """Store the graph's Triton binaries once its kernels compiled (see ``sweep``)."""
    launchers = getattr(compiled, "launchers", None)
    if not launchers:
        return
    try:
        ref = weakref.ref(compiled)
    except TypeError:
        return
    with _lock:
        _watched[graph_key] = ref


def sweep() -> None:
    """Store the binaries of every watched graph whose kernels have all launched."""
    with _lock:
        watched = list(_watched.items())
    folder = triton_folder()
    for graph_key, ref in watched:
        compiled = ref()
        hashes = None if compiled is None else kernel_hashes(compiled.launchers.values())
        if compiled is not None and hashes is None:
            continue  # not launched yet
        with _lock:
            _watched.pop(graph_key, None)
        if not hashes or folder is None:
            continue  # (the interpreter compiles nothing)
        files = collect(hashes, folder)
        if files is not None:
            store(graph_key, files)


atexit.register(sweep)
