"""What the compiled-graph and AOT caches share: key parts that hold for every entry (config,
versions), sealed JSON entries, and the small index that explains a miss.

An entry file is ``<sha256 of the rest>\\n<JSON>``; the JSON names its format and its key.
Reading checks all three, so a truncated, edited or swapped file (another entry's content
under this name) is ignored with one warning (disk_cache.warn_bad_entry) and rebuilt.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Optional

import torch

from ... import debug
from ...config import config
from . import disk_cache

# Fields that do not change what is compiled: where the cache is, whether it is used, and
# how many recompiles are allowed.
_CONFIG_NOT_KEYED = frozenset({"cache_dir", "cache", "cache_size_limit"})
# Recent key parts kept per graph name, to explain a miss.
_INDEX_LENGTH = 8
INDEX_FORMAT = 1


class Uncacheable(Exception):
    """The graph (or its compiled program) holds something an entry cannot describe."""


def safe_key(name: str, what: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` (a key), or None when the thing cannot be cached: it says so under
    ``AOTFORGE_LOG=cache``, and a key that fails to compute costs the cache, never the compile."""
    try:
        return compute()
    except Uncacheable as reason:
        debug.note("cache", f"{name}: {what} not cached ({reason})")
    except Exception as error:  # noqa: BLE001
        debug.log_once("cache", f"{what} key:{type(error).__name__}:{error}",
                       f"{name}: {what} not cached (computing its key failed: {type(error).__name__}: {error})")
    return None


def config_digest() -> str:
    """aotforge's config (this thread's view, patches included)."""
    values = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_NOT_KEYED}
    return disk_cache.digest(json.dumps(values, sort_keys=True, default=str))


_source_digest: Optional[str] = None


def source_digest() -> str:
    """A hash of aotforge's own source files (an edited aotforge compiles differently)."""
    global _source_digest
    if _source_digest is None:
        # aotforge/compiler/runtime/keys.py -> aotforge/
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        parts = []
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path, "rb") as file:
                    parts.append(os.path.relpath(path, root).encode() + b"\0" + file.read())
        _source_digest = disk_cache.digest(b"\0\0".join(parts))
    return _source_digest


def versions(devices: list[str]) -> dict:
    """Versions of everything below aotforge that changes what is compiled, for these devices."""
    from .launch import interpreting

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpus = {}
    for device in devices:
        if device.startswith("cuda"):
            index = torch.device(device).index or 0
            gpus[device] = [torch.cuda.get_device_name(index), list(torch.cuda.get_device_capability(index))]
    return dict(aotforge=source_digest(), torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
                python=list(sys.version_info[:2]), gpus=gpus, triton_interpret=interpreting())


def versions_digest(devices: list[str]) -> str:
    return disk_cache.digest(json.dumps(versions(devices), sort_keys=True))


# --- sealed entries --------------------------------------------------------------------------------

def entry_path(kind: str, key: str) -> str:
    return os.path.join(disk_cache.cache_directory(), f"{kind}_{key[:40]}.json")


def read_entry(path: str, key: str, format_: int) -> Optional[dict]:
    """The entry at ``path`` if it is sealed, of this format and for ``key``; else None (with
    one warning when there is a file that fails)."""
    data = disk_cache.read_bytes(path)
    if data is None:
        return None
    seal, _, body = data.partition(b"\n")
    if disk_cache.digest(body) != seal.decode(errors="replace"):
        disk_cache.warn_bad_entry(path, "its content does not match its hash (cut short or edited?)")
        return None
    try:
        entry = json.loads(body.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        disk_cache.warn_bad_entry(path, "not valid JSON")
        return None
    if not isinstance(entry, dict) or entry.get("format") != format_:
        disk_cache.warn_bad_entry(path, "not an aotforge entry of this version")
        return None
    if entry.get("key") != key:
        disk_cache.warn_bad_entry(path, "it was made for another key")
        return None
    return entry


def write_entry(path: str, key: str, format_: int, body: dict) -> None:
    data = json.dumps(dict(body, format=format_, key=key), sort_keys=True).encode()
    disk_cache.replace_entry(path, disk_cache.digest(data).encode() + b"\n" + data)


# --- explaining a miss ---------------------------------------------------------------------------------

def _index_path(kind: str, name: str) -> str:
    return os.path.join(disk_cache.cache_directory(), f"index_{kind}_{disk_cache.digest(name)[:24]}.json")


def _recent_parts(kind: str, name: str) -> list[dict]:
    data = disk_cache.read_bytes(_index_path(kind, name))
    try:
        index = json.loads(data.decode()) if data is not None else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        index = None  # only an aid to explain misses: a bad index is rewritten at the next store
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or index.get("name") != name:
        return []
    recent = index.get("recent")
    return [p for p in recent if isinstance(p, dict)] if isinstance(recent, list) else []


def remember_parts(kind: str, name: str, parts: dict) -> None:
    """Keep ``parts`` among the recent key parts of graph ``name`` (the last writer wins when
    processes store at once: the index only explains misses)."""
    recent = [p for p in _recent_parts(kind, name) if p != parts][-(_INDEX_LENGTH - 1):] + [parts]
    data = json.dumps(dict(format=INDEX_FORMAT, name=name, recent=recent), sort_keys=True).encode()
    disk_cache.replace_entry(_index_path(kind, name), data)


def explain_miss(kind: str, name: str, parts: dict) -> str:
    """Which key parts differ from the closest entry stored for ``name``."""
    recent = _recent_parts(kind, name)
    if not recent:
        return f"nothing stored yet for {name}"
    closest = min(recent, key=lambda p: sum(p.get(k) != v for k, v in parts.items()))
    changed = sorted(k for k, v in parts.items() if closest.get(k) != v)
    if not changed:
        return "its entry is missing or damaged (cleared, cut short, or still being written)"
    return "changed: " + ", ".join(changed)
