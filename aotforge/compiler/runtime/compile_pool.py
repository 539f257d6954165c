"""A pool of worker processes that compile Triton kernels in parallel.

Without it every kernel is compiled by Triton at its first launch, one after another, in
the main process (about 400 kernels and 90 s for a nanoGPT training step). With it, the
wrapper hands every kernel to the pool as soon as its module is loaded; the workers compile
into Triton's on-disk cache (the parent's ``TRITON_CACHE_DIR``), and the parent's first
launch finds the binary there instead of compiling it.

Workers are fresh interpreters (``subprocess`` + ``exec``, like multiprocessing's ``spawn``):
they never inherit a CUDA context, and unlike multiprocessing they do not re-run the user's
``__main__`` script, so a training script without an ``if __name__ == "__main__"`` guard is
safe. They start once per process, lazily on first use, and are reused for every compile.
Each worker runs one job at a time; a thread per worker feeds it from a shared queue.

Size: ``min(cores, 16)``, or ``AOTFORGE_COMPILE_WORKERS`` (0 turns the pool off).
"""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

from . import compile_worker, disk_cache
from .compile_worker import receive as _receive, send as _send
from .modules import execute_module, interpreting, loaded_module

MAX_WORKERS = 16


class CompileWorkerError(RuntimeError):
    """A job could not be run by a worker (the job raised, or the worker died)."""


def worker_count() -> int:
    raw = os.environ.get("AOTFORGE_COMPILE_WORKERS")
    if raw is not None:
        try:
            count = int(raw)
        except ValueError:
            raise ValueError(f"AOTFORGE_COMPILE_WORKERS={raw!r}: expected a whole number of worker "
                             "processes (0 turns the compile pool off)") from None
        if count < 0:
            raise ValueError(f"AOTFORGE_COMPILE_WORKERS={raw!r}: expected 0 or more")
        return count
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, MAX_WORKERS)


_WORKER_SCRIPT = compile_worker.__file__


# --- the pool --------------------------------------------------------------------------------

class _Worker:
    """One worker process and the thread that feeds it jobs."""

    def __init__(self, pool: "CompilePool", index: int):
        self.pool, self.index = pool, index
        self.process: Optional[subprocess.Popen] = None
        self.thread = threading.Thread(target=self._serve, name=f"aotforge-compile-{index}", daemon=True)
        self.thread.start()

    def _start(self) -> subprocess.Popen:
        environment = dict(os.environ, **self.pool.environment)
        process = subprocess.Popen([sys.executable, _WORKER_SCRIPT], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=environment)
        _send(process.stdin, [p for p in sys.path if isinstance(p, str)])
        _send(process.stdin, list(self.pool.preload))
        return process

    def _serve(self) -> None:
        try:  # boot now: workers import their modules in parallel, before the first jobs arrive
            self.process = self._start()
        except Exception:  # noqa: BLE001  retried (and reported) with the first job
            self.process = None
        while True:
            job = self.pool.jobs.get()
            if job is None:
                self._stop()
                return
            future, payload = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if self.process is None or self.process.poll() is not None:
                    self.process = self._start()
                _send(self.process.stdin, payload)
                ok, result = _receive(self.process.stdout)
            except Exception as error:  # noqa: BLE001  the worker died: restart it for the next job
                self._stop()
                future.set_exception(CompileWorkerError(f"compile worker {self.index} failed: {error}"))
                continue
            if ok:
                future.set_result(result)
            else:
                future.set_exception(CompileWorkerError(f"compile job failed in worker {self.index}: {result}"))

    def _stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        try:
            process.stdin.close()  # the worker's loop ends at end of input
            process.wait(timeout=10)
        except Exception:  # noqa: BLE001
            process.kill()
            process.wait()


class CompilePool:
    """``size`` worker processes, started with the pool, fed from one queue. Workers get
    ``environment`` on top of this process's and import the modules in ``preload`` at boot."""

    def __init__(self, size: int, environment: Optional[dict[str, str]] = None, preload: Sequence[str] = ()):
        if size < 1:
            raise ValueError(f"a compile pool needs at least one worker, got {size}")
        self.size = size
        self.environment = dict(environment or {})
        self.preload = list(preload)
        self.jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.workers = [_Worker(self, i) for i in range(size)]
        self.closed = False

    def submit(self, function: Callable[..., Any], *arguments: Any) -> Future:
        """Run ``function(*arguments)`` in a worker (it must be importable by name there)."""
        if self.closed:
            raise RuntimeError("this compile pool has been shut down")
        payload = pickle.dumps((function, arguments))  # here, so that a bad job fails its caller
        future: Future = Future()
        self.jobs.put((future, payload))
        return future

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process is not None]

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for _ in self.workers:
            self.jobs.put(None)
        for worker in self.workers:
            worker.thread.join(timeout=15)


_pool: Optional[CompilePool] = None
_pool_pid: Optional[int] = None
_pool_lock = threading.Lock()


def get_pool() -> Optional[CompilePool]:
    """The process's pool, started on first use; None when AOTFORGE_COMPILE_WORKERS=0."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is not None and _pool_pid == os.getpid():
            return _pool
        # (a forked child does not own its parent's workers: it starts its own)
        size = worker_count()
        if size == 0:
            return None
        _pool = CompilePool(size, _triton_environment(), preload=[__name__, "triton", "triton.compiler",
                                                                 f"{__package__}.compile_warmup"])
        _pool_pid = os.getpid()
        return _pool


def start_if_useful() -> Optional[CompilePool]:
    """Start the pool now if kernels will be compiled through it (call at the start of a
    compile, so that the workers boot while the graph is traced and lowered)."""
    if interpreting() or not _cuda_available():
        return None
    return get_pool()


def shutdown() -> None:
    """Stop the process's pool (the next use starts a new one)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None and _pool_pid == os.getpid():
        pool.shutdown()


atexit.register(shutdown)


def _triton_environment() -> dict[str, str]:
    """Workers must compile into the parent's Triton cache, wherever the parent points it."""
    try:
        import triton

        directory = triton.knobs.cache.dir
    except (ImportError, AttributeError):
        directory = None
    return {"TRITON_CACHE_DIR": directory} if directory else {}


# --- precompiling kernels ------------------------------------------------------------------

def precompile(module_path: str, kernel_name: str, arg_dtypes: Sequence[Any], sizes: Sequence[int],
               configs: Sequence[dict]) -> Optional[Future]:
    """Compile ``kernel_name`` of the generated module at ``module_path`` for each of
    ``configs`` in a worker; the Future's result is the seconds the worker spent on it.
    None when there is nothing to gain: the interpreter runs kernels without compiling them,
    without a GPU nothing is compiled, and AOTFORGE_COMPILE_WORKERS=0 turns the pool off."""
    if interpreting() or not _cuda_available():
        return None
    pool = get_pool()
    if pool is None:
        return None
    loaded = loaded_module(module_path)
    if loaded is None:
        return None  # not a module this process loaded: nothing the worker could verify against
    name, expected = loaded
    return pool.submit(_compile_kernel, module_path, name, expected, kernel_name, list(arg_dtypes), list(sizes),
                       [dict(c) for c in configs])


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


_worker_modules: dict[str, Any] = {}


def _compile_kernel(module_path: str, name: str, expected: str, kernel_name: str, arg_dtypes: list, sizes: list,
                    configs: list[dict]) -> int:
    """(In a worker.) Import the module, checked against ``expected``, and warm the kernel up
    for each configuration: Triton compiles it and writes the binary to its cache."""
    import time


    started = time.perf_counter()
    module = _worker_modules.get(expected)
    if module is None:
        source = disk_cache.read_verified_module(module_path, expected)
        if source is None:
            raise RuntimeError(f"{module_path} does not hold the source the parent wrote")
        # the same module name as in the parent: Triton's cache key includes it
        module = _worker_modules[expected] = execute_module(name, module_path, source)
    kernel = getattr(module, kernel_name)
    for config_ in configs:
        _build_launcher(kernel.warmup(*arg_dtypes, *sizes, grid=(1,), **config_))
    return time.perf_counter() - started


def _build_launcher(compiled: Any) -> None:
    """(In a worker.) Triton 3.6 builds a C launcher per kernel signature with the system C
    compiler at the kernel's first launch (a third of a second each, one after another in the
    main process); building it here leaves it in Triton's cache for the parent. Newer Tritons
    have a generic launcher: nothing to build, and nothing lost if this fails."""
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # noqa: BLE001  an optimization only: the parent builds it if need be
        pass
