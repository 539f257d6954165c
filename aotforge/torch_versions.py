"""What differs between the torch releases aotforge supports (2.11 up to 2.15), in one place.

Every entry says which releases behave which way and why aotforge cares, so that dropping an
old release later means deleting its branch here. (``aotforge.compat`` holds the
``functorch.compile`` names users call; it sits above ``aotforge.aot`` and cannot serve it.)
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

TORCH_VERSION = torch.torch_version.TorchVersion(torch.__version__)


def torch_at_least(version: str) -> bool:
    """True if the installed torch is ``version`` or newer (local tags such as +cpu ignored)."""
    return TORCH_VERSION >= version


def new_fake_mode(**kwargs) -> FakeTensorMode:
    """A FakeTensorMode whose fakes know shapes only, never values.

    From torch 2.14 a FakeTensorMode without a ShapeEnv copies the value of every 0-dim CPU
    integer (or float64) tensor it fakes, and ``.item()`` on the fake returns that value. A
    trace then bakes the example's value into the graph as a constant and leaves the input
    that carries it unused: a silent wrong answer for every other value. Up to 2.13 the same
    ``.item()`` raised DataDependentOutputException, which aotforge turns into a clear error
    (or, with a ShapeEnv, into an unbacked symbol). ``export=True`` (torch >= 2.4) is the
    switch that keeps fakes value-free; it changes nothing else in the mode."""
    return FakeTensorMode(export=True, **kwargs)


def backed_size_hints(shape_env) -> dict:
    """The ShapeEnv's backed size symbols with their values in this trace (Symbol -> Integer).

    torch 2.13 renamed ``ShapeEnv.var_to_val`` to ``backed_var_to_val``; the old name still
    answers there but warns (FutureWarning) on every read, which users saw on every cold
    compile of a dynamic-shape graph (issue 36). Older releases have only the old name."""
    hints = getattr(shape_env, "backed_var_to_val", None)
    return hints if hints is not None else shape_env.var_to_val


def optimization_size_hint(shape_env, expr, fallback: int) -> int:
    """A concrete value for the size ``expr``, to rank choices by (never for correctness): no
    guard is added; ``fallback`` where torch has no hint (an unbacked size).

    torch 2.13 deprecates ``ShapeEnv.size_hint`` (FutureWarning) for ``optimization_hint``;
    older releases have only ``size_hint``."""
    optimization_hint = getattr(shape_env, "optimization_hint", None)
    if optimization_hint is not None:
        return int(optimization_hint(expr, fallback=fallback))
    hint = shape_env.size_hint(expr, allow_none=True)
    return int(hint) if hint is not None else fallback
