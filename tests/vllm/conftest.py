"""Tiny merged specstream checkpoints for engine tests (random weights, real tokenizer)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def make_tiny_base(
    base_model_dir: Path,
    out: Path,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    model_type: str = "llama",
    **overrides,
) -> Path:
    """A 4-layer base of ``model_type`` (any supported family; ``overrides``: further config
    fields) with head_dim 32 and GQA, random weights away from ties and SmolLM2's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        model_type,
        hidden_size=32 * heads,
        intermediate_size=64 * heads,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=32,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **overrides,
    )
    lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):  # qwen2 has biased q/k/v
                p.normal_(0, 0.15)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # qwen3's per-head norms
                p.uniform_(0.5, 1.5)
    lm.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(base_model_dir / name, out / name)
    return out


def make_tiny_merged(
    base_model_dir: Path,
    out: Path,
    num_streams: int = 3,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    model_type: str = "llama",
    draft_vocab_size: int = 0,
) -> Path:
    """:func:`make_tiny_base` (in ``OUT-base``) with random LoRA and streams (and a draft
    vocabulary of ``draft_vocab_size`` random tokens), exported as `specstream export`
    does it."""
    import torch

    from vllm_specstream.checkpoint.config import SpecStreamConfig
    from vllm_specstream.training.checkpoint import (
        LoraSettings,
        build_model,
        export_merged,
        save_adapter,
    )

    base = make_tiny_base(
        base_model_dir, out.with_name(out.name + "-base"), seed, heads, kv_heads, model_type
    )
    model = build_model(
        base,
        SpecStreamConfig(num_streams=num_streams, num_msa_layers=2),
        LoraSettings(rank=4),
        stream_init_std=1.0,
    )
    adapter = save_adapter(model, out.with_name(out.name + "-adapter"))
    if draft_vocab_size:
        from vllm_specstream.training.draft_vocab import write_draft_vocab

        ids = torch.randperm(model.lm.config.vocab_size)[:draft_vocab_size].tolist()
        write_draft_vocab(adapter, ids, model.lm.config.vocab_size)
    return export_merged(adapter, out, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_merged(base_model_dir, tmp_path_factory) -> Path:
    return make_tiny_merged(base_model_dir, tmp_path_factory.mktemp("ckpt") / "tiny-merged")


@pytest.fixture(scope="session")
def tiny_merged_draft_vocab(base_model_dir, tmp_path_factory) -> Path:
    """``tiny_merged``'s settings with a draft vocabulary of a third of the tokens."""
    return make_tiny_merged(
        base_model_dir, tmp_path_factory.mktemp("ckpt") / "tiny-vocab", draft_vocab_size=16384
    )


@pytest.fixture(scope="session")
def tiny_merged_tp3(base_model_dir, tmp_path_factory) -> Path:
    """Six query heads and three key/value heads: shardable over 3 tensor-parallel ranks."""
    return make_tiny_merged(
        base_model_dir, tmp_path_factory.mktemp("ckpt") / "tiny-tp3", heads=6, kv_heads=3
    )


@pytest.fixture(scope="session")
def tiny_merged_qwen2(base_model_dir, tmp_path_factory) -> Path:
    return make_tiny_merged(
        base_model_dir, tmp_path_factory.mktemp("ckpt") / "tiny-qwen2", model_type="qwen2"
    )


def make_tiny_adapter(base: Path, out: Path, seed: int, num_streams: int = 3) -> tuple[Path, Path]:
    """A specstream adapter of the tiny ``base`` with random LoRA (A and B) and streams,
    saved as ``specstream train`` writes it, and its merged checkpoint: ``(adapter, merged)``."""
    import torch

    from vllm_specstream.checkpoint.config import SpecStreamConfig
    from vllm_specstream.training.checkpoint import (
        LoraSettings,
        build_model,
        export_merged,
        save_adapter,
    )

    torch.manual_seed(seed)
    model = build_model(
        base,
        SpecStreamConfig(num_streams=num_streams, num_msa_layers=2),
        LoraSettings(rank=4),
        stream_init_std=1.0,
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: the adapter would change nothing
                p.normal_(0, 0.2)
    adapter = save_adapter(model, out.with_name(out.name + "-adapter"))
    return adapter, export_merged(adapter, out, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_merged, tmp_path_factory) -> tuple[Path, list[tuple[Path, Path]]]:
    """The tiny base and two specstream adapters of it: ``(base, [(adapter, merged), ...])``."""
    base = tiny_merged.with_name(tiny_merged.name + "-base")
    root = tmp_path_factory.mktemp("adapters")
    return base, [make_tiny_adapter(base, root / f"task{i}", seed=10 + i) for i in range(2)]


@pytest.fixture(scope="session")
def tiny_streams_only(tiny_merged, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny base and a merged streams-only checkpoint of it (random stream embeddings
    and stream LoRA, base weights untouched): ``(base, merged)``."""
    import torch

    from vllm_specstream.checkpoint.config import SpecStreamConfig
    from vllm_specstream.training.checkpoint import build_model, export_merged, save_adapter

    base = tiny_merged.with_name(tiny_merged.name + "-base")
    out = tmp_path_factory.mktemp("streams-only") / "merged"
    torch.manual_seed(3)
    config = SpecStreamConfig(num_streams=3, num_msa_layers=2, stream_lora_rank=4)
    model = build_model(base, config, None, stream_init_std=1.0)
    with torch.no_grad():  # B starts at zero: the stream LoRA would change nothing
        for name, p in model.stream_parameters().items():
            if name.startswith("stream_lora_"):
                p.normal_(0, 0.2)
    adapter = save_adapter(model, out.with_name("adapter"))
    return base, export_merged(adapter, out, dtype=torch.float32)
