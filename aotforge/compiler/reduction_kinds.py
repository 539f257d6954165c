"""The reductions a loop body may end in, one row each: what an empty row holds (identity),
the instruction that folds two partial results (combine), what the finished reduction
returns (the folded value, or the position of the best one) and whether a long reduction
may be cut into pieces whose partials a second reduction of the same kind folds (splittable).

Lowering (which kinds exist, split reductions), and every code generator (accumulators,
masks, the final fold) read this table; ``any``/``all`` lower to ``max``/``min`` of 0/1."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ReductionKind:
    name: str
    identity: str  # zero | one | lowest | highest: the value that changes no result
    combine: str  # the ``ops`` instruction folding two partials: add, mul, maximum, minimum
    returns_index: bool = False  # argmax/argmin: the position of the first best value
    splittable: bool = True  # partial results fold with the same kind

    def identity_value(self, dtype: torch.dtype) -> int | float:
        """The identity as a number of ``dtype`` (NaN-free: max of an empty float row is -inf)."""
        if self.identity in ("zero", "one"):
            return 0 if self.identity == "zero" else 1
        low = self.identity == "lowest"
        if dtype.is_floating_point:
            return float("-inf") if low else float("inf")
        if dtype == torch.bool:
            return 0 if low else 1
        info = torch.iinfo(dtype)
        return info.min if low else info.max


REDUCTIONS: dict[str, ReductionKind] = {kind.name: kind for kind in [
    ReductionKind("sum", "zero", "add"),
    ReductionKind("prod", "one", "mul"),
    ReductionKind("max", "lowest", "maximum"),
    ReductionKind("min", "highest", "minimum"),
    ReductionKind("argmax", "lowest", "maximum", returns_index=True, splittable=False),
    ReductionKind("argmin", "highest", "minimum", returns_index=True, splittable=False),
]}


def reduction_kind(name: str) -> ReductionKind:
    try:
        return REDUCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown reduction {name!r}; the kinds are {sorted(REDUCTIONS)}") from None


def result_dtype(kind: str, source: torch.dtype) -> torch.dtype:
    """The dtype a kernel holds the finished reduction in."""
    return torch.int64 if REDUCTIONS[kind].returns_index else source
