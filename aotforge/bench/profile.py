"""Where a step's time goes: ``python -m aotforge bench --profile``.

Each backend's warm step runs a few times under ``torch.profiler``; the device's kernels are
sorted into categories by name and summed per step:

    generated   kernels a compiler generated (aotforge's ``aot_*``, inductor's ``triton_*``)
    library     cuBLAS / cuDNN / cutlass / flash-attention kernels (matmul, convolution, attention)
    copies      memcpy, memset and ATen's copy kernels (layout changes, dtype casts)
    other       every other ATen kernel (what a compiler left to eager's kernels)

plus the host time to enqueue one step (the step's Python, timed without waiting for the
device), kernel launches per step, and the kernels that took the most device time. Without a
GPU only the host time and the operator count are measured.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch

CATEGORIES = ("generated", "library", "copies", "other")
# Substrings of kernel names, lower case, by category (checked in this order).
_MARKERS = {
    "generated": ("aot_poi_", "aot_per_", "aot_red_", "aot_pointwise", "aot_persistent", "aot_looped",
                  "aot_reduction", "triton_"),
    "copies": ("memcpy", "memset", "copy_kernel", "direct_copy", "copy_device_to_device", "nchwtonhwc",
               "nhwctonchw", "transpose"),
    "library": ("gemm", "cutlass", "cublas", "xmma", "cudnn", "flash", "fmha", "nvjet", "sm90_", "sm80_",
                "conv", "wgrad", "dgrad", "implicit_convolve", "winograd", "attention", "splitk"),
}
TOP_KERNELS = 5  # in the printed table; the JSON keeps up to KEPT_KERNELS, to compare compilers kernel by kernel
KEPT_KERNELS = 300


def category(kernel_name: str) -> str:
    """The category (``CATEGORIES``) a device kernel's name puts it in."""
    name = kernel_name.lower()
    for kind, markers in _MARKERS.items():
        if any(marker in name for marker in markers):
            return kind
    return "other"


@dataclasses.dataclass
class Profile:
    """One backend's step, per step: device ms by category, host ms, launches, top kernels."""

    device_ms: dict  # category -> ms per step
    host_ms: float
    launches: float
    top: list  # (kernel name, ms per step, launches per step), most time first (KEPT_KERNELS)

    def total_device_ms(self) -> float:
        return sum(self.device_ms.values())

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _host_ms(step: Callable[[], object], device: torch.device, steps: int) -> float:
    """Median time for the step's Python to return, the device drained before each step."""
    samples = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(samples)


def _device_kernels(prof: Any) -> list[tuple[str, float]]:
    """(name, device microseconds) of every device kernel, memcpy and memset the trace holds."""
    kernels = []
    for event in prof.events():
        device_type = getattr(event, "device_type", None)
        if device_type is None or device_type.name not in ("CUDA", "PrivateUse1"):
            continue
        duration = getattr(event, "device_time", None)
        if duration is None:
            duration = getattr(event, "cuda_time", 0.0)
        kernels.append((event.name, float(duration)))
    return kernels


def profile_step(step: Callable[[], object], device: torch.device, steps: int = 5) -> Profile:
    """Profile ``steps`` runs of a warm ``step`` (see the module's docstring)."""
    from torch.profiler import ProfilerActivity, profile

    host_ms = _host_ms(step, device, steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    per_step: dict[str, float] = {kind: 0.0 for kind in CATEGORIES}
    by_name: dict[str, list] = {}
    kernels = _device_kernels(prof)
    for name, micros in kernels:
        per_step[category(name)] += micros / 1e3 / steps
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += micros / 1e3 / steps
        entry[1] += 1
    top = sorted(((name, ms, count / steps) for name, (ms, count) in by_name.items()), key=lambda t: -t[1])
    launches = len(kernels) / steps if kernels else sum(1 for e in prof.events() if e.name.startswith("aten::")) / steps
    return Profile(per_step, host_ms, launches, top[:KEPT_KERNELS])


def table(rows: list[tuple[str, str, str, Profile]]) -> str:
    """Markdown: one row per (workload, mode, backend) with its profile, then the top kernels."""
    lines = ["| workload | mode | backend | " + " | ".join(f"{c} ms" for c in CATEGORIES)
             + " | device ms | host ms | launches |", "|---" * (6 + len(CATEGORIES)) + "|"]
    for workload, mode, backend, prof in rows:
        cells = " | ".join(f"{prof.device_ms[c]:.2f}" for c in CATEGORIES)
        lines.append(f"| {workload} | {mode} | {backend} | {cells} | {prof.total_device_ms():.2f} | "
                     f"{prof.host_ms:.2f} | {prof.launches:.0f} |")
    lines.append("")
    for workload, mode, backend, prof in rows:
        if prof.top:
            kernels = "; ".join(f"{name[:60]} {ms:.3f} ms x{count:.0f}" for name, ms, count in prof.top[:TOP_KERNELS])
            lines.append(f"- {workload} {mode} {backend}: {kernels}")
    return "\n".join(lines)
