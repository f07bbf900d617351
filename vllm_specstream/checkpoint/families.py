"""The base model families whose decoder layers the streams run through, and their checks.

One table for training (which HF modules a layer has, the LoRA targets), export (the
architecture a merged checkpoint records) and serving (the vLLM class built for it). A
family's layers differ from Llama's only in the steps the stream layer already abstracts
(docs/base-models.md): Qwen2 biases q/k/v, Qwen3 normalises queries and keys per head,
Phi-3 fuses ``qkv_proj`` and ``gate_up_proj``. Reads config values only (no torch, no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_specstream.checkpoint.config import ConfigError, config_value

#: PEFT LoRA targets of a layer with separate projections.
SPLIT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class BaseFamily:
    """One family of causal LMs the project trains and serves."""

    name: str
    """What the docs and messages call it."""
    model_types: tuple[str, ...]
    """``config.json: model_type`` values."""
    architectures: tuple[str, ...]
    """``config.json: architectures`` values (the vLLM class each maps to is
    :data:`vllm_specstream.model_executor.specstream.FAMILY_CLASSES`)."""
    lora_targets: tuple[str, ...] = SPLIT_TARGETS
    """PEFT LoRA targets of every projection of a layer (``--lora-targets``' default)."""


FAMILIES = (
    BaseFamily("Llama", ("llama",), ("LlamaForCausalLM",)),
    BaseFamily("Mistral", ("mistral",), ("MistralForCausalLM",)),
    BaseFamily("Qwen2", ("qwen2",), ("Qwen2ForCausalLM",)),
    BaseFamily("Qwen3", ("qwen3",), ("Qwen3ForCausalLM",)),
    BaseFamily(
        "Phi-3",
        ("phi3",),
        ("Phi3ForCausalLM",),
        lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    ),
)

#: ``config.json: architectures`` values a merged checkpoint may record as its base.
BASE_CLASSES = tuple(a for f in FAMILIES for a in f.architectures)

SUPPORTED = ", ".join(f"{f.name} ({', '.join(f.model_types)})" for f in FAMILIES)


def family_of(hf_config: Any, where: str = "base model") -> BaseFamily:
    """The family of the model of ``hf_config`` (a ``config.json`` dict or config object),
    after the checks of :func:`check_base_config`."""
    model_type = config_value(hf_config, "model_type")
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    if family is None:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; the streams run through "
            f"the layers of {SUPPORTED} bases"
        )
    check_base_config(hf_config, where)
    return family


def check_base_config(hf_config: Any, where: str = "base model") -> None:
    """Refuse the settings of a supported family that the stream layers do not compute as
    vLLM and Transformers do, naming the setting."""
    rope = config_value(hf_config, "rope_scaling") or config_value(hf_config, "rope_parameters")
    rope_type = (rope or {}).get("rope_type") or (rope or {}).get("type")
    if rope_type in ("longrope", "su"):  # "su": the name in early Phi-3 configs
        # Transformers switches between the short and long factors by the length of the
        # sequence, vLLM by the served max_model_len: the streams' rotary would depend on it.
        raise ConfigError(
            f"{where}: rope_scaling type 'longrope' (long-context RoPE, e.g. Phi-3-128k, "
            "Phi-4-mini) is not supported; use a base without it (e.g. Phi-3-mini-4k)"
        )
    layer_types = config_value(hf_config, "layer_types") or ()
    if config_value(hf_config, "use_sliding_window") or "sliding_attention" in layer_types:
        raise ConfigError(
            f"{where}: sliding-window attention layers (use_sliding_window / layer_types) are "
            "not supported: the streams attend over the whole context"
        )
