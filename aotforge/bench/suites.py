"""Where the benchmark workloads are found: the repository's ``benchmarks/workloads/``
package, next to this one. It is loaded at run time, like a plugin: the workloads depend on
``workload.py``'s records, never on this loader."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from aotforge.bench.workload import Workload


def benchmarks_dir() -> Path:
    """The repository's ``benchmarks/`` folder (this package lives in ``<repo>/aotforge/``)."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def load_workloads() -> list[Workload]:
    """Import ``benchmarks/workloads`` and return its ``WORKLOADS`` list."""
    folder = benchmarks_dir()
    if not (folder / "workloads" / "__init__.py").is_file():
        raise FileNotFoundError(
            f"the benchmark workloads were not found at {folder / 'workloads'}; "
            "`python -m aotforge bench` runs from a checkout of the aotforge repository "
            "(install it with `pip install -e .`)"
        )
    root = str(folder.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    module = importlib.import_module("benchmarks.workloads")
    return list(module.WORKLOADS)
