"""A two-rank gloo "cluster" of spawned processes that the distributed tests share.

Starting a process, importing torch and joining a process group costs seconds per rank, so
the ranks are started once per test session and each test sends them a job: a function of
``tests/distributed/scenarios.py`` that every rank runs with the same arguments (as
``torchrun`` would run a training script). Each rank sends back what the function returned,
or its traceback. A job that fails or hangs takes the cluster down; the next job starts a
fresh one, so one broken scenario cannot hang or poison the others.
"""
from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

# Without a GPU, Triton kernels run in its interpreter, which Triton chooses when a kernel is
# defined: the ranks (which inherit this environment) must have it before triton.language
# is imported
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the GPU machine

WORLD_SIZE = 2
# a rank that waits longer than this in a collective fails instead of hanging the suite
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _serve(rank: int, world_size: int, port: int, backend: str, jobs: Any, results: Any) -> None:
    """A rank's loop: join the group (gloo on the CPU, nccl with one GPU per rank), then run
    jobs until told to stop (``None``)."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    import torch.distributed as dist

    device = None
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT, device_id=device)
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, kwargs = job
            try:
                results.put((rank, True, _dumps(fn(**kwargs))))
            except BaseException:  # noqa: BLE001  the test prints it
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankFailed(AssertionError):
    pass


class Cluster:
    """``WORLD_SIZE`` ranks waiting for jobs; ``run(fn, **kwargs)`` returns each rank's result."""

    def __init__(self, world_size: int = WORLD_SIZE, backend: str = "gloo"):
        self.world_size, self.backend = world_size, backend
        self.processes: list = []

    def _start(self) -> None:
        context = mp.get_context("spawn")
        port = free_port()
        self.jobs = [context.Queue() for _ in range(self.world_size)]
        self.results = context.Queue()
        self.processes = [context.Process(target=_serve, args=(rank, self.world_size, port, self.backend, self.jobs[rank], self.results),
                                          daemon=True) for rank in range(self.world_size)]
        for process in self.processes:
            process.start()

    def run(self, fn: Callable, timeout: float = 600.0, **kwargs: Any) -> list:
        if not self.processes or not all(p.is_alive() for p in self.processes):
            self.stop()
            self._start()
        for jobs in self.jobs:
            jobs.put((fn, kwargs))
        outcomes: dict[int, tuple] = {}
        try:
            while len(outcomes) < self.world_size:
                rank, ok, payload = self.results.get(timeout=timeout)
                outcomes[rank] = (ok, payload)
        except queue.Empty:
            self.stop()
            raise RankFailed(f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(outcomes))} "
                             f"gave no result within {timeout:.0f} s (a hang in a collective?)") from None
        failures = [f"rank {rank}:\n{payload}" for rank, (ok, payload) in sorted(outcomes.items()) if not ok]
        if failures:
            self.stop()  # the other rank may be stuck in a collective the failed one never joined
            raise RankFailed(f"{fn.__name__} failed:\n" + "\n".join(failures))
        return [torch.load(io.BytesIO(outcomes[rank][1]), weights_only=False) for rank in range(self.world_size)]

    def stop(self) -> None:
        for process, jobs in zip(self.processes, getattr(self, "jobs", [])):
            if process.is_alive():
                jobs.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []
