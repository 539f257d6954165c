"""The ``families`` suite: one tiny model of each popular architecture family, built from its
config (random weights, no downloads), to check that aotforge trains and serves them as eager
does. Not a speed suite: its steps are tiny. Run it with

    python -m aotforge bench --suite families --backends eager,aotforge --repeat 1
    python -m aotforge bench --suite families --backends eager,aotforge --repeat 1 --dtype bf16 --autocast

(``benchmarks/gpu_models.sh`` runs both). Every dropout and stochastic-depth rate is zero, so
that a compiled step computes eager's function exactly; token models get an attention mask
with padding in one row, which sends SDPA to its masked (memory-efficient) kernels. The heads
are 16 wide, as small configs have: the case that once failed on the GPU.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from aotforge.bench.workload import Case, Workload

VOCAB, BATCH, LENGTH = 1000, 2, 32
# 2 layers of width 64, 4 heads of 16: the shape every transformer family below is given.
WIDTH, HEADS, LAYERS, FFN = 64, 4, 2, 128


class TokenModel(nn.Module):
    """``(input_ids, attention_mask, labels=None) -> loss or logits`` for a transformers model."""

    def __init__(self, model: nn.Module, output: str = "logits", mask: bool = True) -> None:
        super().__init__()
        self.model, self.output, self.mask = model, output, mask
        # An encoder-decoder needs decoder inputs where no labels give them.
        self.seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))

    def forward(self, input_ids, attention_mask, labels=None):
        options = {"attention_mask": attention_mask} if self.mask else {}
        if labels is not None:
            options["labels"] = labels
        elif self.seq2seq:
            options["decoder_input_ids"] = input_ids
        out = self.model(input_ids=input_ids, **options)
        if labels is not None and getattr(out, "loss", None) is not None:
            return out.loss
        return getattr(out, self.output)


class ImageModel(nn.Module):
    """``(images, labels=None) -> loss or logits``; a transformers model's ``logits`` too."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images, labels=None):
        out = self.model(images)
        logits = getattr(out, "logits", out)
        return logits if labels is None else F.cross_entropy(logits, labels)


class EncoderOutput(nn.Module):
    """A transformers encoder that takes features (Whisper's): its last hidden state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features):
        return self.model(features).last_hidden_state


def _tokens(mode: str, vocab: int = VOCAB) -> tuple:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (BATCH, LENGTH), generator=generator)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, LENGTH - 5:] = 0  # one padded row: the masked attention kernels
    if mode == "infer":
        return ids, mask
    return ids, mask, torch.randint(0, vocab, (BATCH, LENGTH), generator=generator)


def _hf(config_class: str, model_class: str, mode: str, quick: bool, output: str = "logits",
        mask: bool = True, checkpointing: bool = False, labels: bool = True, **config) -> Case:
    import transformers

    config = getattr(transformers, config_class)(**config)
    model = getattr(transformers, model_class)(config)
    if hasattr(model, "loss_type") and model_class.endswith("CausalLM"):
        # Its class name may name no known loss; transformers then warns on every call.
        model.loss_type = "ForCausalLM"
    if checkpointing:
        # newer transformers renamed it; the old name warns (FutureWarning) on every model built
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # A model without a loss (CLIP's text tower) is trained through its output.
    return Case(TokenModel(model, output, mask), _tokens(mode if labels else "infer"))


_DECODER = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=LENGTH * 2, use_cache=False,
                attention_dropout=0.0)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=LENGTH * 2,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_SEQ2SEQ_BART = dict(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
                     encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                     decoder_ffn_dim=FFN, max_position_embeddings=LENGTH * 2, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, use_cache=False)

# name -> (config class, model class, options)
_HF_FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=LENGTH * 2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)),
    "bert": ("BertConfig", "BertForMaskedLM", _ENCODER),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(_ENCODER, max_position_embeddings=LENGTH * 2 + 2)),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", dict(
        vocab_size=VOCAB, dim=WIDTH, hidden_dim=FFN, n_layers=LAYERS, n_heads=HEADS,
        max_position_embeddings=LENGTH * 2, dropout=0.0, attention_dropout=0.0)),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(_ENCODER, embedding_size=32)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=FFN, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0)),
    "bart": ("BartConfig", "BartForConditionalGeneration", _SEQ2SEQ_BART),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_DECODER, num_key_value_heads=2)),
    "llama_checkpointed": ("LlamaConfig", "LlamaForCausalLM", dict(_DECODER, num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_DECODER, num_key_value_heads=2, sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_DECODER, num_key_value_heads=2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        _DECODER, hidden_dropout=0.0, attention_dropout=0.0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=LENGTH * 2, word_embed_proj_dim=WIDTH, dropout=0.0, attention_dropout=0.0,
        use_cache=False)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=WIDTH, n_layer=LAYERS, n_head=HEADS, hidden_dropout=0.0,
        attention_dropout=0.0, use_cache=False)),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(
        _ENCODER, relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=LENGTH)),
    "clip_text": ("CLIPTextConfig", "CLIPTextModel", dict(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=LENGTH * 2, attention_dropout=0.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        _DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)),
}
_OUTPUT = {"clip_text": "pooler_output"}


def _build_hf(name: str, mode: str, quick: bool) -> Case:
    config_class, model_class, options = _HF_FAMILIES[name]
    return _hf(config_class, model_class, mode, quick, output=_OUTPUT.get(name, "logits"),
               checkpointing=name.endswith("_checkpointed"), labels=name not in _OUTPUT, **options)


def _build_vit_hf(mode: str, quick: bool) -> Case:
    import transformers

    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=WIDTH, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=10)
    return _image_case(transformers.ViTForImageClassification(config), mode, 32, classes=10)


def _build_whisper_encoder(mode: str, quick: bool) -> Case:
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN, max_source_positions=LENGTH, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    encoder = transformers.WhisperModel(config).get_encoder()
    features = torch.randn(BATCH, 16, LENGTH * 2, generator=torch.Generator().manual_seed(0))
    return Case(EncoderOutput(encoder), (features,))


def _image_case(model: nn.Module, mode: str, size: int, classes: int, channels: int = 3) -> Case:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH, channels, size, size, generator=generator)
    if mode == "infer":
        return Case(ImageModel(model), (images,))
    return Case(ImageModel(model), (images, torch.randint(0, classes, (BATCH,), generator=generator)))


def _build_torchvision(name: str, mode: str, quick: bool, size: int = 64, **options) -> Case:
    import torchvision

    return _image_case(getattr(torchvision.models, name)(num_classes=10, **options), mode, size, classes=10)


def _build_swin_t(mode: str, quick: bool) -> Case:
    # torchvision's swin_t() fixes stochastic depth at 0.2 (random in training): its layers here
    from torchvision.models.swin_transformer import SwinTransformer

    model = SwinTransformer(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                            window_size=[7, 7], stochastic_depth_prob=0.0, num_classes=10)
    return _image_case(model, mode, 64, classes=10)


def _build_timm(name: str, mode: str, quick: bool, size: int = 64, **options) -> Case:
    import timm

    return _image_case(timm.create_model(name, pretrained=False, num_classes=10, **options), mode, size, classes=10)


def _hf_workload(name: str) -> Workload:
    config_class, model_class, _ = _HF_FAMILIES[name]
    return Workload(f"fam_{name}", "families", functools.partial(_build_hf, name),
                    f"transformers {model_class}, tiny config", ("transformers",))


FAMILY_WORKLOADS = [
    *(_hf_workload(name) for name in _HF_FAMILIES),
    Workload("fam_vit", "families", _build_vit_hf, "transformers ViTForImageClassification, 32x32", ("transformers",)),
    Workload("fam_whisper_encoder", "families", _build_whisper_encoder, "transformers Whisper encoder", ("transformers",)),
    Workload("fam_resnet18", "families", functools.partial(_build_torchvision, "resnet18"),
             "torchvision resnet18, 64x64", ("torchvision",)),
    Workload("fam_mobilenet_v3", "families", functools.partial(_build_torchvision, "mobilenet_v3_small", dropout=0.0),
             "torchvision mobilenet_v3_small, 64x64", ("torchvision",)),
    Workload("fam_efficientnet_b0", "families",
             functools.partial(_build_torchvision, "efficientnet_b0", dropout=0.0, stochastic_depth_prob=0.0),
             "torchvision efficientnet_b0, 64x64", ("torchvision",)),
    Workload("fam_densenet121", "families", functools.partial(_build_torchvision, "densenet121"),
             "torchvision densenet121, 64x64", ("torchvision",)),
    Workload("fam_swin_t", "families", _build_swin_t, "torchvision swin_t's layers, 64x64", ("torchvision",)),
    Workload("fam_timm_vit_tiny", "families",
             functools.partial(_build_timm, "vit_tiny_patch16_224", size=224),
             "timm vit_tiny_patch16_224", ("timm",)),
    Workload("fam_timm_convnext_atto", "families", functools.partial(_build_timm, "convnext_atto"),
             "timm convnext_atto, 64x64", ("timm",)),
]
