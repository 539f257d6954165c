"""Run workloads under backends: build, check against eager, then time.

For each workload and mode the runner

1. builds the pristine case on the CPU (fixed seed);
2. runs it once eagerly in float64 on the device (the reference that measures eager's own
   rounding error) and once eagerly in the run's dtype (what every backend must match);
3. for each backend, after ``torch._dynamo.reset()``: copies the case to the device, compiles,
   times the first call (compile time), compares outputs and gradients with eager
   (WRONG, not timed, when outside tolerance), then times ``repeat`` steps after ``warmup``.

A failure in one workload or backend becomes a FAILED row and the run goes on.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import sys
import time
import traceback
from typing import Callable, Iterable, Sequence

import torch
from torch.utils._pytree import tree_leaves

from aotforge.bench import measure
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
    # time.monotonic() after which nothing new starts: the rest is SKIPPED, so that a run
    # under a hard time limit still ends with its table and JSON. None: no limit.
    deadline: float | None = None
    # Seconds one backend may take on one workload (compile, check, timing); None: no limit.
    backend_timeout: float | None = None

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
    speedup: float | None = None  # eager median / this median
    vs_inductor: float | None = None  # inductor median / this median
    gbps: float | None = None  # micro kernels: achieved bandwidth
    copy_fraction: float | None = None  # ... over a device-to-device copy's
    traceback: str = ""


# --- backends -----------------------------------------------------------------------------------


def known_backends() -> list[str]:
    from torch._dynamo import list_backends

    return sorted({*DEFAULT_BACKENDS, *list_backends(exclude_tags=())})


def check_backends(names: Sequence[str]) -> None:
    """Raise a clear error for a backend name that neither we nor Dynamo know."""
    known = known_backends()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {', '.join(known)}")


def compile_module(backend: str, module: torch.nn.Module) -> Callable:
    if backend == "eager":
        return module
    if backend.startswith("aotforge"):
        import aotforge  # noqa: F401  (registers aotforge's backends with Dynamo on import)
    return torch.compile(module, backend=backend)


# --- one step -----------------------------------------------------------------------------------


def prepare(case: Case, mode: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, tuple]:
    """A fresh copy of the case on ``device``, floating-point tensors in ``dtype``."""
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


def make_step(fn: Callable, module: torch.nn.Module, inputs: tuple, mode: str) -> Callable[[], object]:
    """One inference call under no_grad, or one training step: forward and backward."""
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


def run_eager_once(case: Case, mode: str, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    module, inputs = prepare(case, mode, device, dtype)
    out = make_step(module, module, inputs, mode)()
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


def run_backend(
    backend: str,
    workload: Workload,
    case: Case,
    mode: str,
    settings: Settings,
    eager: dict[str, torch.Tensor | None],
    allowed: dict[str, float],
) -> Result:
    """Compile, check against eager, time; FAILED (never raising) when anything goes wrong."""
    from torch._dynamo.utils import counters

    result = Result(workload.name, workload.suite, mode, backend, "OK")
    torch._dynamo.reset()
    counters.clear()
    release(settings.device)
    try:
        with measure.time_limit(settings.backend_timeout):
            _check_and_time(result, case, settings, eager, allowed)
    except (Exception, measure.OutOfTime) as error:  # one backend's failure must not stop the run
        result.status, result.reason = "FAILED", one_line(error)
        result.traceback = _short_traceback(error)
    finally:
        torch._dynamo.reset()
        release(settings.device)
    return result


def _check_and_time(
    result: Result,
    case: Case,
    settings: Settings,
    eager: dict[str, torch.Tensor | None],
    allowed: dict[str, float],
) -> None:
    module, inputs = prepare(case, result.mode, settings.device, settings.dtype)
    step = make_step(compile_module(result.backend, module), module, inputs, result.mode)
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
        return
    with measure.PeakMemory(settings.device) as peak:
        result.times_ms = measure.time_steps(
            step, settings.device, settings.warmup, settings.repeat, settings.min_warmup_s
        )
    result.median_ms = measure.median(result.times_ms)
    result.peak_bytes = peak.bytes


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
            reference = run_eager_once(case, mode, settings.device, torch.float64)
            release(settings.device)
        eager = run_eager_once(case, mode, settings.device, settings.dtype)
        release(settings.device)
    except Exception as error:
        reason = f"eager failed: {one_line(error)}"
        return [Result(workload.name, workload.suite, mode, b, "FAILED", reason, traceback=_short_traceback(error)) for b in backends]
    allowed = measure.allowed_errors(eager, reference, settings.dtype)
    results = []
    for backend in backends:
        if settings.out_of_time():
            results.append(Result(workload.name, workload.suite, mode, backend, "SKIPPED", OUT_OF_TIME))
            continue
        progress(f"{workload.name} {mode} {backend} ...")
        result = run_backend(backend, workload, case, mode, settings, eager, allowed)
        progress(f"{workload.name} {mode} {backend}: {describe(result)}")
        results.append(result)
    add_ratios(results, case, settings.dtype, copy_bytes_per_s)
    return results


def describe(result: Result) -> str:
    if result.status != "OK":
        return f"{result.status} {result.reason}"
    return f"OK {result.median_ms:.3f} ms (first call {result.compile_s:.2f} s)"


def add_ratios(results: list[Result], case: Case, dtype: torch.dtype, copy_bytes_per_s: float | None) -> None:
    """Speedup over eager, ratio to inductor, and (micro kernels) achieved bandwidth."""
    timed = {r.backend: r.median_ms for r in results if r.median_ms}
    element_size = torch.empty((), dtype=dtype).element_size()
    for result in results:
        if not result.median_ms:
            continue
        if "eager" in timed:
            result.speedup = timed["eager"] / result.median_ms
        if "inductor" in timed:
            result.vs_inductor = timed["inductor"] / result.median_ms
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
