"""Memory-bound micro kernels. Each reports the fewest elements one step must move through
memory (read once, write once), so that the harness can give achieved GB/s and compare it
with a device-to-device copy.

Counts, for an input of ``n`` elements (weights and per-row statistics are small and left out):

- LayerNorm+GELU, softmax, RMSNorm: inference reads x and writes y (2n); training also reads
  the output's gradient and x again and writes x's gradient (5n).
- cross-entropy: inference reads the logits (n); training reads them again and writes their
  gradient (3n).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from aotforge.bench.workload import Case, Workload


class LayerNormGELU(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(x))


class Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


class RMSNorm(nn.Module):
    """Written out (not nn.RMSNorm), as models in the wild do."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden) + 0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class CrossEntropy(nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets)


def _rows_cols(quick: bool, big_cols: int = 4096) -> tuple[int, int]:
    return (64, 256) if quick else (16384, big_cols)


def _pointwise_case(module: nn.Module, mode: str, quick: bool) -> Case:
    rows, cols = _rows_cols(quick)
    per_step = 5 if mode == "train" else 2
    return Case(module, (torch.randn(rows, cols),), grad_inputs=(0,), elements_moved=per_step * rows * cols)


def build_layernorm_gelu(mode: str, quick: bool) -> Case:
    return _pointwise_case(LayerNormGELU(_rows_cols(quick)[1]), mode, quick)


def build_softmax(mode: str, quick: bool) -> Case:
    return _pointwise_case(Softmax(), mode, quick)


def build_rmsnorm(mode: str, quick: bool) -> Case:
    return _pointwise_case(RMSNorm(_rows_cols(quick)[1]), mode, quick)


def build_cross_entropy(mode: str, quick: bool) -> Case:
    rows, vocab = (64, 128) if quick else (4096, 32768)
    logits, targets = torch.randn(rows, vocab), torch.randint(0, vocab, (rows,))
    per_step = 3 if mode == "train" else 1
    return Case(CrossEntropy(), (logits, targets), grad_inputs=(0,), elements_moved=per_step * rows * vocab)


MICRO_WORKLOADS = [
    Workload("layernorm_gelu", "micro", build_layernorm_gelu, "GELU(LayerNorm(x)), 16384x4096"),
    Workload("softmax", "micro", build_softmax, "softmax over the last dim, 16384x4096"),
    Workload("rmsnorm", "micro", build_rmsnorm, "x * rsqrt(mean(x^2) + eps) * w, 16384x4096"),
    Workload("cross_entropy", "micro", build_cross_entropy, "cross-entropy, 4096 rows x 32768 classes"),
]
