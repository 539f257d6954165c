"""aotforge's configuration: one typed object, overridable from the environment.

Every field can be set from the environment as ``AOTFORGE_<FIELD NAME IN CAPITALS>``
(``AOTFORGE_ACTIVATION_MEMORY_BUDGET=0.5``) and patched for a region of code::

    with aotforge.config.patch(activation_memory_budget=0.5):
        ...

Stages add their own fields here, each with a comment that says what it changes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator


@dataclasses.dataclass
class Config:
    # --- AOT autograd -------------------------------------------------------------------
    # Recompile this many times for one function before raising instead.
    cache_size_limit: int = 8

    # --- partitioner ----------------------------------------------------------------------
    # 1.0: min-cut optimized for speed; lower values recompute more (0 saves only inputs).
    activation_memory_budget: float = 1.0

    # --- compiler ---------------------------------------------------------------------------
    # Where generated kernels and autotune results are kept across processes (default: a
    # per-user folder under the system's temporary directory).
    cache_dir: str = ""
    # Run the Triton path even for CPU tensors (needs TRITON_INTERPRET=1); for tests.
    triton_on_cpu: bool = False
    # Autotune Triton kernels over a few block sizes (results cached on disk).
    autotune: bool = True
    # Reductions over at most this many elements per row keep the whole row in registers
    # (one pass over memory); longer rows loop over it in blocks.
    persistent_reduction_limit: int = 4096
    # Reductions over at least this many elements, with few outputs, are split into partial
    # reductions plus a second pass, so that enough programs run in parallel.
    split_reduction_threshold: int = 4096

    def patch(self, **changes: Any) -> contextlib.AbstractContextManager[None]:
        """Set fields for the duration of a ``with`` block; restore them after."""
        return _patch(self, changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@contextlib.contextmanager
def _patch(cfg: Config, changes: dict[str, Any]) -> Iterator[None]:
    known = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise AttributeError(
            f"aotforge.config has no option(s) {unknown}; known options: {sorted(known)}"
        )
    old = {name: getattr(cfg, name) for name in changes}
    try:
        for name, value in changes.items():
            setattr(cfg, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(cfg, name, value)


def _parse(raw: str, default: Any, name: str) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"AOTFORGE_{name.upper()}={raw!r}: expected 0/1/true/false")
    try:
        return type(default)(raw)
    except ValueError as exc:
        raise ValueError(
            f"AOTFORGE_{name.upper()}={raw!r}: expected a {type(default).__name__}"
        ) from exc


def _from_environment() -> Config:
    cfg = Config()
    for field in dataclasses.fields(cfg):
        raw = os.environ.get(f"AOTFORGE_{field.name.upper()}")
        if raw is not None:
            setattr(cfg, field.name, _parse(raw, getattr(cfg, field.name), field.name))
    return cfg


config = _from_environment()
patch = config.patch
