"""Partitioners: split a joint forward+backward graph into a forward and a backward graph."""
from .default import default_partition
from .mincut import explain_partition, min_cut_rematerialization_partition

__all__ = ["default_partition", "min_cut_rematerialization_partition", "explain_partition"]
