"""Building generated C++ into shared libraries and loading them with ctypes.

The C++ code generator writes one translation unit per graph: plain C++17 with ``extern "C"``
functions and no torch headers, so that it compiles in a fraction of a second and loads with
``ctypes`` instead of as a Python extension. This module finds a compiler, builds the unit with
``-O3 -march=native`` (plus ``-fopenmp`` where the compiler has it) and keeps the library on
disk so that the next process skips the compile.

Finding the compiler: ``$CXX`` when set (only it: a compiler the user chose is never swapped for
another silently), else the first of ``c++``, ``g++``, ``clang++`` on ``PATH``. A tiny probe is
compiled and loaded once per process; a compiler without OpenMP is still used, single-threaded
(``openmp()`` says which). ``AOTFORGE_CXXFLAGS`` appends flags (read once, at the probe).

The disk cache follows the rules of ``disk_cache`` (a private folder, atomic writes, every read
verified, a bad entry warned about once and rebuilt):

* an entry is ``cpp_<key>.so`` plus the sidecar ``cpp_<key>.json`` holding the key and the
  library's sha256. It is used only when the sidecar names the expected key and the library's
  bytes hash to the sidecar's digest, so a library cut short, edited or swapped is rebuilt, and
  a library is never trusted for its name alone;
* the key hashes the source, the compiler's full command and flags, the compiler's version and
  the CPU's model and feature flags. ``-march=native`` makes the code specific to this CPU: a
  cache folder shared with another machine (a network home) must not hand it a library that
  uses instructions it lacks (a crash with SIGILL, not a Python error);
* the compiler writes to a unique temporary file in the cache folder, which is hashed and then
  renamed into place, and the sidecar is written last: a reader sees no entry or a whole one,
  and two processes compiling the same source both end with a valid library.

``dlopen`` remembers libraries by path, so a file rewritten at a path this process already
loaded would silently keep running the old code. Each library is therefore loaded once per
process from its verified final path and remembered by key (``load_library`` of the same source
returns the same ``Library``, and two threads asking for it at once compile it once); a path
this process has loaded is never rewritten. A library is unloaded (dlclose) when nothing holds
its ``Library`` any more (the kernels of the graphs that use it), so that the next load of that
path reads the file again.

With ``config.cache`` off nothing is read from or written to the cache folder: libraries are
built in a private temporary folder that is removed at exit, unless ``config.library_cache_dir``
(``AOTFORGE_LIBRARY_CACHE_DIR``) names a folder for them alone, whose entries are made, keyed
and verified exactly as above (the test suite uses one per session: tests/conftest.py).
"""
from __future__ import annotations

import _ctypes
import atexit
import ctypes
import dataclasses
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from typing import Any, Optional

from ... import debug
from ...config import config
from . import cpp_pch, disk_cache
from .cpp_probe import COMPILERS  # tried in this order when $CXX is not set

_dlclose = getattr(_ctypes, "dlclose", None)  # (POSIX; elsewhere libraries stay loaded)

# Bumped when the layout of an entry or the way it is built changes: older entries stop verifying.
CPP_FORMAT = 1
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off",
         "-fno-strict-aliasing"]
# glibc's vector math library: with it, the kernels' calls of exp, log, erf, tanh... are
# vectorized like their arithmetic (the prelude declares the functions' SIMD variants under
# AOT_MVEC; eager's kernels use vectorized math too). Used where it links.
VECTOR_MATH = ["-DAOT_MVEC", "-Wl,--no-as-needed", "-lmvec"]
COMPILE_TIMEOUT_S = 300.0
PROBE_TIMEOUT_S = 60.0
ERROR_LINES = 40  # lines of the compiler's stderr in a CppCompileError


class CppUnavailable(RuntimeError):
    """No usable C++ compiler (message says what was tried and what to do)."""


class CppCompileError(RuntimeError):
    """The compiler rejected a generated source: message has the compiler's command, the first ~40
    lines of its stderr and the path of the source kept for a bug report."""


@dataclasses.dataclass
class Library:
    cdll: ctypes.CDLL
    path: str
    seconds: float  # compile seconds; 0.0 when loaded from the disk cache
    cached: bool  # loaded from the disk cache
    command: str = ""  # the compiler's command (for errors)

    def function(self, name: str, argtypes: list) -> Any:
        """The exported function ``name`` with ``argtypes`` set and no return value."""
        try:
            # indexing, not attribute access: CDLL caches attributes, so two callers asking for
            # one function with different argtypes would share (and overwrite) one object
            function = self.cdll[name]
        except AttributeError:
            # a compiler that built a library without the source's functions: a broken toolchain,
            # which costs the graph its kernels (eager's, with a notice) like a failed compile
            raise CppCompileError(f"aotforge: the C++ library {self.path} has no function {name!r} (if its "
                                  "source defines it as extern \"C\", the C++ compiler is broken; built with: "
                                  f"{self.command or 'unknown'})") from None
        function.restype = None
        function.argtypes = list(argtypes)
        return function


# --- the compiler ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Probe:
    problem: Optional[str]  # None: usable
    command: tuple[str, ...] = ()  # the compiler and every flag, without input and output
    version: str = ""  # first line of `--version`
    openmp: bool = False


_probe: Optional[_Probe] = None
_probe_lock = threading.Lock()

_PROBE_SOURCE = r"""
#include <cstdint>
extern "C" void aotforge_probe(float* out, int64_t n) {
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(i) * 2.0f;
}
"""


def compiler_problem() -> Optional[str]:
    """None when a C++ compiler that builds shared libraries works here; else one line saying why
    not. A compiler without OpenMP is usable (``openmp()`` is then False). Probed once per process."""
    return _probed().problem


def openmp() -> bool:
    """Whether the kernels are built with OpenMP (after the probe)."""
    return _probed().openmp


def _reset_probe_for_tests() -> None:
    """Forget the probe, so that the next call finds the compiler again (after a test changed
    ``$CXX``, ``PATH`` or ``AOTFORGE_CXXFLAGS``). Loaded libraries stay remembered."""
    global _probe
    with _probe_lock:
        _probe = None


def _probed() -> _Probe:
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = _remembered_probe()
            if _probe.problem is None and not _probe.openmp:
                debug.note("compile", f"C++ kernels are built without OpenMP ({_probe.command[0]} cannot build "
                                      "with -fopenmp), so they run on one thread")
        return _probe


def _remembered_probe() -> _Probe:
    """The probe's result, remembered on disk (cpp_probe.py): running it costs a compile and a
    link (0.2 s and more), which a process that loads every kernel from the cache would pay for
    nothing. A failed probe is not remembered: it may be fixed by the next run."""
    from . import cpp_probe

    remembered = cpp_probe.recall(_Probe)
    if remembered is not None:
        return remembered
    probe = _run_probe()
    if probe.problem is None:
        cpp_probe.remember(probe)
    return probe


def _run_probe() -> _Probe:
    what_to_do = ("set CXX to a C++ compiler (g++ or clang++), or install one (Debian/Ubuntu: "
                  "apt-get install g++)")
    chosen = os.environ.get("CXX", "").strip()
    if chosen:
        words = shlex.split(chosen)
        if shutil.which(words[0]) is None:
            return _Probe(f"the C++ compiler $CXX={chosen!r} is not an executable on PATH; {what_to_do}")
    else:
        found = next((name for name in COMPILERS if shutil.which(name)), None)
        if found is None:
            return _Probe(f"no C++ compiler found ($CXX is not set and none of {', '.join(COMPILERS)} is on "
                          f"PATH); {what_to_do}")
        words = [found]
    try:
        version = subprocess.run(words + ["--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                                 stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        return _Probe(f"the C++ compiler {shlex.join(words)} cannot be run ({error}); {what_to_do}")
    version_line = (version.stdout.strip().splitlines() or [""])[0]
    extra = shlex.split(os.environ.get("AOTFORGE_CXXFLAGS", ""))
    failure = ""
    for with_openmp in (True, False):
        for with_vector_math in (True, False):
            command = tuple(words + FLAGS + (["-fopenmp"] if with_openmp else [])
                            + (VECTOR_MATH if with_vector_math else []) + extra)
            failure = _try_probe(command)
            if not failure:
                return _Probe(None, command, version_line, with_openmp)
    return _Probe(f"the C++ compiler {shlex.join(words)} cannot build a shared library with "
                  f"{shlex.join(FLAGS + extra)} ({failure}); {what_to_do}"
                  + (", or fix AOTFORGE_CXXFLAGS" if extra else ""))


def _try_probe(command: tuple[str, ...]) -> str:
    """'' when ``command`` builds and loads the probe; else the first line of what went wrong."""
    with tempfile.TemporaryDirectory(prefix="aotforge_cpp_probe_") as folder:
        output = os.path.join(folder, "probe.so")
        try:
            result = subprocess.run(list(command) + ["-x", "c++", "-", "-o", output], input=_PROBE_SOURCE,
                                    capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as error:
            return str(error)
        if result.returncode != 0:
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            return lines[0] if lines else f"exit status {result.returncode}"
        try:
            function = ctypes.CDLL(output)["aotforge_probe"]
        except (OSError, AttributeError) as error:
            return f"the probe library does not load: {error}"
        function.restype = None
        function.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int64]
        values = (ctypes.c_float * 4)()
        function(values, 4)
        if list(values) != [0.0, 2.0, 4.0, 6.0]:
            return f"the probe library computes {list(values)}, not [0, 2, 4, 6]"
        return ""


# --- the key ---------------------------------------------------------------------------------

_cpu: Optional[str] = None
# /proc/cpuinfo fields that say which instructions -march=native may use (x86 and Arm names)
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "flags", "CPU implementer", "CPU architecture",
               "CPU variant", "CPU part", "Features")


def _cpu_identity() -> str:
    """The CPU's model and feature flags (those of its first core)."""
    global _cpu
    if _cpu is None:
        fields: dict[str, str] = {}
        try:
            with open("/proc/cpuinfo") as file:
                for line in file:
                    if not line.strip():
                        if fields:
                            break  # the first core's block is enough
                        continue
                    name, _, value = line.partition(":")
                    if name.strip() in _CPU_FIELDS:
                        fields[name.strip()] = value.strip()
        except OSError:
            pass
        _cpu = json.dumps(fields, sort_keys=True) if fields else f"{platform.machine()} {platform.processor()}"
    return _cpu


def _key(source: str, probe: _Probe) -> str:
    return disk_cache.digest(json.dumps([CPP_FORMAT, source, list(probe.command), probe.version, _cpu_identity()]))


# --- loading ---------------------------------------------------------------------------------

# key -> the library this process has loaded for it, while anything holds it (the kernels of a
# graph do): a library no graph uses is unloaded (``_loaded``), so that a process that compiles
# many graphs over its life (dynamic shapes, torch._dynamo.reset()) does not keep them all
_libraries: "weakref.WeakValueDictionary[str, Library]" = weakref.WeakValueDictionary()
_key_locks: dict[str, threading.Lock] = {}
_libraries_lock = threading.Lock()
_private_folder: Optional[str] = None  # where libraries go while config.cache is off


def load_library(source: str, stem: str, prelude: str = "") -> Library:
    """Compile the C++ translation unit ``source`` (plain C++17, ``extern "C"`` functions, no torch
    headers) to a shared library, cached on disk, and load it with ctypes. ``stem`` names it in
    notes and errors. ``prelude``: the text every generated unit starts with, precompiled once
    per kept folder (cpp_pch.py); it changes how long the build takes, never the library.
    Raises CppUnavailable / CppCompileError."""
    with _libraries_lock:
        digest = disk_cache.digest(source)
        adopted = _unclaimed.pop(digest, None) or _adopted.get(digest)
    if adopted is not None:  # loaded from a compiled-graph entry: no compiler needed
        return adopted
    probe = _probed()
    if probe.problem is not None:
        raise CppUnavailable(f"aotforge: cannot build C++ kernels: {probe.problem}")
    key = _key(source, probe)
    with _libraries_lock:
        library = _libraries.get(key)
        if library is not None:
            return library
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:  # a second thread asking for the same library waits for the first one's
        library = _libraries.get(key)
        if library is None:
            library = _load_or_build(source, stem, key, probe, prelude)
            with _libraries_lock:
                _libraries[key] = library
        return library


def _load_or_build(source: str, stem: str, key: str, probe: _Probe, prelude: str = "") -> Library:
    if config.cache:
        folder = disk_cache.cache_directory()
    elif config.library_cache_dir:  # the libraries alone, in a folder of their own (config.py)
        folder = disk_cache.private_directory(config.library_cache_dir)
    else:
        debug.note("cache", f"{stem}: C++ library not cached (config.cache is off)")
        return _build(source, stem, key, probe, _private_directory(), store=False)
    library_path, sidecar_path = _entry_paths(folder, key)
    why = _verify_entry(library_path, sidecar_path, key)
    if why is None:
        try:
            cdll = ctypes.CDLL(library_path)
        except OSError as error:
            why = "the entry does not load"
            disk_cache.warn_bad_entry(library_path, f"it does not load: {error}")
        else:
            debug.note("cache", f"{stem}: C++ library hit ({key[:16]})")
            return _loaded(cdll, library_path, 0.0, True, shlex.join(probe.command))
    debug.note("cache", f"{stem}: C++ library miss ({why}; {key[:16]})")
    return _build(source, stem, key, probe, folder, store=True, prelude=prelude)


# digest of a translation unit -> its library, loaded from the bytes a compiled-graph entry keeps
# (weakly, as _libraries; held strongly in _unclaimed from adopt() until load_library hands it out)
_adopted: "weakref.WeakValueDictionary[str, Library]" = weakref.WeakValueDictionary()
_unclaimed: dict[str, Library] = {}


def adopt(source: str, path: str) -> Library:
    """Load the library at ``path`` (verified by the caller: runtime/graph_cache.py checks it
    against the digest its sealed entry holds) as the library of ``source``."""
    key = disk_cache.digest(source)
    with _libraries_lock:
        library = _adopted.get(key)
        if library is None:
            library = _adopted[key] = _loaded(ctypes.CDLL(path), path, 0.0, True, "")
        _unclaimed[key] = library
        return library


def loaded_paths() -> set[str]:
    """Library files this process has loaded (dlopen keeps them by path: never rewrite one)."""
    with _libraries_lock:
        return {library.path for library in (*_libraries.values(), *_adopted.values())}


def cpu_identity() -> str:
    return _cpu_identity()


def _loaded(cdll: ctypes.CDLL, path: str, seconds: float, cached: bool, command: str) -> Library:
    """The Library of a loaded ``cdll``, which unloads it (dlclose) once nothing holds the
    Library: ctypes never unloads a library itself. Whoever calls the library's functions
    holds its Library (cpp_launch.CppKernel does), so no call can outlive the code."""
    library = Library(cdll, path, seconds, cached, command)
    if _dlclose is not None:
        weakref.finalize(library, _dlclose, cdll._handle)  # (the handle only: not the library)
    return library


def _entry_paths(folder: str, key: str) -> tuple[str, str]:
    return os.path.join(folder, f"cpp_{key}.so"), os.path.join(folder, f"cpp_{key}.json")


def _verify_entry(library_path: str, sidecar_path: str, key: str) -> Optional[str]:
    """None when the entry is whole and is the one for ``key``; else why it is not used (warned
    about unless it is simply missing: another process may be writing it right now)."""
    if not (os.path.lexists(library_path) and os.path.lexists(sidecar_path)):
        return "no entry"
    sidecar = disk_cache.read_bytes(sidecar_path)  # (warns itself when unreadable or not a file)
    library = disk_cache.read_bytes(library_path)
    if sidecar is None or library is None:
        return "the entry cannot be read"
    try:
        entry = json.loads(sidecar.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        disk_cache.warn_bad_entry(sidecar_path, "not valid JSON (empty or cut short?)")
        return "the sidecar is not valid JSON"
    if not isinstance(entry, dict) or entry.get("format") != CPP_FORMAT or entry.get("key") != key:
        disk_cache.warn_bad_entry(sidecar_path, "it is not the sidecar of this C++ library in this version")
        return "the sidecar names another key"
    if entry.get("sha256") != disk_cache.digest(library):
        disk_cache.warn_bad_entry(library_path, "its content does not hash to the digest in its sidecar")
        return "the library does not match its sidecar"
    return None


def _private_directory() -> str:
    global _private_folder
    with _libraries_lock:
        if _private_folder is None:
            _private_folder = tempfile.mkdtemp(prefix=f"aotforge_cpp_{os.getuid()}_")  # 0700, ours, new
            atexit.register(shutil.rmtree, _private_folder, True)
        return _private_folder


def _build(source: str, stem: str, key: str, probe: _Probe, folder: str, store: bool, prelude: str = "") -> Library:
    """Compile ``source`` into ``folder`` and load it; with ``store``, also write the sidecar that
    makes the library a cache entry, and use the folder's precompiled ``prelude`` (a private
    folder is not kept: precompiling there would cost a process more than it saves)."""
    try:
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")
    except OSError as error:  # an unwritable cache folder costs the cache (one warning), not the kernels
        folder = disk_cache.unwritable(folder, error)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")
    os.close(handle)
    library_path, sidecar_path = _entry_paths(folder, key)
    try:
        header = None
        if store and prelude and source.startswith(prelude):
            header = cpp_pch.header(prelude, list(probe.command), probe.version, _cpu_identity(), folder)
        seconds = _compile(list(probe.command), temporary, source, stem, key, folder, header, len(prelude))
        with open(temporary, "rb") as file:
            library_digest = disk_cache.digest(file.read())
        try:
            os.replace(temporary, library_path)
        except OSError as error:  # a folder in the entry's place: load from our own file
            disk_cache.warn_bad_entry(library_path, f"cannot be written: {error}")
            library_path, store = temporary, False
    except BaseException:
        _remove(temporary)
        raise
    if store:
        sidecar = dict(format=CPP_FORMAT, key=key, sha256=library_digest, stem=stem, compiler=probe.version,
                       command=shlex.join(probe.command))
        disk_cache.replace_entry(sidecar_path, json.dumps(sidecar, sort_keys=True).encode())
    try:
        cdll = ctypes.CDLL(library_path)
    except OSError as error:
        raise CppCompileError(f"aotforge: the C++ library {library_path} for {stem} was built but does not load "
                              f"({error}); built with: {shlex.join(probe.command)}") from error
    debug.note("cache", f"{stem}: C++ library built in {seconds:.2f} s ({library_path})")
    return _loaded(cdll, library_path, seconds, False, shlex.join(probe.command))


def _compile(command: list[str], output: str, source: str, stem: str, key: str, folder: str,
             header: Optional[str] = None, prelude_length: int = 0) -> float:
    """Compile ``source`` (given on stdin) into ``output``; the seconds it took. With ``header``
    (the unit's first ``prelude_length`` characters, precompiled: cpp_pch.py) only the rest is
    given, after ``-include header``; where that fails, the whole unit is compiled, so that an
    error is the compiler's error on the unit itself. On failure the source is kept next to
    the cache entry and named in the error."""
    start = time.perf_counter()
    if header is not None:
        try:
            returncode, _ = _run_compiler(command + ["-include", header, "-x", "c++", "-", "-o", output],
                                          source[prelude_length:])
        except (OSError, subprocess.TimeoutExpired):
            returncode = -1
        if returncode == 0:
            return time.perf_counter() - start
        debug.note("compile", f"{stem}: the build with the precompiled prelude failed; building the whole unit")
    try:
        returncode, stderr = _run_compiler(command + ["-x", "c++", "-", "-o", output], source)
    except subprocess.TimeoutExpired:
        failure = f"did not finish within {COMPILE_TIMEOUT_S:g} s (the compiler was stopped)"
    except OSError as error:
        failure = f"could not be run: {error}"
    else:
        if returncode == 0:
            return time.perf_counter() - start
        lines = stderr.splitlines()
        shown = "\n".join(lines[:ERROR_LINES]) + (f"\n... ({len(lines) - ERROR_LINES} more lines)"
                                                  if len(lines) > ERROR_LINES else "")
        failure = f"failed with exit status {returncode}:\n{shown}"
    kept = os.path.join(folder, f"cpp_{key}.failed.cpp")
    try:
        disk_cache.atomic_write(kept, source.encode())
        where = f"the source is kept in {kept} (please attach it to a bug report)"
    except OSError as error:
        where = f"the source could not be kept in {kept}: {error}"
    raise CppCompileError(f"aotforge: compiling the C++ kernels of {stem} {failure}\n"
                          f"command: {shlex.join(command)} -x c++ {shlex.quote(kept)} -o {stem}.so\n{where}")


def _run_compiler(command: list[str], source: str) -> tuple[int, str]:
    """(exit status, stderr). The compiler runs in a process group of its own, stopped whole on a
    timeout or an interrupt: killing only the driver would leave cc1plus or the linker running."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(source, timeout=COMPILE_TIMEOUT_S)
    except BaseException:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass  # it ended meanwhile
        process.communicate()
        raise
    return process.returncode, stderr


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
