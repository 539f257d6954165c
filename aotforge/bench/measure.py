"""Measuring one step: time, peak memory, device copy bandwidth, and correctness against eager.

What is measured where:

- **CUDA**: each step is bracketed by CUDA events (after warm-up), the device synchronized
  before reading them; the median over repeats is reported. Peak memory is
  ``torch.cuda.max_memory_allocated`` over the timed steps, after a reset.
- **CPU**: wall clock (``time.perf_counter``) per step, median over repeats. Peak memory is the
  process's peak resident set size over the timed steps (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs``); where it cannot be reset it is the process's lifetime peak.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import statistics
import threading
import time
from typing import Callable, Iterator

import torch

# Largest relative error ||a - b|| / ||b|| allowed between a backend and eager, per dtype. The
# allowance widens to 3x eager's own error against a float64 run where that is larger: two
# correct programs may differ from each other by about twice their distance to the truth.
TOLERANCES = {torch.float64: 1e-7, torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}
EAGER_ERROR_FACTOR = 3.0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_first_call(step: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """Run ``step`` once (the call that compiles); return its result and wall time in seconds."""
    synchronize(device)
    start = time.perf_counter()
    result = step()
    synchronize(device)
    return result, time.perf_counter() - start


def time_steps(
    step: Callable[[], object], device: torch.device, warmup: int, repeat: int, min_warmup_s: float = 0.0
) -> list[float]:
    """Milliseconds of each of ``repeat`` calls of ``step``, after at least ``warmup`` untimed
    calls that last at least ``min_warmup_s`` together (at most 100 calls): the first steps
    of a process can run far slower than the rest (thread pools, memory growing), and a median
    over too few warm steps would report that instead of the step."""
    start = time.perf_counter()
    for count in range(100):
        if count >= warmup and time.perf_counter() - start >= min_warmup_s:
            break
        step()
        synchronize(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


class OutOfTime(BaseException):
    """Raised inside a backend's run by :func:`time_limit`. A BaseException, so that compilers
    that catch Exception to fall back (Dynamo, autotuners) let it through."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the block with :class:`OutOfTime` after ``seconds`` (SIGALRM; main thread on
    Unix only, elsewhere no limit). Python code is interrupted; a long call into C is not."""
    usable = seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise OutOfTime(f"did not finish within {seconds:g} s (--backend-timeout)")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def median(values: list[float]) -> float:
    return statistics.median(values)


class PeakMemory:
    """Peak memory over a region, in bytes: ``with PeakMemory(device) as peak: ...; peak.bytes``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: int | None = None
        self.what = "max_memory_allocated" if device.type == "cuda" else "peak RSS"

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif not _reset_peak_rss():
            self.what = "process lifetime peak RSS"
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self.bytes = _peak_rss()


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # 5 resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return None


def copy_bandwidth(device: torch.device, dtype: torch.dtype, numel: int, repeat: int = 10) -> float:
    """Bytes per second of ``dst.copy_(src)`` on ``device``, counting bytes read plus written."""
    src = torch.randn(numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    times = time_steps(lambda: dst.copy_(src), device, warmup=3, repeat=repeat)
    return 2 * numel * src.element_size() / (median(times) / 1e3)


# --- correctness ------------------------------------------------------------------------------


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64; inf on a NaN/inf mismatch or a shape
    mismatch; exact comparison for integer and bool tensors."""
    if actual.shape != expected.shape:
        return math.inf
    # Compare where ``actual`` lives (the device): references are kept on the CPU.
    if not (expected.is_floating_point() or expected.is_complex()):
        return 0.0 if torch.equal(actual, expected.to(actual.device)) else math.inf
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(device=actual.device, dtype=torch.float64)
    finite_a, finite_e = torch.isfinite(actual), torch.isfinite(expected)
    if not torch.equal(finite_a, finite_e) or not torch.equal(actual[~finite_a].nan_to_num(), expected[~finite_e].nan_to_num()):
        return math.inf
    actual, expected = actual[finite_a], expected[finite_e]
    scale = max(expected.norm().item(), 1e-6 * math.sqrt(max(expected.numel(), 1)))
    return (actual - expected).norm().item() / scale


@dataclasses.dataclass
class Mismatch:
    name: str
    error: float
    allowed: float

    def __str__(self) -> str:
        return f"{self.name}: relative error {self.error:.2e} > allowed {self.allowed:.2e}"


def allowed_errors(
    eager: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None] | None, dtype: torch.dtype
) -> dict[str, float]:
    """Per-tensor tolerance: the dtype's, or 3x eager's own error against float64 if larger."""
    floor = TOLERANCES.get(dtype, 1e-3)
    allowed = {}
    for name, value in eager.items():
        own = 0.0
        if reference is not None and value is not None and reference.get(name) is not None:
            own = relative_error(value, reference[name])
            own = 0.0 if math.isinf(own) else own
        allowed[name] = max(floor, EAGER_ERROR_FACTOR * own)
    return allowed


def compare(
    actual: dict[str, torch.Tensor | None], eager: dict[str, torch.Tensor | None], allowed: dict[str, float]
) -> tuple[float, Mismatch | None]:
    """The largest relative error over all tensors, and the tensor furthest outside its tolerance
    (None if every tensor agrees with eager)."""
    largest, worst = 0.0, None
    for name in sorted(set(actual) - set(eager)):
        return math.inf, Mismatch(f"{name} is unexpected", math.inf, 0.0)
    for name, expected in eager.items():
        value = actual.get(name)
        if (value is None) != (expected is None):
            return math.inf, Mismatch(f"{name} is {'missing' if value is None else 'unexpected'}", math.inf, 0.0)
        if expected is None:
            continue
        error = relative_error(value, expected)
        largest = max(largest, error)
        excess = error / allowed[name]
        if error > allowed[name] and (worst is None or excess > worst.error / worst.allowed):
            worst = Mismatch(name, error, allowed[name])
    return largest, worst
