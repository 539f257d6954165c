"""The suite runs on machines without a GPU (CI), where the generated Triton kernels run in
Triton's interpreter. The interpreter must be on before ``triton.language`` is first imported
(Triton decides per ``@triton.jit`` function, at definition), and test modules of any folder
may import it during collection (through torch, aotforge or Triton itself), so it is switched
on here, before anything is collected. On a GPU machine (tests/gpu) it stays off."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests compile to see the compiler work: the compiled-graph and AOT caches would replace that
# with a load from an earlier run. Their own tests (tests/compiler/runtime/test_graph_cache.py)
# turn them on.
os.environ.setdefault("AOTFORGE_CACHE", "0")
