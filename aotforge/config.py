"""aotforge's configuration: one typed object, overridable from the environment.

Every field can be set from the environment as ``AOTFORGE_<FIELD NAME IN CAPITALS>``
(``AOTFORGE_ACTIVATION_MEMORY_BUDGET=0.5``) and patched for a region of code::

    with aotforge.config.patch(activation_memory_budget=0.5):
        ...

A patch is visible only in the thread that made it (compiles in other threads keep the global
values); assigning ``aotforge.config.x = value`` outside a patch changes the global value.

Stages add their own fields here, each with a comment that says what it changes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import threading
from typing import Any, Callable, Iterator

# Per-thread overrides made by ``patch``: {field name: value}. Reads check it first.
_local = threading.local()


@dataclasses.dataclass
class Config:
    # --- AOT autograd -------------------------------------------------------------------
    # Recompile this many times for one function before raising instead.
    cache_size_limit: int = 8
    # Functionalized RNG in training graphs: random ops take their randomness from a graph
    # input (a philox seed) or save the generator state they drew from, so that the backward's
    # recomputation (min-cut, torch.utils.checkpoint) redraws the forward's numbers exactly and
    # the global generator advances as eager's (aot/rng.py). Off: random ops draw as they run.
    functionalize_rng: bool = True
    # Random ops run through ATen on eager's generator (no philox in kernels): the same masks
    # as eager bit for bit, at the cost of generating them outside fused kernels.
    fallback_random: bool = False

    # --- partitioner ----------------------------------------------------------------------
    # 1.0: min-cut optimized for speed; lower values recompute more (0 saves only inputs).
    activation_memory_budget: float = 1.0

    # --- compiler ---------------------------------------------------------------------------
    # Where generated kernels and autotune results are kept across processes (default: a
    # per-user folder under the system's temporary directory).
    cache_dir: str = ""
    # Keep compiled graphs and whole AOT compiles there too, so that a new process skips compiling.
    cache: bool = True
    # With ``cache`` off, still keep the C++ libraries (and only them) in this folder, entries
    # keyed and verified as the cache keeps them (the source, the compiler's command and version,
    # the CPU): a translation unit built once is loaded, not compiled again, by later compiles
    # and processes, while every graph is still traced, partitioned, lowered and generated anew.
    # The test suite points it at a folder of its session (tests/conftest.py). Empty: libraries
    # are built in a private temporary folder, as with no cache at all. Ignored while ``cache``
    # is on (the libraries are then in ``cache_dir``).
    library_cache_dir: str = ""
    # Run the Triton path even for CPU tensors (needs TRITON_INTERPRET=1); for tests.
    triton_on_cpu: bool = False
    # Graphs on CPU tensors get fused C++ kernels, built with the system's C++ compiler ($CXX,
    # c++, g++ or clang++; flags from AOTFORGE_CXXFLAGS are added). Off, or with no working
    # compiler, they run as their own ATen calls (eager's kernels).
    cpu_codegen: bool = True
    # On the C++ path, ops whose eager CPU kernel rounds in a library-specific way (MKL's exp,
    # log, sqrt, tanh...; Sleef's; GELU's erf polynomial; Welford moments of LayerNorm and var)
    # stay ATen calls, so that a compiled graph gives eager's bits; everything around them
    # still fuses (aotforge/eager_rounding.py has the table and each op's reason). Off: they
    # fuse into our kernels with the C library's math (faster, an ulp off eager's here and there).
    cpu_eager_bits: bool = True
    # Each CPU convolution of an inference graph runs NHWC or NCHW, whichever ran faster when
    # both were timed at compile time on random tensors of its sizes (tens of ms each, at most
    # 1.5 s a graph; compiler/passes/convolution_timing.py): which layout wins depends on the
    # CPU. Off: a fixed rule (NCHW where the weight is over 32 times the input), for runs that
    # must compile the same graph every time. Either way the values are the same.
    cpu_convolution_timing: bool = True
    # Autotune large reductions over a few block sizes (results cached on disk). Off by
    # default: measured on nanoGPT-124M (H100), the heuristic's first choice ran a step as fast
    # as the tuned choices, and tuning tripled the reductions' compiles. mode="max-autotune"
    # turns it on.
    autotune: bool = False
    # Reductions over at most this many elements per row keep the whole row in registers
    # (one pass over memory); longer rows loop over it in blocks.
    persistent_reduction_limit: int = 4096
    # Replay compiled GPU graphs as CUDA graphs (one recording per input shape), so that
    # launch-bound steps run at the GPU's speed; mode="reduce-overhead" turns it on
    # (compiler/runtime/cudagraphs.py). Outputs a caller still holds are never overwritten.
    cudagraphs: bool = False
    # Reductions over at least this many elements, with few outputs, are split into partial
    # reductions plus a second pass, so that enough programs run in parallel.
    split_reduction_threshold: int = 4096

    # --- debugging --------------------------------------------------------------------------
    # Run every graph compiled by backend="aotforge" also through plain ATen and compare; on a
    # mismatch find the first diverging node and write a repro script (aotforge/verify.py).
    verify: bool = False
    # A graph that a pass, the lowering or code generation cannot handle raises (for tests and
    # for finding bugs), instead of running as its own ATen calls with one warning that names
    # the graph, the stage and the error (the default: a compiler bug never costs a user their
    # training step).
    strict: bool = False

    def patch(self, **changes: Any) -> contextlib.AbstractContextManager[None]:
        """Set fields, in this thread only, for the duration of a ``with`` block."""
        return _patch(self, changes)

    def current_patches(self) -> dict[str, Any]:
        """This thread's patched fields: what work done later in another thread on this
        thread's behalf (the backward compile, in autograd's device thread) must patch too."""
        return dict(getattr(_local, "overlay", None) or {})

    def to_dict(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


class _Field:
    """A field's value: this thread's patch if there is one, else the global value.

    A data descriptor on the class, so that ``config.x`` costs one dict lookup more than a
    plain attribute, and assignment goes through ``_validate``."""

    def __init__(self, name: str):
        self.name = name
        self.slot = "_global_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        overlay = getattr(_local, "overlay", None)
        if overlay and self.name in overlay:
            return overlay[self.name]
        return obj.__dict__[self.slot]

    def __set__(self, obj, value) -> None:
        _validate(self.name, value)
        overlay = getattr(_local, "overlay", None)
        if overlay and self.name in overlay:
            overlay[self.name] = value  # inside a patch of this field: the patch owns it
        else:
            obj.__dict__[self.slot] = value


for _field in dataclasses.fields(Config):
    setattr(Config, _field.name, _Field(_field.name))


def _interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def _check_triton_on_cpu(value: Any) -> None:
    # Without the interpreter Triton fails only at the first launch, with "0 active drivers".
    if value and not _interpreter_enabled():
        raise ValueError(
            "aotforge: triton_on_cpu runs Triton kernels on the CPU through Triton's "
            "interpreter, which needs TRITON_INTERPRET=1 in the environment before Triton is "
            "imported; set it (TRITON_INTERPRET=1 AOTFORGE_TRITON_ON_CPU=1 python ...) or leave "
            "triton_on_cpu off"
        )


def _check_budget(value: Any) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"aotforge.config.activation_memory_budget={value!r}: expected a number from 0 "
            "(save only the inputs, recompute the rest) to 1 (min-cut optimized for speed)"
        )


# Checks that a value is usable, per field, run on every assignment and patch (after the
# type check every field gets from its default's type).
_VALIDATORS: dict[str, Callable[[Any], None]] = {
    "triton_on_cpu": _check_triton_on_cpu,
    "activation_memory_budget": _check_budget,
}
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Config)}


def _check_type(name: str, value: Any) -> None:
    """The value has its field's type: what ``AOTFORGE_<NAME>`` is parsed to from the
    environment, so that ``options={"autotune": "yes"}`` fails as the environment's "maybe"
    does instead of being taken as true."""
    default = _DEFAULTS.get(name, dataclasses.MISSING)
    if default is None or default is dataclasses.MISSING:
        return  # no type to check against (a field whose default is None)
    if isinstance(default, bool):
        ok, expected = isinstance(value, bool), "True or False"
    elif isinstance(default, int):
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an int"
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
    elif isinstance(default, str):
        ok, expected = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise TypeError(
            f"aotforge.config.{name}={value!r}: expected {expected} (like the default, "
            f"{default!r}), got {type(value).__name__}"
        )


def _validate(name: str, value: Any) -> None:
    _check_type(name, value)
    check = _VALIDATORS.get(name)
    if check is not None:
        check(value)


def _known_fields(changes: dict[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise AttributeError(
            f"aotforge.config has no option(s) {unknown}{did_you_mean(unknown, known)}; "
            f"known options: {sorted(known)}"
        )


def config_default(name: str) -> Any:
    """The field's default, before the environment or any patch."""
    return _DEFAULTS[name]


def did_you_mean(names: list[str], known) -> str:
    """`` (did you mean 'x'?)`` for the first name with a near miss among ``known``."""
    for name in names:
        close = difflib.get_close_matches(str(name), sorted(known), n=1)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""


@contextlib.contextmanager
def _patch(cfg: Config, changes: dict[str, Any]) -> Iterator[None]:
    _known_fields(changes)
    for name, value in changes.items():
        _validate(name, value)
    previous = getattr(_local, "overlay", None)
    _local.overlay = {**(previous or {}), **changes}
    try:
        yield
    finally:
        _local.overlay = previous


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
