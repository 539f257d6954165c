"""The generated C++ prelude, precompiled once per kept folder (GCC's precompiled headers).

Every translation unit starts with the same prelude: the standard headers (<cmath>,
<algorithm>...) and the kernels' helpers (codegen/cpp_ops.py, cpp_sums.py). Parsing it is most
of a small graph's compile: measured on the 2-core CI machine (g++ 12, -O3 -march=native), a
typical small graph took 0.8 s of CPU to build, 0.3 s with the prelude precompiled, and the
libraries' code was the same instruction for instruction (the prelude's ``#pragma GCC optimize``
is kept in the precompiled header too). So where libraries are kept (cpp_build.py: the cache
folder, or config.library_cache_dir), the prelude is written there as a header, compiled once
with the libraries' own command (``-x c++-header``), and each later unit is compiled as its
text after the prelude with ``-include`` of that header.

Nothing here can change what a library computes, only how long its build takes:

* the header's text is the prelude itself: where GCC does not use the precompiled file
  (another compiler, a file it finds invalid) it reads the text, and the unit is the same;
* the entry (the sidecar ``cpp_pch_<key>.json``, and the header ``.h`` and precompiled
  ``.h.gch`` it names) is keyed by the prelude, the compiler's command and version and the
  CPU, like a library, and used only when the sidecar names that key, the header holds the
  prelude and the precompiled file hashes to the sidecar's digest; one that does not verify
  is rebuilt (disk_cache's rules);
* only GCC's own format is used (the file starts with ``gpch``): a compiler that writes
  something else (clang) compiles the whole unit as before;
* a build that fails with the precompiled header is built again from the whole unit
  (cpp_build.py), so that a compile error reads as before and a bad header costs time only.

Built at most once per folder and process (a failed build is not retried in the process).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import tempfile
import threading
from typing import Optional

from ... import debug
from . import disk_cache

FORMAT = 1
MAGIC = b"gpch"  # the first bytes of GCC's precompiled headers
BUILD_TIMEOUT_S = 120.0

# (folder, key) -> the header to -include, or None (no usable precompiled header this process)
_headers: dict[tuple[str, str], Optional[str]] = {}
_lock = threading.Lock()


def header(prelude: str, command: list[str], version: str, cpu: str, folder: str) -> Optional[str]:
    """The path of ``prelude`` as a header in ``folder`` with its precompiled form beside it, to
    pass as ``-include``; None where there is none to use (see the module's docstring)."""
    key = disk_cache.digest(json.dumps([FORMAT, prelude, list(command), version, cpu]))
    with _lock:  # one build per folder and key; others wait for it instead of building too
        if (folder, key) not in _headers:
            _headers[(folder, key)] = _verified_or_built(prelude, command, key, folder)
        return _headers[(folder, key)]


def _sidecar_path(folder: str, key: str) -> str:
    return os.path.join(folder, f"cpp_pch_{key[:32]}.json")


def _verified_or_built(prelude: str, command: list[str], key: str, folder: str) -> Optional[str]:
    found = _verified(prelude, key, folder)
    if found is not None:
        return found
    try:
        return _build(prelude, command, key, folder)
    except OSError as error:  # an unwritable folder: the units are compiled whole, as before
        debug.note("compile", f"C++ prelude not precompiled ({error})")
        return None


def _verified(prelude: str, key: str, folder: str) -> Optional[str]:
    """The header the sidecar names, when it and its precompiled file verify. (Each build
    writes a header and precompiled file of its own name, never rewritten, and then the
    sidecar that names them: two processes building at once leave two whole pairs and one
    sidecar that names one of them, never a sidecar beside another build's file.)"""
    sidecar_path = _sidecar_path(folder, key)
    if not os.path.lexists(sidecar_path):
        return None
    sidecar = disk_cache.read_bytes(sidecar_path)
    try:
        entry = json.loads(sidecar.decode()) if sidecar is not None else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        entry = None
    stem = entry.get("stem") if isinstance(entry, dict) else None
    if (not isinstance(stem, str) or entry.get("format") != FORMAT or entry.get("key") != key
            or not re.fullmatch(f"cpp_pch_{key[:32]}_[0-9a-f]{{16}}", stem)):
        disk_cache.warn_bad_entry(sidecar_path, "not the sidecar of this precompiled C++ prelude")
        return None
    header_path = os.path.join(folder, stem + ".h")
    text, compiled = disk_cache.read_bytes(header_path), disk_cache.read_bytes(header_path + ".gch")
    if (text != prelude.encode() or compiled is None or not compiled.startswith(MAGIC)
            or entry.get("sha256") != disk_cache.digest(compiled)):
        disk_cache.warn_bad_entry(header_path + ".gch", "the precompiled C++ prelude does not match its sidecar")
        return None
    return header_path


def _build(prelude: str, command: list[str], key: str, folder: str) -> Optional[str]:
    stem = f"cpp_pch_{key[:32]}_{secrets.token_hex(8)}"
    header_path = os.path.join(folder, stem + ".h")
    # the header first: a compiler that finds the precompiled file invalid reads this text
    disk_cache.atomic_write(header_path, prelude.encode())
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".gch.part")
    os.close(handle)
    try:
        try:
            result = subprocess.run(_compile_only(command) + ["-x", "c++-header", header_path, "-o", temporary],
                                    capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                                    stdin=subprocess.DEVNULL)
            failure = "" if result.returncode == 0 else (result.stderr.strip().splitlines() or ["failed"])[0]
        except (OSError, subprocess.TimeoutExpired) as error:
            failure = str(error)
        with open(temporary, "rb") as file:
            compiled = file.read()
        if not failure and not compiled.startswith(MAGIC):
            failure = "the compiler does not write GCC's precompiled headers"
        if failure:
            debug.note("compile", f"C++ prelude not precompiled: {failure}")
            os.unlink(header_path)
            return None
        os.replace(temporary, header_path + ".gch")
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    disk_cache.replace_entry(_sidecar_path(folder, key), json.dumps(
        dict(format=FORMAT, key=key, stem=stem, sha256=disk_cache.digest(compiled)), sort_keys=True).encode())
    return header_path


def _compile_only(command: list[str]) -> list[str]:
    """The libraries' command without what only the link reads: with ``-shared`` the driver
    would link the header into an (empty) library instead of precompiling it. GCC accepts the
    precompiled header for the full command (the same compile options)."""
    return [word for word in command if word != "-shared" and not word.startswith(("-Wl,", "-l", "-L"))]
