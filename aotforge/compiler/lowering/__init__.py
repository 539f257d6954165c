"""Lowering: FX graph of ATen ops -> loop IR. Importing this package fills ``LOWERINGS``."""
from . import misc, pointwise, random, reductions, views  # noqa: F401  (each registers its lowerings)
from .graph import GraphLowering, lower
from .registry import LOWERINGS, LoweringContext, NotLowerable

__all__ = ["lower", "GraphLowering", "LOWERINGS", "LoweringContext", "NotLowerable"]
