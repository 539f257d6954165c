"""Hugging Face GPT-2 and BERT (built from their configs, random weights, no downloads) and
timm's ResNet-50, when ``transformers`` / ``timm`` are installed.

Dropout is set to zero so that every backend computes the same function and can be checked
against eager. The wrappers return one tensor: the loss in training (labels given), the
logits in inference. Under ``--quick`` the configs shrink to a couple of tiny layers.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from aotforge.bench.workload import Case, Workload


class LossOrLogits(nn.Module):
    """Wrap a Hugging Face model: ``(input_ids, labels=None) -> loss or logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        output = self.model(input_ids=input_ids, labels=labels)
        return output.logits if labels is None else output.loss


def _token_case(model: nn.Module, vocab: int, batch: int, length: int, mode: str) -> Case:
    ids = torch.randint(0, vocab, (batch, length))
    if mode == "infer":
        return Case(LossOrLogits(model), (ids,))
    return Case(LossOrLogits(model), (ids, torch.randint(0, vocab, (batch, length))))


def build_gpt2(mode: str, quick: bool) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0) if quick else {}
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **size)
    model = GPT2LMHeadModel(config)
    # Its class name names no known loss, so transformers logs a warning on every call (a
    # graph break under Dynamo); name the loss it would fall back to anyway.
    model.loss_type = "ForCausalLM"
    batch, length = (2, 16) if quick else (8, 512)
    return _token_case(model, config.vocab_size, batch, length, mode)


def build_bert(mode: str, quick: bool) -> Case:
    from transformers import BertConfig, BertForMaskedLM

    size = (
        dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
             vocab_size=128, max_position_embeddings=32)
        if quick
        else {}
    )
    config = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **size)
    batch, length = (2, 16) if quick else (16, 512)
    return _token_case(BertForMaskedLM(config), config.vocab_size, batch, length, mode)


class ClassifierLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.model(images)
        return logits if labels is None else F.cross_entropy(logits, labels)


def build_timm_resnet50(mode: str, quick: bool) -> Case:
    import timm

    model = timm.create_model("resnet50", pretrained=False, num_classes=1000)
    batch, size = (2, 32) if quick else (128 if mode == "infer" else 64, 224)
    images = torch.randn(batch, 3, size, size)
    if mode == "infer":
        return Case(ClassifierLoss(model), (images,))
    return Case(ClassifierLoss(model), (images, torch.randint(0, 1000, (batch,))))


HF_WORKLOADS = [
    Workload("hf_gpt2", "hf", build_gpt2, "GPT2LMHeadModel (124M config), 8x512 tokens", ("transformers",)),
    Workload("hf_bert", "hf", build_bert, "BertForMaskedLM (base config), 16x512 tokens", ("transformers",)),
    Workload("timm_resnet50", "hf", build_timm_resnet50, "timm resnet50, 224x224 images: 64 in training, 128 in inference", ("timm",)),
]
