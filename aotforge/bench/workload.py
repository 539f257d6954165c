"""What a benchmark workload is, and where the workloads are found.

A workload builds, on the CPU in float32 and from a fixed seed, a module and its example
inputs for one mode (``"train"`` or ``"infer"``). The harness copies that pristine case to
the device and dtype of the run, once per backend, so that every backend starts from the same
weights and the same data.

The workloads themselves live in ``aotforge/bench/workloads/``, which imports this module for
the two records; ``aotforge.bench.suites.load_workloads`` loads them on first use.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Callable, Sequence

import torch

MODES = ("train", "infer")
SUITES = ("models", "micro", "hf", "cpu", "families")
# What runs when no --suite is given: the cpu suite's small sizes are for the CPU benchmark and
# the families suite's tiny models are a correctness check; both are asked for by name.
DEFAULT_SUITES = ("models", "micro", "hf")


@dataclasses.dataclass
class Case:
    """One workload, built for one mode: what the harness runs."""

    module: torch.nn.Module
    inputs: tuple
    # Positions of floating-point inputs that take a gradient in training (micro kernels:
    # their input gradient is the point of the backward).
    grad_inputs: tuple[int, ...] = ()
    # Fewest bytes one step must move through memory at element size 1 (multiplied by the
    # run's element size); None where achieved bandwidth means nothing (compute-bound models).
    elements_moved: int | None = None


@dataclasses.dataclass
class Workload:
    """A named benchmark: ``build(mode, quick)`` returns the pristine CPU float32 :class:`Case`."""

    name: str
    suite: str
    build: Callable[[str, bool], Case]
    description: str = ""
    # Python packages the workload needs; it is reported SKIPPED when one is missing.
    requires: tuple[str, ...] = ()

    def missing_packages(self) -> list[str]:
        """The required packages this process cannot use: not installed, or installed but
        failing to import (a torchvision wheel built for another torch dies in its import)."""
        missing = []
        for name in self.requires:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
                continue
            try:
                importlib.import_module(name)
            except Exception as error:  # noqa: BLE001 - any failure makes the package unusable
                missing.append(f"{name} (installed, but importing it fails: {type(error).__name__}: {error}; "
                               "a build for another torch?)")
        return missing


def select(
    workloads: Sequence[Workload], suites: Sequence[str], names: Sequence[str] = ()
) -> list[Workload]:
    """Filter by suite and, if ``names`` is given, by workload name (in the given order)."""
    known = {w.name: w for w in workloads}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"unknown workload(s) {unknown}; choose from {sorted(known)} "
            "(`python -m aotforge bench --list` shows them)"
        )
    chosen = [known[name] for name in names] if names else list(workloads)
    return [w for w in chosen if w.suite in suites]
