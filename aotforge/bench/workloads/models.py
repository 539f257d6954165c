"""Built-in models: an MLP with LayerNorm/GELU, a nanoGPT-style transformer and a ResNet-style
CNN. No downloads; weights are random from a fixed seed.

In training the transformer and the CNN return their loss (cross-entropy on random targets),
as a training loop would; the MLP returns its activations and the harness back-propagates a
fixed random gradient through them. In inference each returns its logits/activations.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from aotforge.bench.workload import Case, Workload


class MLP(nn.Module):
    """``depth`` blocks of Linear -> LayerNorm -> GELU, then a Linear head."""

    def __init__(self, dim: int, hidden: int, depth: int) -> None:
        super().__init__()
        widths = [dim] + [hidden] * depth
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.LayerNorm(b), nn.GELU())
            for a, b in zip(widths[:-1], widths[1:])
        )
        self.head = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp_case(batch: int, dim: int, hidden: int, depth: int) -> Case:
    """An :class:`MLP` and one batch of ``batch`` x ``dim`` inputs (the cpu suite's MLP too)."""
    return Case(MLP(dim, hidden, depth), (torch.randn(batch, dim),))


def build_mlp(mode: str, quick: bool) -> Case:
    return mlp_case(*((16, 32, 64, 2) if quick else (8192, 1024, 4096, 4)))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (batch, heads, length, head_dim) for scaled_dot_product_attention.
        q, k, v = (
            t.view(batch, length, self.n_head, channels // self.n_head).transpose(1, 2)
            for t in (q, k, v)
        )
        y = self.attention(q, k, v)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, length, channels))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over (batch, heads, length, head_dim) tensors."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"), nn.Linear(4 * n_embd, n_embd)
        )
        # nanoGPT's residual dropouts (on the attention projection and the MLP output)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.ln_1(x)))
        return x + self.resid_dropout(self.mlp(self.ln_2(x)))


class NanoGPT(nn.Module):
    """A nanoGPT-style decoder: token + position embeddings, pre-LN blocks, tied LM head."""

    def __init__(
        self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)  # nanoGPT's embedding dropout
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        for name, parameter in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build_nanogpt(mode: str, quick: bool) -> Case:
    if quick:
        vocab, length, n_layer, n_head, n_embd, batch = 64, 16, 2, 2, 32, 2
    else:
        vocab, length, n_layer, n_head, n_embd, batch = 8192, 512, 6, 8, 512, 16
    model = NanoGPT(vocab, length, n_layer, n_head, n_embd)
    idx = torch.randint(0, vocab, (batch, length))
    if mode == "infer":
        return Case(model, (idx,))
    return Case(model, (idx, torch.randint(0, vocab, (batch, length))))


def build_nanogpt124m(mode: str, quick: bool, dropout: float = 0.0) -> Case:
    """GPT-2 small's shape (12 layers, d=768, 12 heads, vocab 50304), 8 sequences of 1024.
    ``dropout`` > 0 (benchmarks/rng_check.py) draws masks, which the suite's comparison with
    eager cannot check step by step, so the registered workload has none."""
    if quick:
        vocab, length, n_layer, n_head, n_embd, batch = 64, 16, 2, 2, 32, 2
    else:
        vocab, length, n_layer, n_head, n_embd, batch = 50304, 1024, 12, 12, 768, 8
    model = NanoGPT(vocab, length, n_layer, n_head, n_embd, dropout)
    idx = torch.randint(0, vocab, (batch, length))
    if mode == "infer":
        return Case(model, (idx,))
    return Case(model, (idx, torch.randint(0, vocab, (batch, length))))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet-18-style CNN (BasicBlocks, BatchNorm in training mode updates its stats)."""

    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, cin = [], widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                layers.append(BasicBlock(cin, width, 2 if stage > 0 and index == 0 else 1))
                cin = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        features = self.layers(self.stem(x))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(features, 1), 1))
        return logits if labels is None else F.cross_entropy(logits, labels)


def build_resnet(mode: str, quick: bool) -> Case:
    if quick:
        widths, per_stage, batch, size, classes = (8, 16), 1, 4, 16, 10
    else:
        widths, per_stage, batch, size, classes = (64, 128, 256, 512), 2, 64, 128, 1000
    model = ResNet(widths, per_stage, classes)
    images = torch.randn(batch, 3, size, size)
    if mode == "infer":
        return Case(model, (images,))
    return Case(model, (images, torch.randint(0, classes, (batch,))))


MODEL_WORKLOADS = [
    Workload("mlp", "models", build_mlp, "4x (Linear, LayerNorm, GELU), 8192x1024 -> 4096"),
    Workload("nanogpt", "models", build_nanogpt, "6-layer GPT, d=512, 8 heads, 16x512 tokens"),
    Workload("nanogpt124m", "models", build_nanogpt124m, "nanoGPT-124M: 12 layers, d=768, 12 heads, 8x1024 tokens"),
    Workload("resnet", "models", build_resnet, "ResNet-18-style CNN, 64 images of 128x128"),
]
