"""The CPU suite (issue 24): workloads sized for a small CPU (a 2-core machine runs a full-size
step in a few ms to ~200 ms), on which aotforge's CPU code generation is measured against eager
and inductor's C++ backend. Each runs float32, in training and in inference:

- ``cpu_mlp``: 4x (Linear, LayerNorm, GELU) at width 1024, batch 256 (models.py's MLP);
- ``cpu_convnet``: 3 conv-BatchNorm-ReLU blocks (BatchNorm in training mode), pooling and a
  linear head, 32 images of 32x32;
- ``cpu_transformer``: one pre-LN transformer block whose attention is written out as matmuls,
  a causal mask and softmax (no fused attention kernel), batch 8, 64 tokens, d=256;
- ``cpu_resnet18`` and ``cpu_mobilenetv3``: torchvision's ResNet-18 and MobileNetV3-small
  (random weights, dropout off), 8 images of 64x64, when torchvision is installed (reported
  SKIPPED otherwise, as the hf suite does for its packages).

Classifiers return their cross-entropy loss in training and logits in inference; the MLP and
the transformer block return their activations and the harness back-propagates a fixed random
gradient through them. ``--quick`` shrinks every size (CI smoke runs).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from aotforge.bench.workload import Case, Workload
from aotforge.bench.workloads.hf import ClassifierLoss
from aotforge.bench.workloads.models import Block, CausalSelfAttention, mlp_case


def build_cpu_mlp(mode: str, quick: bool) -> Case:
    batch, width, depth = (32, 128, 2) if quick else (256, 1024, 4)
    return mlp_case(batch, width, width, depth)


class ConvNet(nn.Module):
    """Conv-BN-ReLU blocks, each but the last followed by 2x2 max pooling, then global average
    pooling and a linear classifier."""

    def __init__(self, widths: tuple[int, ...], classes: int) -> None:
        super().__init__()
        layers, cin = [], 3
        for index, width in enumerate(widths):
            layers += [nn.Conv2d(cin, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
            if index < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
            cin = width
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(self.features(images), 1), 1))
        return logits if labels is None else F.cross_entropy(logits, labels)


def _classifier_case(model: nn.Module, batch: int, size: int, classes: int, mode: str) -> Case:
    images = torch.randn(batch, 3, size, size)
    if mode == "infer":
        return Case(model, (images,))
    return Case(model, (images, torch.randint(0, classes, (batch,))))


def build_cpu_convnet(mode: str, quick: bool) -> Case:
    widths, batch, size = ((8, 16, 32), 4, 16) if quick else ((32, 64, 128), 32, 32)
    return _classifier_case(ConvNet(widths, 10), batch, size, 10, mode)


class MatmulAttention(CausalSelfAttention):
    """Causal self-attention written out: ``softmax(q k^T / sqrt(d) + mask) v`` as matmuls,
    as models without a fused attention kernel run it (the scores' softmax is the reduction
    a CPU code generator must fuse)."""

    def __init__(self, n_embd: int, n_head: int, length: int) -> None:
        super().__init__(n_embd, n_head)
        self.register_buffer("causal", torch.ones(length, length, dtype=torch.bool).tril(), persistent=False)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        length = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        scores = scores.masked_fill(~self.causal[:length, :length], float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def build_cpu_transformer(mode: str, quick: bool) -> Case:
    batch, length, n_embd, n_head = (2, 16, 32, 2) if quick else (8, 64, 256, 4)
    block = Block(n_embd, n_head)
    block.attn = MatmulAttention(n_embd, n_head, length)
    return Case(block, (torch.randn(batch, length, n_embd),), grad_inputs=(0,))


def _torchvision_case(name: str, mode: str, quick: bool, **options) -> Case:
    import torchvision

    classes = 1000
    model = getattr(torchvision.models, name)(weights=None, num_classes=classes, **options)
    batch, size = (2, 32) if quick else (8, 64)
    return _classifier_case(ClassifierLoss(model), batch, size, classes, mode)


def build_cpu_resnet18(mode: str, quick: bool) -> Case:
    return _torchvision_case("resnet18", mode, quick)


def build_cpu_mobilenetv3(mode: str, quick: bool) -> Case:
    # No dropout, so that every backend computes the same function as eager.
    return _torchvision_case("mobilenet_v3_small", mode, quick, dropout=0.0)


CPU_WORKLOADS = [
    Workload("cpu_mlp", "cpu", build_cpu_mlp, "4x (Linear, LayerNorm, GELU), width 1024, batch 256"),
    Workload("cpu_convnet", "cpu", build_cpu_convnet, "3x (conv, BatchNorm, ReLU) + pool + linear, 32 images of 32x32"),
    Workload("cpu_transformer", "cpu", build_cpu_transformer,
             "one pre-LN transformer block, attention as matmuls + softmax, 8x64 tokens, d=256"),
    Workload("cpu_resnet18", "cpu", build_cpu_resnet18, "torchvision resnet18, 8 images of 64x64", ("torchvision",)),
    Workload("cpu_mobilenetv3", "cpu", build_cpu_mobilenetv3,
             "torchvision mobilenet_v3_small, 8 images of 64x64", ("torchvision",)),
]
