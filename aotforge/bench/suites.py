"""The benchmark workloads, every suite's (``aotforge/bench/workloads/``), loaded on first use:
the Hugging Face and timm workloads import their packages only when built."""
from __future__ import annotations

from aotforge.bench.workload import Workload


def load_workloads() -> list[Workload]:
    """Every workload of every suite, in the order ``--list`` prints them."""
    from aotforge.bench.workloads import WORKLOADS

    return list(WORKLOADS)
