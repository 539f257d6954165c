"""Partitioners: split a joint forward+backward graph into a forward and a backward graph."""
from .default import default_partition

__all__ = ["default_partition"]
