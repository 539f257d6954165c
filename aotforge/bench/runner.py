"""Run workloads under backends: build, check against eager, then time them interleaved.

For each workload and mode the runner

1. builds the pristine case on the CPU (fixed seed);
2. runs it once eagerly in float64 on the device (the reference that measures eager's own
   rounding error) and once eagerly in the run's dtype (what every backend must match);
3. for each backend in turn: copies the case to the device, compiles, times the first call
   (compile time), compares outputs and gradients with eager (WRONG, not timed, when outside
   tolerance), warms it up (peak memory, and how many steps one timed batch needs) and keeps
   it alive;
4. times the live backends in alternating rounds: one untimed round, then ``repeat`` rounds
   in each of which every backend runs one batch, the order rotated by one each round::

       round 1: eager    inductor aotforge_eager aotforge
       round 2: inductor aotforge_eager aotforge eager
       ...

   so that load from other processes, which comes and goes over seconds, lands on every
   backend alike rather than on whole rows. A row's median and spread are over its rounds;
   its speedup is the median over rounds of the two backends' ratio within a round.

Only one workload and mode is alive at a time: ``torch._dynamo.reset()`` and the models are
dropped before the next. A failure in one workload or backend becomes a FAILED row and the
run goes on.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import sys
import time
import traceback
from typing import Callable, Iterable, Sequence

import torch
from torch.utils._pytree import tree_leaves

from aotforge.bench import caches, measure, profile
from aotforge.bench.workload import Case, Workload

# Backends by name: plain eager, torch.compile's default (inductor), aotforge's two.
DEFAULT_BACKENDS = ("eager", "inductor", "aotforge_eager", "aotforge")
GRAD_OUTPUT_SEED = 1234
OUT_OF_TIME = "time budget (--time-budget) spent"


@dataclasses.dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    quick: bool = False
    warmup: int = 3
    repeat: int = 20
    # Keep warming up until this long has passed (see measure.time_steps).
    min_warmup_s: float = 0.5
    # Run eager in float64 once per workload to measure eager's own error (widens tolerances).
    float64_reference: bool = True
    # When rows are still NOISY after ``repeat`` rounds: keep timing rounds for up to this many
    # seconds more per workload and mode (and up to 3 x repeat rounds in all), until none is.
    stabilize_s: float = 0.0
    # time.monotonic() after which nothing new starts: the rest is SKIPPED, so that a run
    # under a hard time limit still ends with its table and JSON. None: no limit.
    deadline: float | None = None
    # Seconds one backend may take on one workload (compile, check, timing); None: no limit.
    backend_timeout: float | None = None
    # After timing, profile each backend's step (device time by category, host time, launches).
    profile: bool = False
    # Mixed precision as trained in practice: float32 weights and inputs, each step under
    # torch.autocast(dtype) (else the module and inputs are converted to dtype).
    autocast: bool = False
    # Compile every backend of every row against new empty caches (bench/caches.py), so that
    # each first call is a cold compile: nothing from an earlier run or an earlier row.
    cold_caches: bool = False

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


@dataclasses.dataclass
class Result:
    workload: str
    suite: str
    mode: str
    backend: str
    status: str  # OK, WRONG, FAILED, SKIPPED
    reason: str = ""
    median_ms: float | None = None
    times_ms: list[float] = dataclasses.field(default_factory=list)
    compile_s: float | None = None
    peak_bytes: int | None = None
    graphs: int | None = None
    graph_breaks: int | None = None
    break_reasons: list[str] = dataclasses.field(default_factory=list)
    max_error: float | None = None
    batch: int | None = None  # steps per timed batch, the median over rounds (>1 for short steps)
    speedup: float | None = None  # median over rounds of eager's time / this one's
    vs_inductor: float | None = None  # median over rounds of inductor's time / this one's
    # Why the row is not a stable reading (its rounds, or its ratios' rounds, spread over
    # measure.NOISY_SPREAD); "" when it is.
    noisy: str = ""
    gbps: float | None = None  # micro kernels: achieved bandwidth
    copy_fraction: float | None = None  # ... over a device-to-device copy's
    traceback: str = ""
    profile: dict | None = None  # bench.profile.Profile.to_json(), with --profile


# --- backends -----------------------------------------------------------------------------------


def known_backends() -> list[str]:
    from torch._dynamo import list_backends

    return sorted({*DEFAULT_BACKENDS, *list_backends(exclude_tags=())})


def check_backends(names: Sequence[str]) -> None:
    """Raise a clear error for a backend name that neither we nor Dynamo know
    (``backend:mode`` names a torch.compile mode too: ``inductor:reduce-overhead``)."""
    known = known_backends()
    unknown = [name for name in names if name.partition(":")[0] not in known]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {', '.join(known)}")


def compile_module(backend: str, module: torch.nn.Module) -> Callable:
    """``torch.compile(module, backend=...)``; ``backend:mode`` passes ``mode=`` as well."""
    if backend == "eager":
        return module
    backend, _, mode = backend.partition(":")
    if backend.startswith("aotforge"):
        import aotforge  # noqa: F401  (registers aotforge's backends with Dynamo on import)
    return torch.compile(module, backend=backend, mode=mode or None)


# --- one step -----------------------------------------------------------------------------------


def prepare(case: Case, mode: str, device: torch.device, dtype: torch.dtype,
            autocast: bool = False) -> tuple[torch.nn.Module, tuple]:
    """A fresh copy of the case on ``device``, floating-point tensors in ``dtype`` (float32
    under ``autocast``, which casts per op)."""
    dtype = torch.float32 if autocast and dtype != torch.float64 else dtype
    module = copy.deepcopy(case.module).to(device=device, dtype=dtype)
    module.train(mode == "train")
    inputs = []
    for index, value in enumerate(case.inputs):
        if isinstance(value, torch.Tensor):
            value = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
            value = value.detach().requires_grad_(mode == "train" and index in case.grad_inputs)
        inputs.append(value)
    return module, tuple(inputs)


class GradOutputs:
    """The gradients fed to the backward: one per differentiable output, the same values for
    every backend (a fixed seed; ones for a scalar loss), made once per step on its device."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] | None = None

    def __call__(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.values is None:
            generator = torch.Generator().manual_seed(GRAD_OUTPUT_SEED)
            self.values = [
                (torch.ones(()) if out.dim() == 0 else torch.randn(out.shape, generator=generator)).to(out.device, out.dtype)
                for out in outputs
            ]
        return self.values


def make_step(fn: Callable, module: torch.nn.Module, inputs: tuple, mode: str,
              autocast: torch.dtype | None = None) -> Callable[[], object]:
    """One inference call under no_grad, or one training step: forward and backward (the
    forward under ``torch.autocast(autocast)`` when given)."""
    if autocast is not None:
        device_type = next((x.device.type for x in inputs if isinstance(x, torch.Tensor)), "cuda")
        plain = fn

        def fn(*args):
            with torch.autocast(device_type, dtype=autocast):
                return plain(*args)
    if mode == "infer":

        def infer_step() -> object:
            with torch.no_grad():
                return fn(*inputs)

        return infer_step
    leaves = [p for p in module.parameters() if p.requires_grad]
    leaves += [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grad_outputs = GradOutputs()

    def train_step() -> object:
        for leaf in leaves:
            leaf.grad = None
        out = fn(*inputs)
        differentiable = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward(differentiable, grad_outputs(differentiable))
        return out

    return train_step


def snapshot(out: object, module: torch.nn.Module, inputs: tuple, to_cpu: bool) -> dict[str, torch.Tensor | None]:
    """Outputs, buffers (BatchNorm's running statistics: a compiled step must update them as
    eager does) and, after a training step, gradients; by name, detached."""
    values: dict[str, torch.Tensor | None] = {}
    for index, value in enumerate(tree_leaves(out)):
        if isinstance(value, torch.Tensor):
            values[f"output[{index}]"] = value.detach()
    for name, buffer in module.named_buffers():
        values[f"buffer {name}"] = buffer.detach()
    if module.training:
        for name, parameter in module.named_parameters():
            values[f"grad {name}"] = parameter.grad
        for index, value in enumerate(inputs):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                values[f"grad input[{index}]"] = value.grad
    if to_cpu:
        values = {k: None if v is None else v.detach().cpu() for k, v in values.items()}
    return values


def run_eager_once(case: Case, mode: str, device: torch.device, dtype: torch.dtype,
                   autocast: bool = False) -> dict[str, torch.Tensor | None]:
    module, inputs = prepare(case, mode, device, dtype, autocast)
    out = make_step(module, module, inputs, mode, dtype if autocast and dtype != torch.float64 else None)()
    return snapshot(out, module, inputs, to_cpu=True)


# --- one backend ----------------------------------------------------------------------------------


def one_line(error: BaseException) -> str:
    """The innermost cause's type and first line: what went wrong, not where Dynamo wrapped it."""
    for _ in range(20):  # Dynamo wraps a backend's error in BackendCompilerFailed
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None or inner is error:
            break
        error = inner
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 200 else text[:197] + "..."


def _short_traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(error)[-40:])


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _graph_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _break_reasons() -> list[str]:
    from torch._dynamo.utils import counters

    return [f"{count}x {reason.splitlines()[0][:200]}" for reason, count in counters["graph_break"].most_common(5)]


@dataclasses.dataclass(eq=False)  # hashed by identity: the key of its times in a round
class Live:
    """A backend that matched eager and is warm: compiled model, step and batch size, kept
    alive for the rounds."""

    result: Result
    step: Callable[[], object]
    batch: int
    used_s: float = 0.0  # spent on it so far (compile, check, warm-up, batches): --backend-timeout
    recompiled: bool = False  # Dynamo compiled during one of its timed batches
    steps: list[int] = dataclasses.field(default_factory=list)  # each timed batch's length

    def time_left(self, timeout: float | None) -> float | None:
        if timeout is None:
            return None
        if self.used_s >= timeout:
            raise measure.OutOfTime(measure.out_of_time_message(timeout))
        return timeout - self.used_s


def _fail(result: Result, error: BaseException) -> None:
    result.status, result.reason = "FAILED", one_line(error)
    result.traceback = _short_traceback(error)
    result.times_ms, result.median_ms = [], None


def start_backend(
    backend: str,
    workload: Workload,
    case: Case,
    mode: str,
    settings: Settings,
    eager: dict[str, torch.Tensor | None],
    allowed: dict[str, float],
) -> tuple[Result, Live | None]:
    """Compile, check against eager, warm up; the result and, when it matched eager, the live
    backend to time. FAILED (never raising) when anything goes wrong.

    Dynamo is not reset between the backends of one workload: the models compiled before stay
    valid (Dynamo guards each compiled frame on the backend that compiled it)."""
    from torch._dynamo.utils import counters

    result = Result(workload.name, workload.suite, mode, backend, "OK")
    counters.clear()  # this backend's graphs and breaks only: the others do not run meanwhile
    started = time.perf_counter()
    try:
        with measure.time_limit(settings.backend_timeout):
            live = _check_and_warm_up(result, case, settings, eager, allowed)
    except (Exception, measure.OutOfTime) as error:  # one backend's failure must not stop the run
        _fail(result, error)
        live = None
    if live is not None:
        live.used_s = time.perf_counter() - started
    release(settings.device)
    return result, live


def _check_and_warm_up(
    result: Result,
    case: Case,
    settings: Settings,
    eager: dict[str, torch.Tensor | None],
    allowed: dict[str, float],
) -> Live | None:
    # What the backends made before this one hold: not this one's memory.
    baseline = measure.current_bytes(settings.device)
    module, inputs = prepare(case, result.mode, settings.device, settings.dtype, settings.autocast)
    step = make_step(compile_module(result.backend, module), module, inputs, result.mode,
                     settings.dtype if settings.autocast else None)
    out, result.compile_s = measure.time_first_call(step, settings.device)
    actual = snapshot(out, module, inputs, to_cpu=False)
    del out
    if result.backend != "eager":
        result.graphs, result.graph_breaks = _graph_counts()
        result.break_reasons = _break_reasons()
    result.max_error, mismatch = measure.compare(actual, eager, allowed)
    del actual
    if mismatch is not None:
        result.status, result.reason = "WRONG", str(mismatch)
        return None
    with measure.PeakMemory(settings.device, baseline) as peak:
        step_s = measure.warm_up(step, settings.device, settings.warmup, settings.min_warmup_s)
    result.peak_bytes = peak.bytes
    result.batch = measure.batch_size(step_s)
    return Live(result, step, result.batch)


def time_rounds(live: list[Live], settings: Settings) -> None:
    """Time the live backends in alternating rounds (see the module's docstring): one untimed
    round (the backends checked first have sat idle while the others compiled), then
    ``settings.repeat`` timed ones. Each round appends one time per step to every row; a
    backend that raises or runs out of time is FAILED and leaves the rounds."""
    from torch._dynamo.utils import counters

    live = list(live)
    extra_until = None
    for index in itertools.count():
        if index > settings.repeat:
            # Enough rounds, unless some rows are still noisy and there is time for more.
            if not settings.stabilize_s or index > 3 * settings.repeat or not noise(live):
                break
            extra_until = extra_until or time.monotonic() + settings.stabilize_s
            if time.monotonic() > extra_until:
                break
        if index > 1 and settings.out_of_time():
            for entry in live:
                entry.result.reason = f"{index - 1} of {settings.repeat} rounds: {OUT_OF_TIME}"
            break
        clock = measure.RoundClock(settings.device)
        for entry in measure.rotated(live, index):
            graphs = counters["stats"]["unique_graphs"]
            begin = time.perf_counter()
            try:
                with measure.time_limit(entry.time_left(settings.backend_timeout), settings.backend_timeout):
                    clock.time(entry, entry.step, entry.batch)
            except (Exception, measure.OutOfTime) as error:
                _fail(entry.result, error)
                live.remove(entry)
                continue
            finally:
                entry.used_s += time.perf_counter() - begin
            entry.recompiled |= index > 0 and counters["stats"]["unique_graphs"] != graphs
        times = clock.finish()
        if index > 0:
            for entry in live:
                entry.result.times_ms.append(times[entry])
                entry.steps.append(clock.steps[entry])
    for entry in live:
        entry.result.median_ms = measure.median(entry.result.times_ms)
        entry.result.batch = round(measure.median(entry.steps))
        entry.result.noisy = noise(live).get(entry, "")
        if entry.recompiled:  # its times include a compile: say so rather than hide it
            entry.result.reason = "; ".join(filter(None, [entry.result.reason, "Dynamo recompiled while it was timed"]))


def round_ratios(reference_ms: Sequence[float], times_ms: Sequence[float]) -> list[float]:
    """``reference / time`` within each round: a round's two times were taken seconds apart
    on the same machine, so a slow spell divides out."""
    return [ref / time for ref, time in zip(reference_ms, times_ms) if ref > 0 and time > 0]


def noise(live: list[Live]) -> dict[Live, str]:
    """The live rows that are not a stable reading yet, with why: their rounds spread over
    ``measure.NOISY_SPREAD``, or their per-round ratio to eager or inductor does."""
    by_backend = {entry.result.backend: entry.result.times_ms for entry in live}
    noisy = {}
    for entry in live:
        reasons = []
        own = measure.spread(entry.result.times_ms)
        if own is not None and own > measure.NOISY_SPREAD:
            reasons.append(f"times vary ±{100 * own:.0f}%")
        for reference in ("eager", "inductor"):
            if reference in by_backend and reference != entry.result.backend:
                ratio = measure.spread(round_ratios(by_backend[reference], entry.result.times_ms))
                if ratio is not None and ratio > measure.NOISY_SPREAD:
                    reasons.append(f"ratio to {reference} varies ±{100 * ratio:.0f}%")
        if reasons:
            noisy[entry] = f"NOISY over {len(entry.result.times_ms)} rounds: " + ", ".join(reasons)
    return noisy


# --- the whole run ------------------------------------------------------------------------------


def run_workload(
    workload: Workload,
    mode: str,
    backends: Sequence[str],
    settings: Settings,
    progress: Callable[[str], None],
    copy_bytes_per_s: float | None = None,
) -> list[Result]:
    if settings.out_of_time():
        return [Result(workload.name, workload.suite, mode, b, "SKIPPED", OUT_OF_TIME) for b in backends]
    missing = workload.missing_packages()
    if missing:
        return [Result(workload.name, workload.suite, mode, "-", "SKIPPED", f"needs {', '.join(missing)}")]
    try:
        torch.manual_seed(0)
        case = workload.build(mode, settings.quick)
        reference = None
        if settings.float64_reference and settings.dtype != torch.float64:
            try:
                reference = run_eager_once(case, mode, settings.device, torch.float64)
            except RuntimeError as error:  # a kernel without float64 (grouped matmuls): the dtype's tolerance
                progress(f"{workload.name} {mode}: no float64 reference ({one_line(error)})")
            release(settings.device)
        eager = run_eager_once(case, mode, settings.device, settings.dtype, settings.autocast)
        release(settings.device)
    except Exception as error:
        reason = f"eager failed: {one_line(error)}"
        return [Result(workload.name, workload.suite, mode, b, "FAILED", reason, traceback=_short_traceback(error)) for b in backends]
    allowed = measure.allowed_errors(eager, reference, settings.dtype)
    results: list[Result] = []
    live: list[Live] = []
    torch._dynamo.reset()
    try:
        for backend in backends:
            if settings.out_of_time():
                results.append(Result(workload.name, workload.suite, mode, backend, "SKIPPED", OUT_OF_TIME))
                continue
            progress(f"{workload.name} {mode} {backend} ...")
            if settings.cold_caches:
                caches.use_fresh_caches(f"{workload.name}-{mode}-{backend}")
            result, entry = start_backend(backend, workload, case, mode, settings, eager, allowed)
            progress(f"{workload.name} {mode} {backend}: {describe(result)}")
            results.append(result)
            if entry is not None:
                live.append(entry)
        if live:
            progress(f"{workload.name} {mode}: {settings.repeat} rounds of {', '.join(e.result.backend for e in live)} ...")
            time_rounds(live, settings)
            for entry in live:
                progress(f"{workload.name} {mode} {entry.result.backend}: {describe(entry.result)}")
                if settings.profile and entry.result.status == "OK":
                    entry.result.profile = profile.profile_step(entry.step, settings.device).to_json()
    finally:
        # One workload and mode alive at a time: drop the compiled models before the next.
        live.clear()
        torch._dynamo.reset()
        release(settings.device)
    add_ratios(results, case, settings.dtype, copy_bytes_per_s)
    return results


def describe(result: Result) -> str:
    if result.status != "OK":
        return f"{result.status} {result.reason}"
    if result.median_ms is None:  # checked and warm, not yet timed
        batch = f", timed in batches of {result.batch} steps" if result.batch and result.batch > 1 else ""
        return f"matches eager (first call {result.compile_s:.2f} s{batch})"
    return f"OK {result.median_ms:.3f} ms (first call {result.compile_s:.2f} s)"


def paired_ratio(reference_ms: Sequence[float], times_ms: Sequence[float]) -> float | None:
    """The median over rounds of ``reference / time`` within each round (``round_ratios``)."""
    ratios = round_ratios(reference_ms, times_ms)
    return measure.median(ratios) if ratios else None


def add_ratios(results: list[Result], case: Case, dtype: torch.dtype, copy_bytes_per_s: float | None) -> None:
    """Speedup over eager, ratio to inductor (paired by round), and (micro kernels) achieved
    bandwidth. Only timed rows take part: never a ratio to a row that has no time."""
    timed = {r.backend: r.times_ms for r in results if r.median_ms}
    element_size = torch.empty((), dtype=dtype).element_size()
    for result in results:
        if not result.median_ms:
            continue
        if "eager" in timed:
            result.speedup = paired_ratio(timed["eager"], result.times_ms)
        if "inductor" in timed:
            result.vs_inductor = paired_ratio(timed["inductor"], result.times_ms)
        if case.elements_moved:
            result.gbps = case.elements_moved * element_size / (result.median_ms / 1e3) / 1e9
            if copy_bytes_per_s:
                result.copy_fraction = result.gbps * 1e9 / copy_bytes_per_s


def run_all(
    workloads: Iterable[Workload],
    modes: Sequence[str],
    backends: Sequence[str],
    settings: Settings,
    copy_bytes_per_s: float | None = None,
    log: Callable[[str], None] | None = None,
    on_progress: Callable[[list[Result]], None] | None = None,
) -> list[Result]:
    """Every workload in every mode under every backend; ``on_progress(results so far)`` after
    each workload and mode (the command line rewrites its JSON there, so a killed run keeps
    what it measured)."""
    pairs = [(w, m) for w in workloads for m in modes]
    results: list[Result] = []
    for number, (workload, mode) in enumerate(pairs, 1):
        def progress(message: str, number: int = number) -> None:
            (log or _stderr)(f"[{number}/{len(pairs)}] {message}")

        results.extend(run_workload(workload, mode, backends, settings, progress, copy_bytes_per_s))
        if on_progress is not None:
            on_progress(results)
    return results


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
