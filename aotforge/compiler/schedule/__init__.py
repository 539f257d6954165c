"""Scheduling: from the lowered graph to what runs, in three stages with printable records.

    reads  = analyze_reads(lowered)          # BufferReads: who reads what, at which index
    plan   = fuse(lowered, reads)            # KernelPlan: kernel groups and extern calls, in order
    memory = plan_memory(lowered, plan, reads)  # MemoryPlan: allocations, reuse, frees
"""
from .fusion import KernelGroup, KernelPlan, fuse
from .memory import MemoryPlan, plan_memory
from .reads import BufferReads, analyze_reads

__all__ = ["BufferReads", "KernelGroup", "KernelPlan", "MemoryPlan", "analyze_reads", "fuse", "plan_memory"]
