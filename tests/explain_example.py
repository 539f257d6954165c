"""A tiny model for ``python -m aotforge explain`` (and its test):

    python -m aotforge explain --model tests/explain_example.py:TinyClassifier \
        --input 8x16 --input 8:int64:4 --joint --loss-index 0
"""
import torch
import torch.nn as nn


class TinyClassifier(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear; returns (cross-entropy loss, detached logits)."""

    def __init__(self, features: int = 16, hidden: int = 8, classes: int = 4):
        super().__init__()
        self.encoder = nn.Linear(features, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, target):
        logits = self.head(torch.relu(self.norm(self.encoder(x))))
        return nn.functional.cross_entropy(logits, target), logits.detach()


class TinyEncoder(nn.Module):
    """One input, one output: the inference example."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def make_encoder() -> nn.Module:
    return TinyEncoder()
