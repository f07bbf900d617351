"""Tiny random models of the supported base families for fast tests."""

from __future__ import annotations

import torch


def tiny_llama(
    model_type: str = "llama",
    seed: int = 0,
    layers: int = 4,
    vocab: int = 128,
    dtype=torch.float32,
    **overrides,
):
    """A 4-layer model of ``model_type`` (any supported family; ``overrides``: further
    config fields) with head_dim 16 and GQA, its weights scaled away from ties (the
    per-head q/k norms of Qwen3 too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        head_dim=16,  # Qwen3's default is 128
    )
    kw.update(overrides)
    config = AutoConfig.for_model(model_type, **kw)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init is tiny; scale weights so that logits are far from ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return model.eval()
