"""The compile pool, on the CPU: started once and reused, jobs in parallel, failures reported
(and, in a kernel, answered by compiling in-process), and off where it cannot help."""
import logging
import os
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from aotforge.compiler.runtime import compile_pool, launch, modules
from aotforge.compiler.runtime.compile_pool import CompilePool, CompileWorkerError

from .test_launch import ROW_SUM, run_row_sum


@pytest.fixture(scope="module")
def pool():
    pool = CompilePool(2)
    yield pool
    pool.shutdown()


def raise_value_error(message):
    raise ValueError(message)


def test_pool_starts_once_and_is_reused(pool):
    first = {pool.submit(os.getpid).result(timeout=60) for _ in range(6)}
    second = {pool.submit(os.getpid).result(timeout=60) for _ in range(6)}
    assert first | second <= set(pool.pids()) and len(pool.pids()) == 2
    assert os.getpid() not in first


def test_jobs_run_in_parallel(pool):
    [f.result(timeout=60) for f in [pool.submit(os.getpid) for _ in range(4)]]  # both workers up
    started = time.perf_counter()
    futures = [pool.submit(time.sleep, 1.0) for _ in range(2)]
    [f.result(timeout=60) for f in futures]
    assert time.perf_counter() - started < 1.8


def test_failing_job_is_reported_and_the_pool_goes_on(pool):
    with pytest.raises(CompileWorkerError, match="ValueError: bad kernel"):
        pool.submit(raise_value_error, "bad kernel").result(timeout=60)
    assert pool.submit(sum, [1, 2, 3]).result(timeout=60) == 6


def test_crashing_worker_is_reported_and_replaced(pool):
    with pytest.raises(CompileWorkerError, match="failed"):
        pool.submit(os._exit, 3).result(timeout=60)
    assert all(f.result(timeout=60) == 6 for f in [pool.submit(sum, [1, 2, 3]) for _ in range(4)])


def test_job_that_cannot_be_sent_fails_its_caller(pool):
    with pytest.raises(Exception):
        pool.submit(lambda: 1)


def test_global_pool_is_started_once(monkeypatch):
    monkeypatch.setenv("AOTFORGE_COMPILE_WORKERS", "1")
    compile_pool.shutdown()
    try:
        first = compile_pool.get_pool()
        assert first is not None and first.size == 1 and compile_pool.get_pool() is first
        assert first.submit(os.getpid).result(timeout=60) == first.submit(os.getpid).result(timeout=60)
    finally:
        compile_pool.shutdown()


def test_zero_workers_disables_the_pool(monkeypatch):
    monkeypatch.setenv("AOTFORGE_COMPILE_WORKERS", "0")
    compile_pool.shutdown()
    assert compile_pool.get_pool() is None
    monkeypatch.setattr(compile_pool, "_cuda_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert compile_pool.precompile("/nonexistent.py", "kernel0", [torch.float32], [16], [dict(XBLOCK=16)]) is None


@pytest.mark.parametrize("value", ["-1", "many"])
def test_bad_worker_count_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("AOTFORGE_COMPILE_WORKERS", value)
    with pytest.raises(ValueError, match="AOTFORGE_COMPILE_WORKERS"):
        compile_pool.worker_count()


def test_precompile_does_nothing_when_interpreting(cache_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = modules.load_module(ROW_SUM, "row_sum")
    assert compile_pool.precompile(module.__file__, "row_sum", [torch.float32] * 2, [16, 64],
                                   [dict(XBLOCK=8, RBLOCK=64)]) is None
    kernel = run_row_sum(arg_dtypes=[torch.float64, torch.float64])
    assert kernel.pending == []


def test_pool_is_not_started_where_it_cannot_help(monkeypatch):
    monkeypatch.setenv("AOTFORGE_COMPILE_WORKERS", "2")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert compile_pool.start_if_useful() is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(compile_pool, "_cuda_available", lambda: False)
    assert compile_pool.start_if_useful() is None
    assert compile_pool._pool is None


def test_precompile_without_cuda_does_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(compile_pool, "_cuda_available", lambda: False)
    module = modules.load_module(ROW_SUM, "row_sum")
    assert compile_pool.precompile(module.__file__, "row_sum", [torch.float32] * 2, [16, 64],
                                   [dict(XBLOCK=8, RBLOCK=64)]) is None


def test_precompile_sends_the_verified_module_to_a_worker(cache_dir, monkeypatch):
    """What a worker is asked to do (the warmup itself needs a GPU: benchmarks/compile_pool_check.py)."""
    calls = []

    class RecordingPool:
        def submit(self, function, *arguments):
            calls.append((function, arguments))
            return Future()

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(compile_pool, "_cuda_available", lambda: True)
    monkeypatch.setattr(compile_pool, "get_pool", lambda: RecordingPool())
    module = modules.load_module(ROW_SUM, "row_sum")
    future = compile_pool.precompile(module.__file__, "row_sum", [torch.float16, torch.float32], [16, 64],
                                     [dict(XBLOCK=8, RBLOCK=64, num_warps=4)])
    assert isinstance(future, Future)
    (function, (path, name, expected, kernel_name, dtypes, sizes, configs)), = calls
    assert function is compile_pool._compile_kernel and path == module.__file__ and name == module.__name__
    assert expected == module.__aotforge_digest__ and kernel_name == "row_sum"
    assert dtypes == [torch.float16, torch.float32] and sizes == [16, 64]
    assert configs == [dict(XBLOCK=8, RBLOCK=64, num_warps=4)]


def failed_future(error: Exception) -> Future:
    future = Future()
    future.set_exception(error)
    return future


def test_kernel_falls_back_when_its_precompile_failed(cache_dir, caplog, monkeypatch):
    monkeypatch.setattr(launch, "_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="aotforge"):
        for _ in range(3):
            kernel = run_row_sum(precompiled=failed_future(CompileWorkerError("worker died")))
            assert kernel.pending == []
    assert len([r for r in caplog.records if "compile pool failed" in r.getMessage()]) == 1


def test_kernel_falls_back_when_its_precompile_takes_too_long(cache_dir, monkeypatch):
    monkeypatch.setattr(launch, "PRECOMPILE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(launch, "_fallback_logged", False)
    started = time.perf_counter()
    run_row_sum(precompiled=Future())  # never completes
    assert time.perf_counter() - started < 30


def test_kernel_waits_for_its_precompile(cache_dir):
    future = Future()
    threading.Timer(0.5, future.set_result, [1]).start()
    started = time.perf_counter()
    run_row_sum(precompiled=future)
    assert future.done() and time.perf_counter() - started >= 0.45
