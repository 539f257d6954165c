"""Launching a compiled Triton kernel without Triton's per-call dispatch.

``JITFunction.run`` binds the arguments, computes their specialization (dtype and 16-byte
alignment of each pointer, value classes of integers), looks the compiled kernel up and only
then launches: tens of microseconds of Python per launch, which for a training step of a few
hundred small kernels is a large part of the step. Our kernels' block sizes are fixed at
compile time (and their sizes too, unless symbolic: then the grid follows the size argument),
so the only thing that can change what Triton launches between calls is the arguments'
specialization. ``DirectLauncher`` keeps, per specialization seen, the compiled kernel that
Triton's own launch chose, and calls its launcher directly; an argument with a new
specialization (an unaligned view, say) goes through Triton once more and is remembered.

Used on CUDA only (the interpreter has no compiled kernels), and only where no launch hooks
(profilers) are installed: those expect Triton's own path.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch


def specialization(args: Sequence[Any]) -> tuple:
    """What Triton specializes a kernel on, for our arguments: each tensor's dtype and whether
    its data is 16-byte aligned; each integer (the sizes of a kernel of symbolic sizes) by
    whether it is 1, a multiple of 16, and fits 32 bits."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else (a == 1, a % 16 == 0, -2**31 <= a < 2**31) if isinstance(a, int) else a for a in args)


def usable(compiled: Any) -> bool:
    """Whether ``compiled`` (what ``JITFunction.run`` returned) can be launched directly."""
    try:
        from triton import knobs

        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):
        return False
    return (all(_no_hook(h) for h in hooks) and compiled is not None and callable(getattr(compiled, "run", None))
            and hasattr(compiled, "function") and hasattr(compiled, "packed_metadata"))


def _no_hook(hook: Any) -> bool:
    """No launch hook installed: None, or (Triton 3.6 and later) an empty ``HookChain``, which
    is always there."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def make_launch(compiled: Any, grid: Callable[[Sequence[Any]], int], tail: tuple, device: int,
                current_stream: Optional[Callable[[int], int]] = None) -> Callable[[Sequence[Any]], None]:
    """``launch(args)``: ``compiled`` on ``grid(args)`` programs with ``args`` followed by
    ``tail`` (the static sizes and the constexpr values, as Triton passes every bound argument
    to the launcher), on the current stream of ``device`` (the index of the GPU the arguments
    are on: bound here, where Triton asks torch for the current device at every launch)."""
    if current_stream is None:
        from triton.runtime.driver import driver

        current_stream = driver.active.get_current_stream
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata

    def launch(args: Sequence[Any]) -> None:
        run(grid(args), 1, 1, current_stream(device), function, metadata, None, None, None, *args, *tail)
    return launch


class DirectLauncher:
    """Per specialization, a direct launch of the kernel Triton compiled for it."""

    def __init__(self) -> None:
        self.launches: dict[tuple, Optional[Callable]] = {}

    def get(self, args: Sequence[Any]) -> tuple[tuple, Optional[Callable]]:
        key = specialization(args)
        return key, self.launches.get(key)

    def remember(self, key: tuple, compiled: Any, grid: Callable[[Sequence[Any]], int], tail: tuple,
                 device: int) -> None:
        self.launches[key] = make_launch(compiled, grid, tail, device) if usable(compiled) else None

    def aligned(self, args: Sequence[Any]) -> Optional[Callable]:
        """The launch for ``args`` when every argument is a tensor with 16-byte aligned data
        (what ``CallSite`` binds), else None."""
        if not all(isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0 for a in args):
            return None
        return self.launches.get(specialization(args))


class CallSite:
    """One graph's call of a shared kernel: what the generated wrapper's ``kernelN.run(...)``
    calls. Within one graph the arguments' dtypes never change, so once the kernel has a
    direct launch for aligned tensors, a call only checks that every pointer is still 16-byte
    aligned (Triton's other specialization) and launches: no per-argument key, no dispatch.
    Anything else (the first launches, an unaligned view, symbolic sizes, the interpreter, the
    C++ path) goes through the shared kernel's own ``run``."""

    __slots__ = ("kernel", "launch")

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.launch = kernel, None

    def run(self, *args: Any) -> None:
        launch = self.launch
        if launch is not None:
            pointers = 0
            for tensor in args:
                pointers |= tensor.data_ptr()
            if not pointers & 15:
                try:
                    launch(args)
                    return
                except TypeError:  # raised before launching: a Triton whose launcher takes
                    self.launch = None  # other arguments; the kernel's run says so and falls back
        self.kernel.run(*args)
        if self.launch is None and getattr(self.kernel, "direct", None) is not None:
            self.launch = self.kernel.direct.aligned(args)
