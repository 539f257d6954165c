"""Running generated code: loading kernel modules, choosing block sizes (a heuristic first, a
small autotune only where it pays, its choices cached on disk), launching, and the tensor
helpers the wrapper calls."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import torch

from ...config import config
from ..codegen.triton import CHECKS_INDICES
from ..ir import ceil_pow2
from . import compile_pool, direct, disk_cache
from .disk_cache import cache_directory  # noqa: F401  (re-exported: the wrapper and tests use it)
from .modules import interpreting, module_file

log = logging.getLogger("aotforge")

# Autotune only reductions over at least this many elements: below it every candidate runs
# in a few microseconds and the extra compiles cost more than the best choice ever saves.
AUTOTUNE_MIN_ELEMENTS = 1 << 18
# At most this many candidates per kernel: each costs one more Triton compile.
MAX_CANDIDATES = 3
# Devices whose timings choose a configuration (the interpreter's timings mean nothing;
# tests add "cpu" to exercise the autotune cache).
AUTOTUNE_DEVICES = ("cuda",)
# How long a first launch waits for its kernel to come out of the compile pool before it
# compiles the kernel itself.
PRECOMPILE_TIMEOUT_S = 600.0


# --- configurations ------------------------------------------------------------------------

def candidate_configs(kind: str, numel: int, rnumel: int, contiguous: bool) -> list[dict]:
    """Block sizes to try, the heuristic's choice first. Pointwise kernels get the heuristic
    alone (memory-bound; the choice barely matters); reductions at most MAX_CANDIDATES."""
    if interpreting():  # few large programs: the interpreter pays per program, not per element
        if kind == "pointwise":
            return [dict(XBLOCK=min(ceil_pow2(numel), 4096))]
        if kind == "persistent":
            rblock = ceil_pow2(rnumel)
            return [dict(XBLOCK=max(1, min(ceil_pow2(numel), 4096 // rblock)), RBLOCK=rblock)]
        return [dict(XBLOCK=min(ceil_pow2(numel), 16), RBLOCK=min(ceil_pow2(rnumel), 32))]
    if kind == "pointwise":
        limit = ceil_pow2(numel)
        xblock = min(1024, limit)
        return [dict(XBLOCK=xblock, num_warps=4 if xblock >= 512 else 2 if xblock >= 256 else 1)]
    if kind == "persistent":
        rblock = ceil_pow2(rnumel)
        out: list[dict] = []
        for target in (2048, 4096, 1024):
            xblock = max(1, min(ceil_pow2(numel), target // rblock))
            elements = xblock * rblock
            warps = 2 if elements <= 512 else 4 if elements <= 2048 else 8 if elements <= 4096 else 16
            out.append(dict(XBLOCK=xblock, RBLOCK=rblock, num_warps=warps))
        if rblock >= 2048:  # long rows: one row per program, a few widths of thread block
            out[1:] = [dict(XBLOCK=1, RBLOCK=rblock, num_warps=w) for w in (4, 16)]
        return _distinct(out)[:MAX_CANDIDATES]
    if contiguous:
        return _distinct([dict(XBLOCK=1, RBLOCK=min(2048, ceil_pow2(rnumel)), num_warps=8),
                          dict(XBLOCK=1, RBLOCK=min(4096, ceil_pow2(rnumel)), num_warps=16),
                          dict(XBLOCK=4, RBLOCK=min(1024, ceil_pow2(rnumel)), num_warps=8)])
    # the reduced axis is strided: tiles wide along the contiguous outputs, several rows deep
    return [dict(XBLOCK=64, RBLOCK=16, num_warps=4), dict(XBLOCK=32, RBLOCK=64, num_warps=8),
            dict(XBLOCK=128, RBLOCK=8, num_warps=8)]


def _distinct(configs: list[dict]) -> list[dict]:
    out: list[dict] = []
    for candidate in configs:
        if candidate not in out:
            out.append(candidate)
    return out


# --- kernels -------------------------------------------------------------------------------

_fallback_logged = False


class Kernel:
    """One generated kernel with its launch logic.

    With ``arg_dtypes`` (the dtypes of the tensor arguments, in parameter order) the kernel
    hands its compilation to the compile pool at once (see compile_pool.py); its first launch
    waits for that and falls back to compiling in this process when the pool failed.
    ``precompiled`` takes futures from such a pool directly."""

    def __init__(self, fn: Any, name: str, source: str, kind: str, numel: int, rnumel: int,
                 contiguous: bool, mutates: bool, *, arg_dtypes: Optional[Sequence[torch.dtype]] = None,
                 module_path: Optional[str] = None,
                 precompiled: Optional[Future | Sequence[Future]] = None, hints: Optional[Sequence[int]] = None):
        self.fn, self.name, self.source, self.kind = fn, name, source, kind
        self.mutates = mutates
        # Symbolic sizes (``hints`` given: example values of the size symbols, numel and
        # rnumel): the wrapper passes the sizes with the buffers at each launch and the grid
        # follows them; block sizes are chosen once, for the hints (masks make any size right).
        self.dynamic = hints is not None
        self.hints = tuple(hints) if hints is not None else ()
        if self.dynamic:
            numel, rnumel = self.hints[-2], self.hints[-1]
        self.numel, self.rnumel = numel, rnumel
        self.configs = candidate_configs(kind, numel, rnumel, contiguous)
        if source and CHECKS_INDICES in source:
            # its index checks are device asserts, which Triton compiles only with debug on;
            # debug's integer-overflow checks stay off (they would check every index product)
            self.configs = [dict(c, debug=True, sanitize_overflow=False) for c in self.configs]
        # read now, while compiling: the first launch (a backward's, in autograd's thread)
        # runs outside the config patches this kernel was compiled under
        self.autotune, self.cache_dir = config.autotune, config.cache_dir
        self.best: Optional[dict] = None
        # launches past Triton's per-call dispatch, per argument specialization (CUDA only)
        self.direct: Optional[direct.DirectLauncher] = None
        # what the first launch spent, for the compile-time breakdown
        self.seconds = {"pool_wait": 0.0, "triton_compile": 0.0, "autotune": 0.0}
        # seconds the compile pool's workers spent on this kernel, in parallel with the rest
        self.pool_seconds = 0.0
        if isinstance(precompiled, Future):
            precompiled = [precompiled]
        self.pending: list[Future] = list(precompiled or [])
        if arg_dtypes is not None:
            self.start_precompile(module_path, arg_dtypes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The integer arguments after the buffers (for symbolic sizes: their hints; the
        wrapper passes the real ones)."""
        static = (self.numel,) if self.kind == "pointwise" else (self.numel, self.rnumel)
        return self.hints[:-2] + static if self.dynamic else static

    def tunes(self) -> bool:
        """Whether this kernel's first launch times its candidates (given a device that tunes)."""
        return (self.autotune and self.kind != "pointwise" and not self.mutates and len(self.configs) > 1
                and self.numel * self.rnumel >= AUTOTUNE_MIN_ELEMENTS)

    def start_precompile(self, module_path: Optional[str], arg_dtypes: Sequence[torch.dtype]) -> None:
        """Compile this kernel's configurations in the compile pool (no-op without one)."""
        path = module_path or module_file(self.fn)
        if path is None or self.numel == 0:
            return
        for candidate in (self.configs if self.tunes() else self.configs[:1]):
            future = compile_pool.precompile(path, self.name, list(arg_dtypes), list(self.sizes), [candidate])
            if future is not None:
                self.pending.append(future)

    def _await_precompile(self) -> None:
        """Wait for the pool's compiles; on any failure Triton compiles at launch instead."""
        global _fallback_logged
        deadline = time.monotonic() + PRECOMPILE_TIMEOUT_S
        pending, self.pending = self.pending, []
        for future in pending:
            try:
                seconds = future.result(timeout=max(0.0, deadline - time.monotonic()))
                if isinstance(seconds, float):
                    self.pool_seconds += seconds
            except Exception as error:  # noqa: BLE001  any failure: compile here instead
                if not _fallback_logged:
                    _fallback_logged = True
                    log.warning("aotforge: the compile pool failed to compile %s (%s: %s); compiling "
                                "kernels in this process instead", self.name, type(error).__name__, error)

    def _grid(self, chosen: dict) -> Callable[[Sequence[Any]], int]:
        """Programs to launch for given arguments: from the size argument when sizes are
        symbolic, else fixed."""
        xblock = chosen["XBLOCK"]
        if self.dynamic:
            position = -1 if self.kind == "pointwise" else -2
            return lambda args: (args[position] + xblock - 1) // xblock
        programs = (self.numel + xblock - 1) // xblock
        return lambda args: programs

    def _launch(self, args: Sequence[Any], chosen: dict) -> Any:
        """Launch through Triton's dispatch; returns the compiled kernel it chose (3.x)."""
        grid = (self._grid(chosen)(args),)
        try:
            if self.dynamic:
                return self.fn[grid](*args, **chosen)
            return self.fn[grid](*args, *self.sizes, **chosen)
        except Exception as error:
            # Triton's interpreter wraps what a kernel raised (InterpreterError): a bad index
            # raises eager's exception itself (interpret_math.aot_check_index)
            if getattr(error.__cause__, "aotforge_index_check", False):
                raise error.__cause__ from None
            raise

    def _dynamic_numel(self, args: Sequence[Any]) -> int:
        return args[-1] if self.kind == "pointwise" else args[-2] * args[-1]

    def run(self, *args: Any) -> None:
        if (self._dynamic_numel(args) if self.dynamic else self.numel) == 0:
            return  # an empty tensor: nothing to compute (and a grid of 0 programs is an error)
        if self.best is None:
            self._first_run(args)
            return
        if self.direct is None:
            self._launch(args, self.best)
            return
        key, launch = self.direct.get(args)
        if launch is not None:
            try:
                launch(args)
                return
            except TypeError as error:  # a Triton whose launcher takes other arguments
                log.warning("aotforge: launching %s directly failed (%s); using Triton's dispatch", self.name, error)
                self.direct = None
                self._launch(args, self.best)
                return
        compiled = self._launch(args, self.best)
        if key not in self.direct.launches:  # a new specialization: launch it directly next time
            constexprs = tuple(self.best[p.name] for p in getattr(self.fn, "params", ()) if p.is_constexpr)
            sizes = () if self.dynamic else self.sizes  # symbolic sizes come with the arguments
            device = next(a.device.index for a in args if isinstance(a, torch.Tensor))
            self.direct.remember(key, compiled, self._grid(self.best), (*sizes, *constexprs), device)

    def _first_run(self, args: Sequence[Any]) -> None:
        """Wait for the compile pool, choose a configuration, launch. ``seconds``: the wait,
        the first launch (Triton compiles here what the pool did not, and loads the binary)
        and the autotuning."""
        started = time.perf_counter()
        if self.pending:
            self._await_precompile()
        waited = time.perf_counter()
        best = self._choose(args)
        chosen = time.perf_counter()
        self._launch(args, best)  # Triton compiles here unless the pool (or its disk cache) did
        if not interpreting() and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            self.direct = direct.DirectLauncher()
        self.seconds["pool_wait"] += waited - started
        self.seconds["triton_compile"] += time.perf_counter() - chosen
        self.seconds["autotune"] += chosen - waited
        self.best = best

    def _choose(self, args: Sequence[Any]) -> dict:
        devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
        if not self.tunes() or not devices or not devices <= set(AUTOTUNE_DEVICES):
            return self.configs[0]
        device = torch.cuda.get_device_name() if "cuda" in devices else "cpu"
        import triton

        key = disk_cache.autotune_key([self.source, self.numel, self.rnumel, device, triton.__version__,
                                       [str(a.dtype) for a in args if isinstance(a, torch.Tensor)]], self.configs)
        stored = disk_cache.load_autotune(key, self.configs, self.cache_dir)
        if stored is not None:
            return stored
        timings = []
        for candidate in self.configs:
            try:
                timings.append((self._time(args, candidate, "cuda" in devices), candidate))
            except Exception:  # noqa: BLE001  a config the hardware rejects (too many registers, ...)
                continue
        best = min(timings, key=lambda t: t[0])[1] if timings else self.configs[0]
        disk_cache.store_autotune(key, self.configs, best, self.cache_dir)
        return best

    def _time(self, args: Sequence[Any], candidate: dict, on_gpu: bool) -> float:
        if on_gpu:
            return _time_on_gpu(lambda: self._launch(args, candidate))
        self._launch(args, candidate)  # compile
        started = time.perf_counter()
        self._launch(args, candidate)
        return time.perf_counter() - started


# Timing a candidate: enough launches for about this many milliseconds, within these bounds.
# (triton.testing.do_bench's 25 ms per candidate, with an L2 flush before each launch, made
# autotuning the largest part of a first step: thousands of launches per kernel.)
TUNE_MS, TUNE_MIN_LAUNCHES, TUNE_MAX_LAUNCHES = 1.0, 3, 50
GPU_SLEEP_CYCLES_PER_LAUNCH = 100_000  # about 50 us at 2 GHz: more than a launch from Python


def _time_on_gpu(launch: Callable[[], None]) -> float:
    """Milliseconds per launch: one launch to warm up and estimate, then a timed batch."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    launch()  # loads the binary (compiled by the pool) onto the device

    def timed(count: int) -> float:
        # The GPU waits while the launches are queued, so that kernels shorter than a launch
        # from Python are timed back to back, not at the rate Python issues them.
        torch.cuda._sleep(count * GPU_SLEEP_CYCLES_PER_LAUNCH)
        start.record()
        for _ in range(count):
            launch()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / count

    estimate = max(timed(1), 1e-3)
    return timed(int(min(TUNE_MAX_LAUNCHES, max(TUNE_MIN_LAUNCHES, TUNE_MS / estimate))))


# --- helpers called by generated wrappers ---------------------------------------------------

def _reinterpret_tensor(tensor: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int = 0) -> torch.Tensor:
    return torch.as_strided(tensor, size, stride, tensor.storage_offset() + offset)


def _fast_path(name: str) -> Optional[Callable]:
    """One of torch's C++ helpers for compiled code (2.11 to 2.15 have them), which skip the
    dispatcher: half the time of the ATen call or less, and a wrapper makes hundreds a step."""
    try:
        from torch._C._dynamo import guards
    except ImportError:
        return None
    return getattr(guards, name, None)


# reinterpret_tensor(tensor, size, stride, offset=0): a view of ``tensor``'s memory with the
# given layout, ``offset`` elements past the tensor's own
reinterpret_tensor = _fast_path("_reinterpret_tensor") or _reinterpret_tensor
# empty_strided_cpu / _cuda(size, stride, dtype): a new tensor on the CPU, or on the current GPU
empty_strided_cpu = _fast_path("_empty_strided_cpu") or (
    lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device="cpu"))
empty_strided_cuda = _fast_path("_empty_strided_cuda") or (
    lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device="cuda"))


def ensure_layout(tensor: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """Kernels index with the strides chosen at compile time; a tensor laid out differently
    (an ATen call that chose other strides, a caller's input) is copied into that layout.
    Some ATen ops return None where fake tensors promised a value (the philox seed and offset
    of cuDNN attention without dropout); those pass through."""
    if tensor is None or (tensor.stride() == stride and tensor.size() == size):
        return tensor  # the common case, two tuple comparisons (run per input and extern output)
    if tuple(tensor.shape) == tuple(size) and (tensor.numel() <= 1 or _same_strides(tensor, size, stride)):
        return tensor
    if tuple(tensor.shape) != tuple(size):
        raise RuntimeError(f"aotforge: expected a tensor of shape {tuple(size)}, got {tuple(tensor.shape)}; "
                           "the compiled graph is specialized to the shapes it was compiled for")
    out = torch.empty_strided(size, stride, dtype=tensor.dtype, device=tensor.device)
    out.copy_(tensor)
    return out


def _same_strides(tensor: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> bool:
    return all(n == 1 or a == b for n, a, b in zip(size, tensor.stride(), stride))


def check_mutated_input(tensor: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(size) or not _same_strides(tensor, size, stride):
        raise RuntimeError(
            f"aotforge: an input the graph writes into has layout {tuple(tensor.shape)}/{tensor.stride()}, "
            f"but the graph was compiled for {tuple(size)}/{tuple(stride)}; recompile for this layout")
    return tensor


_TensorGuards = _fast_path("TensorGuards")


def _never(*tensors: Any) -> bool:
    return False


class InputLayouts:
    """One check of every input of static layout per call, where the wrapper would otherwise
    call ``ensure_layout`` for each (hundreds of parameters: most of a small graph's Python).

    ``check(*inputs)`` is true only when each input has exactly the dtype, device, sizes,
    strides, requires_grad, dispatch keys and Python type of the input at that position in the
    call that last ran the per-input checks (``remember``, with the tensors those checks
    returned). Such a tensor is one ``ensure_layout``/``check_mutated_input`` returns as it is
    (both depend on sizes and strides alone), so skipping them changes nothing; anything else
    (a first call, another layout, None) is false and runs them as before. torch's C++
    TensorGuards (dynamo's, 2.11 to 2.15 have it) checks 200 tensors in about 30 us."""

    __slots__ = ("check",)

    def __init__(self) -> None:
        self.check = _never

    def remember(self, *tensors: Any) -> None:
        self.check = _never
        if _TensorGuards is None or not USE_INPUT_GUARD:
            return
        try:
            self.check = _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        except Exception:  # noqa: BLE001  not plain dense tensors (None, sparse): checked one by one
            self.check = _never


USE_INPUT_GUARD = True  # False: every input through ensure_layout at every call (A/B timing)
