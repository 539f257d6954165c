"""Compiler tests run the generated Triton kernels on the CPU through Triton's interpreter.
TRITON_INTERPRET must be set before any kernel is defined, so it is set here, at collection."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
