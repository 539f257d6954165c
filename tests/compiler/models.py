"""Small models shared by the CPU model tests and the GPU tests."""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.SiLU(),
                                    nn.Linear(width, 10))

    def forward(self, x):
        return torch.log_softmax(self.layers(x), dim=-1)


class TransformerBlock(nn.Module):
    def __init__(self, width: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.project = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (width // self.heads) ** 0.5
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attention = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        x = x + self.project(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class CNN(nn.Module):
    def __init__(self, channels: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.norm1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 5)

    def forward(self, x):
        x = torch.relu(self.norm1(self.conv1(x)))
        x = torch.relu(self.norm2(self.conv2(x)) + x)
        return self.head(x.mean(dim=(2, 3)))


class TinyGPT(nn.Module):
    """Embedding, two blocks with causal attention, layer norm, tied head: nanoGPT in small."""

    def __init__(self, vocab: int = 50, width: int = 32, context: int = 32):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList([TransformerBlock(width) for _ in range(2)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def train_step(model, *inputs):
    """One step of a model that returns its loss: (loss, gradients), gradients cleared."""
    loss = model(*inputs)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def example_input(name: str, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    shape = {"MLP": (8, 32), "TransformerBlock": (2, 8, 32), "CNN": (2, 3, 8, 8)}[name]
    return torch.randn(shape, dtype=dtype, device=device)


MODELS = {"MLP": MLP, "TransformerBlock": TransformerBlock, "CNN": CNN}
