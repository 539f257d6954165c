"""The workloads of ``python -m aotforge bench``, by suite.

- ``models``: an MLP with LayerNorm/GELU, a nanoGPT-style transformer, a ResNet-style CNN;
- ``micro``: memory-bound kernels (LayerNorm+GELU, softmax, RMSNorm, cross-entropy), whose
  achieved bandwidth is reported as a fraction of a device copy;
- ``hf``: Hugging Face GPT-2 and BERT (from their configs, random weights) and timm's
  ResNet-50, when those packages are installed;
- ``cpu``: models sized for a small CPU (MLP, conv net with BatchNorm, transformer block, and
  torchvision's ResNet-18 and MobileNetV3-small when installed), not in the default selection;
- ``families``: one tiny model of each popular architecture family (transformers, torchvision,
  timm), a correctness check on the GPU rather than a speed suite; not in the default selection.

Each workload builds a fresh CPU float32 case from a fixed seed; sizes are small under
``--quick`` (CPU, CI smoke runs) and large enough to fill a GPU otherwise.
"""
from aotforge.bench.workloads.cpu import CPU_WORKLOADS
from aotforge.bench.workloads.families import FAMILY_WORKLOADS
from aotforge.bench.workloads.hf import HF_WORKLOADS
from aotforge.bench.workloads.micro import MICRO_WORKLOADS
from aotforge.bench.workloads.models import MODEL_WORKLOADS

WORKLOADS = [*MODEL_WORKLOADS, *MICRO_WORKLOADS, *HF_WORKLOADS, *CPU_WORKLOADS, *FAMILY_WORKLOADS]
