"""Measuring one step: time, peak memory, device copy bandwidth, and correctness against eager.

What is measured where:

- **Rounds**: the runner keeps every backend of one workload and mode alive and times them in
  alternating rounds (:class:`RoundClock`), so that load from other processes, which comes and
  goes over seconds, falls on every backend alike instead of on whole rows. A step shorter than
  :data:`MIN_BATCH_S` is timed as a batch of steps (the batch's time over its length), so that
  no row is a timer's resolution or one preemption.
- **CUDA**: each batch is bracketed by CUDA events; the batches of one round are queued back to
  back (as steps of a training loop are) and the device synchronized once per round, before
  the events are read. Peak memory is ``torch.cuda.max_memory_allocated`` over the warm-up
  steps, after a reset, less what was allocated before the backend's copy of the model was made
  (the other backends' models, still alive for the rounds).
- **CPU**: wall clock (``time.perf_counter``) per batch. Peak memory is the process's peak
  resident set size over the warm-up steps (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs``) less its resident set before the backend's copy was made; where
  the peak cannot be reset it is the process's lifetime peak, less the same. Threads are fixed
  (and the process pinned to as many CPUs) by :func:`pin_cpu_threads`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import statistics
import threading
import time
from typing import Callable, Hashable, Iterator, Sequence

import torch

# Largest relative error ||a - b|| / ||b|| allowed between a backend and eager, per dtype. The
# allowance widens to 3x eager's own error against a float64 run where that is larger: two
# correct programs may differ from each other by about twice their distance to the truth.
TOLERANCES = {torch.float64: 1e-7, torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}
EAGER_ERROR_FACTOR = 3.0
# A tensor whose values are smaller than this (root mean square, per dtype: torch.testing's
# default atol) is compared against this scale instead of its own norm: values that are zero up
# to rounding differ between two correct programs by far more than the tolerance of their size.
# MobileNetV3-small's BatchNorm after a BatchNorm-normalized 1x1 convolution keeps a running mean
# of about 2e-10 (a mean that is 0 in exact arithmetic); eager NHWC and eager NCHW differ on it by
# 3.7e-9 (float32, one training step), which the former floor (1e-6 for every dtype) called a
# 3e-3 relative error, over float32's 1e-3.
ABSOLUTE_FLOORS = {torch.float64: 1e-7, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}


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


# A step shorter than this is timed as a batch of steps lasting about this long: one step of a
# small workload is tens of microseconds, close to what a single call of the clock, a cache miss
# or a preemption costs.
MIN_BATCH_S = 1e-3
MAX_BATCH = 10_000


def warm_up(step: Callable[[], object], device: torch.device, warmup: int, min_warmup_s: float = 0.0) -> float:
    """Run ``step`` at least ``warmup`` times and for at least ``min_warmup_s`` together (at most
    100 calls; the first steps of a process can run far slower than the rest: thread pools,
    memory growing); return the seconds one step takes, the median over the later half of the
    calls (at least one call is made)."""
    times = []
    start = time.perf_counter()
    for count in range(100):
        if count >= max(warmup, 1) and time.perf_counter() - start >= min_warmup_s:
            break
        begin = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[len(times) // 2:])


def batch_size(step_s: float, min_batch_s: float = MIN_BATCH_S) -> int:
    """How many steps one timed CUDA batch holds: enough to last ``min_batch_s`` (1 for slow
    steps), judged from the warm-up."""
    if step_s <= 0:
        return MAX_BATCH
    return max(1, min(MAX_BATCH, math.ceil(min_batch_s / step_s)))


class RoundClock:
    """Times the batches of one round: ``clock.time(key, step, count)`` for each backend, then
    ``clock.finish()`` gives milliseconds per step, by key, and ``clock.steps`` each batch's length.

    On the CPU a batch runs steps until it has lasted :data:`MIN_BATCH_S` (at least one step;
    ``count`` is not needed there), by the wall clock: a step that stalls (a preemption, a
    parallel region waiting for a time slice) ends its batch instead of multiplying by a fixed
    count. On CUDA a batch is ``count`` steps bracketed by events, and nothing waits between
    batches (each starts as soon as the previous one's work is queued, as in a training loop);
    ``finish`` synchronizes once and reads the events.
    """

    def __init__(self, device: torch.device, min_batch_s: float = MIN_BATCH_S) -> None:
        self.device = device
        self.min_batch_s = min_batch_s
        self.steps: dict[Hashable, int] = {}
        self.cpu_ms: dict[Hashable, float] = {}
        self.events: dict[Hashable, tuple[object, object]] = {}

    def time(self, key: Hashable, step: Callable[[], object], count: int) -> None:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                step()
            end.record()
            self.events[key], self.steps[key] = (start, end), count
            return
        done, begin = 0, time.perf_counter()
        while True:
            step()
            done += 1
            elapsed = time.perf_counter() - begin
            if elapsed >= self.min_batch_s or done >= MAX_BATCH:
                break
        self.cpu_ms[key], self.steps[key] = elapsed * 1e3 / done, done

    def finish(self) -> dict[Hashable, float]:
        if self.events:
            torch.cuda.synchronize(self.device)
        times = dict(self.cpu_ms)
        for key, (start, end) in self.events.items():
            times[key] = start.elapsed_time(end) / self.steps[key]
        return times


def rotated(items: Sequence, round_index: int) -> list:
    """``items`` starting at position ``round_index`` (mod its length): round r's order, so that
    no backend always runs first (after a slower one's caches, or right after a compile)."""
    if not items:
        return []
    shift = round_index % len(items)
    return list(items[shift:]) + list(items[:shift])


def time_steps(
    step: Callable[[], object], device: torch.device, warmup: int, repeat: int, min_warmup_s: float = 0.0
) -> list[float]:
    """Milliseconds per step of ``repeat`` batches of ``step`` (one step each unless a step is
    shorter than :data:`MIN_BATCH_S`), after :func:`warm_up`: one step function timed alone,
    as the copy bandwidth is; the runner interleaves backends instead."""
    count = batch_size(warm_up(step, device, warmup, min_warmup_s))
    times = []
    for _ in range(repeat):
        clock = RoundClock(device)
        clock.time(0, step, count)
        times.append(clock.finish()[0])
    return times


def pin_cpu_threads(threads: int | None = None) -> tuple[int, list[int] | None]:
    """Fix torch's intra-op thread count for the whole run and pin the process to that many CPUs.

    ``threads`` defaults to torch's own count and is capped at the CPUs this process may run on
    (a container or ``taskset`` may allow fewer than the machine has, and a thread without a CPU
    of its own makes every parallel region wait for a time slice). Every thread of the process
    is then restricted to the first ``threads`` of those CPUs (Linux; elsewhere only the count is
    fixed). Returns the count and the CPUs, or None for the CPUs where affinity is unavailable
    or was refused."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    count = threads or torch.get_num_threads()
    count = max(1, min(count, len(allowed)) if allowed else count)
    torch.set_num_threads(count)
    if not allowed or not hasattr(os, "sched_setaffinity"):
        return count, None
    cpus = allowed[:count]
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return count, None
    # On Linux affinity belongs to a thread: the pools torch has already started keep theirs.
    try:
        others = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        others = []
    for tid in others:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # the thread ended meanwhile
    return count, cpus


class OutOfTime(BaseException):
    """Raised inside a backend's run by :func:`time_limit`. A BaseException, so that compilers
    that catch Exception to fall back (Dynamo, autotuners) let it through."""


def out_of_time_message(seconds: float) -> str:
    return f"did not finish within {seconds:g} s (--backend-timeout)"


@contextlib.contextmanager
def time_limit(seconds: float | None, whole: float | None = None) -> Iterator[None]:
    """Interrupt the block with :class:`OutOfTime` after ``seconds`` (SIGALRM; main thread on
    Unix only, elsewhere no limit). Python code is interrupted; a long call into C is not.
    ``whole``: the limit to name in the message, when ``seconds`` is what is left of it."""
    usable = seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise OutOfTime(out_of_time_message(whole or seconds))

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def median(values: list[float]) -> float:
    return statistics.median(values)


# A row whose rounds disagree by more than this (spread over its median) is flagged NOISY: its
# times, or its ratio to another row, are not a stable reading on this machine now.
NOISY_SPREAD = 0.15


def spread(values: Sequence[float]) -> float | None:
    """Half the interquartile range over the median, as a fraction: how much the repeats
    of one row disagree (0.05 reads as +-5%)."""
    if len(values) < 2:
        return None
    ordered = sorted(values)

    def quantile(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    middle = quantile(0.5)
    return (quantile(0.75) - quantile(0.25)) / 2 / middle if middle else None


def current_bytes(device: torch.device) -> int | None:
    """Memory in use now: ``torch.cuda.memory_allocated`` on CUDA, resident set size on the CPU
    (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory over a region, in bytes, less ``baseline`` (memory that belongs to others,
    such as the other backends' models): ``with PeakMemory(device, base) as peak: ...; peak.bytes``."""

    def __init__(self, device: torch.device, baseline: int | None = 0) -> None:
        self.device = device
        self.baseline = baseline
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
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _peak_rss()
        if peak is not None and self.baseline is not None:
            peak = max(0, peak - self.baseline)
        self.bytes = peak


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
    floor = ABSOLUTE_FLOORS.get(expected.dtype, 1e-5)
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(device=actual.device, dtype=torch.float64)
    finite_a, finite_e = torch.isfinite(actual), torch.isfinite(expected)
    if not torch.equal(finite_a, finite_e) or not torch.equal(actual[~finite_a].nan_to_num(), expected[~finite_e].nan_to_num()):
        return math.inf
    actual, expected = actual[finite_a], expected[finite_e]
    scale = max(expected.norm().item(), floor * math.sqrt(max(expected.numel(), 1)))
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
