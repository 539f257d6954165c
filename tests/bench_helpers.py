"""What the benchmark harness's test files share."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def keep_threads_and_affinity():
    """``main`` pins the process's threads and CPUs: give the rest of the session its own back."""
    import os

    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    torch.set_num_threads(threads)
    if affinity is not None:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), affinity)
            except OSError:
                pass
