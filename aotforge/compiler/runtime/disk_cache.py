"""The compiler's files on disk: generated kernel modules and autotune choices.

Everything here assumes the files can be wrong. Another process may be writing the same
entry right now, a write may have been cut short, someone may have edited a file, and on a
shared machine the default folder under /tmp may have been created by someone else. So:

* the folder is private to the user (0700) and refused when anyone else owns or can write it;
* every write goes to a unique temporary file in the same folder and is renamed into place,
  so a reader sees the old entry or the new one, never half of one;
* every read is checked against what the entry must contain (a kernel module's text hashes
  to the digest in its name; an autotune entry names its key and its candidate list and
  chooses one of the current candidates). An entry that fails is ignored with one warning
  and rebuilt: a cache can cost time, never a wrong answer or a crash. The same holds for
  an entry that is not a regular file (a folder, a pipe) or that cannot be rewritten.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

from ... import debug
from ...config import config

# Bumped when the layout of an entry changes: older entries then stop verifying.
AUTOTUNE_FORMAT = 1
# Set AOTFORGE_CACHE_FSYNC=1 to flush entries to the disk before they are renamed into place
# (survives a power cut; costs a few milliseconds per entry).
FSYNC = os.environ.get("AOTFORGE_CACHE_FSYNC", "0") == "1"


class CacheEntryWarning(UserWarning):
    """An on-disk cache entry did not verify; it was ignored and rebuilt."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_bad_entry(path: str, why: str) -> None:
    """Warn once per entry and process: the entry is rebuilt, so the warning need not repeat."""
    with _warned_lock:
        if path in _warned:
            return
        _warned.add(path)
    debug.warn_user(f"aotforge: ignoring the cache entry {path} ({why}); it is rebuilt",
                    CacheEntryWarning)


def digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


# --- the folder ---------------------------------------------------------------------------

class CacheDirectoryWarning(UserWarning):
    """The configured cache folder cannot be used; a private temporary folder is used instead."""


# unusable folder -> the private temporary folder this process uses in its place
_replacements: dict[str, str] = {}
_replacements_lock = threading.Lock()


def cache_directory(configured: Optional[str] = None) -> str:
    """The folder for the compiler's files, created private to the user when missing.
    ``configured``: a ``config.cache_dir`` value read earlier (a kernel's first launch runs
    outside the config patches it was compiled under); by default the current one.

    A folder that cannot be created, is not a folder, is owned by another user or is
    writable by others (anyone who could write there could plant a kernel module that this
    process runs; and anyone can create ``/tmp/aotforge_<uid>`` first) is not used: the
    process warns once and uses a new private temporary folder instead, so that a bad cache
    folder costs the cache, never the compile."""
    configured = config.cache_dir if configured is None else configured
    directory = configured or os.path.join(tempfile.gettempdir(), f"aotforge_{os.getuid()}")
    directory = private_directory(directory)
    if directory not in _replacements.values():
        point_triton_here(directory)
    return directory


def private_directory(directory: str) -> str:
    """``directory`` (absolute), created private to the user when missing, or, when it cannot be
    used (see ``cache_directory``), the private temporary folder this process uses in its place
    (warned about once). Unlike ``cache_directory`` it leaves Triton's cache folder alone: the
    C++ library folder (config.library_cache_dir) holds no Triton binaries."""
    directory = os.path.abspath(directory)
    replacement = _replacements.get(directory)
    if replacement is not None:
        return replacement
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        problem = private_problem(directory)
    except OSError as error:
        problem = f"it cannot be created: {error}"
    if problem is None:
        _sweep_once(directory)
        return directory
    return _replace(directory, problem)


# --- Triton's binaries: in a folder of ours ----------------------------------------------------
# Triton keeps each compiled kernel (cubin, its JSON metadata, the intermediate IRs) in its own
# cache, ~/.triton/cache unless TRITON_CACHE_DIR says otherwise; a warm process with our
# entries but not Triton's would compile every kernel again. So, unless the user chose a
# Triton cache folder, Triton's goes inside ours (``<cache folder>/triton``): one
# AOTFORGE_CACHE_DIR restores everything, and ``python -m aotforge cache clear`` clears it.
# Triton reads TRITON_CACHE_DIR at each compile (triton.knobs.cache.dir on Triton >= 3.4,
# default_cache_dir() before), and the compile pool's workers inherit it.

TRITON_SUBFOLDER = "triton"
_triton_ours: Optional[str] = None  # the TRITON_CACHE_DIR value this process set


def point_triton_here(directory: str) -> Optional[str]:
    """Point Triton's cache at ``<directory>/triton`` unless TRITON_CACHE_DIR was set by
    someone else; returns the folder Triton uses now (None: Triton's default)."""
    global _triton_ours
    current = os.environ.get("TRITON_CACHE_DIR")
    if current and current != _triton_ours:
        return current  # the user's choice
    wanted = os.path.join(directory, TRITON_SUBFOLDER)  # (Triton makes it, inside our private folder)
    if current == wanted:
        return wanted
    if os.path.lexists(wanted) and (os.path.islink(wanted) or not os.path.isdir(wanted)
                                    or private_problem(wanted) is not None):
        return current  # not a folder of ours: Triton's default folder, as before
    with _replacements_lock:
        os.environ["TRITON_CACHE_DIR"] = _triton_ours = wanted
    return wanted


# A temporary file older than this is left over from a process that died mid-write (killed
# during a compile); one being written is younger: a compile stops after cpp_build's
# COMPILE_TIMEOUT_S (300 s), and other writes take milliseconds.
STALE_TEMPORARY_S = 600.0
_swept: set[str] = set()


def _sweep_once(directory: str) -> None:
    """Remove the stale ``.tmp-*.part`` files of ``directory``, once per folder and process
    (nothing else ever would: their names are unique, no entry refers to them)."""
    with _replacements_lock:
        if directory in _swept:
            return
        _swept.add(directory)
    try:
        names = [name for name in os.listdir(directory) if name.startswith(".tmp-") and name.endswith(".part")]
    except OSError:
        return
    oldest = time.time() - STALE_TEMPORARY_S
    for name in names:
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and info.st_mtime < oldest:
                os.unlink(path)
        except OSError:
            pass  # gone meanwhile (another process swept it), or not ours to remove


def _replace(directory: str, problem: str) -> str:
    with _replacements_lock:
        if directory in _replacements:
            return _replacements[directory]
        try:
            replacement = tempfile.mkdtemp(prefix=f"aotforge_{os.getuid()}_")  # 0700, ours, new
        except OSError as error:
            raise RuntimeError(f"aotforge: the cache directory {directory} cannot be used ({problem}) and no "
                               f"private temporary folder can be made ({error}); set AOTFORGE_CACHE_DIR "
                               "(or aotforge.config.cache_dir) to a folder you own") from error
        atexit.register(shutil.rmtree, replacement, True)
        _replacements[directory] = replacement
    debug.warn_user(f"aotforge: the cache directory {directory} cannot be used ({problem}); this process uses the "
                    f"private temporary folder {replacement} instead, so nothing compiled is kept for the next "
                    "process. Set AOTFORGE_CACHE_DIR (or aotforge.config.cache_dir) to a private folder of your "
                    "own", CacheDirectoryWarning)
    return replacement


def private_problem(directory: str) -> Optional[str]:
    """Why ``directory`` is not a private folder of this user, or None when it is."""
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.getuid():
        return (f"it is owned by uid {info.st_uid}, not by you (uid {os.getuid()}), and files planted there "
                "would run as you")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"it is writable by other users (mode {stat.S_IMODE(info.st_mode):o}), and files planted there "
                f"would run as you; `chmod 700 {directory}` makes it usable")
    if not os.access(directory, os.W_OK | os.X_OK):  # (also false on a read-only file system)
        return f"it is not writable (mode {stat.S_IMODE(info.st_mode):o}, or a read-only file system)"
    return None


def unwritable(directory: str, error: OSError) -> str:
    """A write into the cache folder ``directory`` failed (a folder that looked writable: a
    full disk, permissions changed since, access() fooled): the process warns once and uses
    its private temporary folder from now on. Returns that folder."""
    return _replace(os.path.abspath(directory), f"it cannot be written: {error}")


# --- reading and writing entries ------------------------------------------------------------

def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or all of the new one.

    The temporary file is unique (several threads and processes may write the same entry at
    once) and in the same folder (a rename is atomic only within one file system)."""
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            if FSYNC:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def read_bytes(path: str) -> Optional[bytes]:
    """The entry's bytes; None when it is missing, or (with a warning) when it is not a
    readable regular file (a folder or a pipe in its place: opening a pipe would hang)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            warn_bad_entry(path, "not a regular file")
            return None
        with open(path, "rb") as file:
            return file.read()
    except FileNotFoundError:
        return None
    except OSError as error:
        warn_bad_entry(path, f"unreadable: {error}")
        return None


def replace_entry(path: str, data: bytes) -> None:
    """Rebuild an entry. A cache that cannot be written (a folder in the entry's place, a full
    disk) costs time, not the compile: the caller goes on with what it computed."""
    try:
        atomic_write(path, data)
    except OSError as error:
        if os.path.isdir(path):
            warn_bad_entry(path, f"cannot be written: {error}")  # (a folder in the entry's place)
        else:  # the folder itself: one warning for the process, not one per entry
            unwritable(os.path.dirname(path), error)


def module_path(source: str, stem: str) -> tuple[str, str]:
    """Where the module for ``source`` lives, and the digest its content must hash to."""
    expected = digest(source)
    return os.path.join(cache_directory(), f"{stem}_{expected[:16]}.py"), expected


def store_module(source: str, stem: str) -> tuple[str, str]:
    """Make sure the file for ``source`` holds exactly ``source``; returns (path, digest).

    A file that exists but holds anything else (cut short, edited, swapped for another
    kernel's file) is replaced, with one warning."""
    path, expected = module_path(source, stem)
    existing = read_bytes(path)
    if existing is not None and digest(existing) == expected:
        return path, expected
    if existing is not None:
        warn_bad_entry(path, "its content does not match the kernel source it should hold")
    replace_entry(path, source.encode())
    return path, expected


def read_verified_module(path: str, expected: str) -> Optional[str]:
    """The text of the module file if it hashes to ``expected``, else None."""
    data = read_bytes(path)
    if data is None or digest(data) != expected:
        return None
    return data.decode()


# --- autotune choices ------------------------------------------------------------------------

def candidates_hash(candidates: Sequence[dict]) -> str:
    return digest(json.dumps([sorted(c.items()) for c in candidates]))


def autotune_key(parts: Sequence[Any], candidates: Sequence[dict]) -> str:
    """The key of one autotune decision: what is tuned and the candidates it chose among (a
    changed candidate list must not be served an old choice)."""
    return digest(json.dumps([str(p) for p in parts] + [candidates_hash(candidates)]))


def autotune_path(key: str, directory: Optional[str] = None) -> str:
    """``directory``: a ``config.cache_dir`` value (default: the current one)."""
    return os.path.join(cache_directory(directory), f"autotune_{key[:32]}.json")


def load_autotune(key: str, candidates: Sequence[dict], directory: Optional[str] = None) -> Optional[dict]:
    """The stored choice for ``key``, or None when there is none or it does not verify."""
    path = autotune_path(key, directory)
    data = read_bytes(path)
    if data is None:
        return None
    try:
        entry = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):  # (deep nesting: RecursionError)
        warn_bad_entry(path, "not valid JSON (empty or cut short?)")
        return None
    if not isinstance(entry, dict) or entry.get("format") != AUTOTUNE_FORMAT:
        warn_bad_entry(path, "not an aotforge autotune entry of this version")
        return None
    if entry.get("key") != key or entry.get("candidates") != candidates_hash(candidates):
        warn_bad_entry(path, "it was made for another kernel or another candidate list")
        return None
    chosen = entry.get("config")
    if chosen not in list(candidates):
        warn_bad_entry(path, f"its choice {chosen!r} is not one of the current candidates")
        return None
    # the candidate itself, not the stored copy: JSON's 8.0 or true compare equal to 8 and 1
    return dict(candidates[list(candidates).index(chosen)])


def store_autotune(key: str, candidates: Sequence[dict], chosen: dict, directory: Optional[str] = None) -> None:
    entry = dict(format=AUTOTUNE_FORMAT, key=key, candidates=candidates_hash(candidates), config=chosen)
    replace_entry(autotune_path(key, directory), json.dumps(entry, sort_keys=True).encode())
