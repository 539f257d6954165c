"""``python -m aotforge bench``: eager vs torch.compile (inductor) vs aotforge, side by side.

Runs each workload of ``aotforge/bench/workloads`` (training and inference) under each backend in
this process, on CUDA if there is a GPU and on the CPU otherwise; checks every backend's
outputs and gradients against eager before timing it; prints a Markdown table and writes JSON
(and a PNG bar chart when matplotlib is installed). ``--help`` lists the options.
"""
from aotforge.bench.main import main

__all__ = ["main"]
