"""Running generated code: loading kernel modules, choosing block sizes (heuristics plus a
small autotune cached on disk), launching, and the tensor helpers the wrapper calls."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from typing import Any, Optional, Sequence

import torch

from ...config import config
from ..ir import ceil_pow2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cache_directory() -> str:
    directory = config.cache_dir or os.path.join(tempfile.gettempdir(), f"aotforge_{os.getuid()}")
    os.makedirs(directory, exist_ok=True)
    return directory


def load_module(source: str, stem: str) -> Any:
    """Write ``source`` to a file (Triton's JIT reads kernel source from files) and import it."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = os.path.join(cache_directory(), f"{stem}_{digest}.py")
    if not os.path.exists(path):
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as handle:
            handle.write(source)
        os.replace(temporary, path)
    name = f"aotforge_generated_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def candidate_configs(kind: str, numel: int, rnumel: int, contiguous: bool) -> list[dict]:
    """Block sizes to try, best guess first."""
    if interpreting():  # few large programs: the interpreter pays per program, not per element
        if kind == "pointwise":
            return [dict(XBLOCK=min(ceil_pow2(numel), 4096))]
        if kind == "persistent":
            rblock = ceil_pow2(rnumel)
            return [dict(XBLOCK=max(1, min(ceil_pow2(numel), 4096 // rblock)), RBLOCK=rblock)]
        return [dict(XBLOCK=min(ceil_pow2(numel), 16), RBLOCK=min(ceil_pow2(rnumel), 32))]
    if kind == "pointwise":
        limit = ceil_pow2(numel)
        options = [(1024, 4), (512, 4), (2048, 8), (256, 2)]
        return [dict(XBLOCK=min(x, limit), num_warps=w if x <= limit else 1) for x, w in options if x <= max(limit, 256)][:4] \
            or [dict(XBLOCK=limit, num_warps=1)]
    if kind == "persistent":
        rblock = ceil_pow2(rnumel)
        out = []
        for target in (2048, 4096, 8192, 1024):
            xblock = max(1, min(ceil_pow2(numel), target // rblock))
            elements = xblock * rblock
            warps = 2 if elements <= 512 else 4 if elements <= 2048 else 8 if elements <= 4096 else 16
            config_ = dict(XBLOCK=xblock, RBLOCK=rblock, num_warps=warps)
            if config_ not in out:
                out.append(config_)
        if rblock >= 2048:  # long rows: one row per program, a few widths of thread block
            for warps in (4, 16):
                candidate = dict(XBLOCK=1, RBLOCK=rblock, num_warps=warps)
                if candidate not in out:
                    out.append(candidate)
        return out
    if contiguous:
        return [dict(XBLOCK=1, RBLOCK=min(2048, ceil_pow2(rnumel)), num_warps=8),
                dict(XBLOCK=1, RBLOCK=min(4096, ceil_pow2(rnumel)), num_warps=16),
                dict(XBLOCK=4, RBLOCK=min(1024, ceil_pow2(rnumel)), num_warps=8)]
    # the reduced axis is strided: tiles wide along the contiguous outputs, several rows deep
    return [dict(XBLOCK=64, RBLOCK=16, num_warps=4), dict(XBLOCK=32, RBLOCK=64, num_warps=8),
            dict(XBLOCK=128, RBLOCK=8, num_warps=8), dict(XBLOCK=64, RBLOCK=64, num_warps=8),
            dict(XBLOCK=128, RBLOCK=32, num_warps=8)]


class Kernel:
    """One generated kernel with its launch logic."""

    def __init__(self, fn: Any, name: str, source: str, kind: str, numel: int, rnumel: int,
                 contiguous: bool, mutates: bool):
        self.fn, self.name, self.source, self.kind = fn, name, source, kind
        self.numel, self.rnumel, self.mutates = numel, rnumel, mutates
        self.configs = candidate_configs(kind, numel, rnumel, contiguous)
        self.best: Optional[dict] = None

    def _launch(self, args: Sequence[Any], chosen: dict) -> None:
        grid = ((self.numel + chosen["XBLOCK"] - 1) // chosen["XBLOCK"],)
        sizes = (self.numel,) if self.kind == "pointwise" else (self.numel, self.rnumel)
        self.fn[grid](*args, *sizes, **chosen)

    def run(self, *args: Any) -> None:
        if self.numel == 0:
            return  # an empty tensor: nothing to compute (and a grid of 0 programs is an error)
        if self.best is None:
            self.best = self._choose(args)
        self._launch(args, self.best)

    def _choose(self, args: Sequence[Any]) -> dict:
        on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if not (on_gpu and config.autotune and len(self.configs) > 1) or self.mutates:
            return self.configs[0]
        if self.numel * self.rnumel < (1 << 18):
            return self.configs[0]  # too small for the choice to matter; skip the compiles
        key = hashlib.sha256(f"{self.source}|{self.numel}|{self.rnumel}|{torch.cuda.get_device_name()}|"
                             f"{[str(a.dtype) for a in args]}".encode()).hexdigest()[:24]
        path = os.path.join(cache_directory(), f"autotune_{key}.json")
        if os.path.exists(path):
            with open(path) as handle:
                return json.load(handle)
        from triton.testing import do_bench

        timings = []
        for candidate in self.configs:
            try:
                timings.append((do_bench(lambda: self._launch(args, candidate), warmup=5, rep=20), candidate))
            except Exception:  # a config the hardware rejects (too many registers, ...)
                continue
        best = min(timings, key=lambda t: t[0])[1] if timings else self.configs[0]
        with open(path, "w") as handle:
            json.dump(best, handle)
        return best


# --- helpers called by generated wrappers ---------------------------------------------------

def reinterpret_tensor(tensor: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int = 0) -> torch.Tensor:
    """A view of ``tensor``'s memory with the given layout (offset relative to its data)."""
    return torch.as_strided(tensor, size, stride, tensor.storage_offset() + offset)


def ensure_layout(tensor: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """Kernels index with the strides chosen at compile time; a tensor laid out differently
    (an ATen call that chose other strides, a caller's input) is copied into that layout.
    Some ATen ops return None where fake tensors promised a value (the philox seed and offset
    of cuDNN attention without dropout); those pass through."""
    if tensor is None:
        return tensor
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
