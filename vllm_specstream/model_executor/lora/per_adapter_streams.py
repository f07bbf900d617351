"""Each LoRA adapter's own streams under vLLM multi-LoRA serving.

A directory that ``specstream train`` writes is a PEFT adapter for vLLM (``adapter_config.json``,
``adapter_model.safetensors``) plus the adapter's stream tensors (``specstream.safetensors``)
and their config (``specstream_config.json``), which vLLM ignores. The patch
:mod:`vllm_specstream.patches.lora_adapter_streams` reads them when vLLM loads the adapter
(:func:`read_adapter_streams`) and keeps them on vLLM's adapter object, so they live and
leave with it in vLLM's LRU cache. Each step, a request's LoRA slot gives the adapter's id
(``lora_index_to_id``), the id its adapter object, and that its streams
(:func:`request_streams`). A request without an adapter, or with a plain LoRA adapter,
drafts with the served checkpoint's own streams if it has them, else not at all.

A streams-only adapter (``specstream train --objective streams-only``) is served the same
way: its PEFT files are a LoRA that changes nothing (``training.checkpoint.null_lora``), so
its requests' tokens are the base model's, and its stream LoRA (``stream_lora_*``) is added
to its own stream rows only (:class:`~vllm_specstream.model_executor.lora.vllm_lora_layers.StreamLoRA`).

A deployment fixes ``num_msa_layers`` (the decoder returns the residual stream entering that
layer for every request), so an adapter trained with another value is an error that names
it; ``num_streams``, ``init_rank`` and ``stream_position`` may differ between adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_specstream.checkpoint.config import (
    CONFIG_FILE,
    STREAM_FILE,
    ConfigError,
    SpecStreamConfig,
    check_stream_tensors,
)
from vllm_specstream.logger import init_logger
from vllm_specstream.model_executor.lora.stream_row_lora import StreamLoRAWeights

logger = init_logger(__name__)

Tensor = torch.Tensor

#: Attribute of vLLM's ``LoRAModel`` that carries the adapter's :class:`AdapterStreams`
#: (None: a LoRA adapter without streams).
ATTRIBUTE = "specstream_streams"


@dataclass(frozen=True)
class AdapterStreams:
    """One adapter's stream tensors (the ``specstream.*`` tensors of a merged checkpoint)."""

    name: str
    """The adapter's name in vLLM (``LoRARequest.lora_name``), for messages."""
    config: SpecStreamConfig
    stream_embeddings: Tensor
    """``[num_streams, hidden]``."""
    init_a: Tensor | None = None
    init_b: Tensor | None = None
    stream_lora: StreamLoRAWeights | None = None
    """A streams-only adapter's LoRA on the stream rows (its main rows are the base's)."""


@dataclass(frozen=True)
class Deployment:
    """What every adapter's streams must fit: the served model's stream geometry."""

    num_msa_layers: int
    hidden_size: int
    num_hidden_layers: int
    num_speculative_tokens: int
    """Drafts per request at most: every adapter needs that many streams."""
    hf_config: Any = None
    """The served model's config (the projections' shapes of a stream LoRA)."""
    tp_size: int = 1
    """Tensor-parallel ranks (a stream LoRA is not sharded)."""


def read_adapter_streams(
    path: str | Path, name: str, deployment: Deployment, dtype: torch.dtype = torch.float32
) -> AdapterStreams | None:
    """The streams in adapter directory ``path`` (vLLM name ``name``), checked against
    ``deployment``; None for a plain LoRA adapter (no ``specstream.safetensors``)."""
    from vllm_specstream.checkpoint.tensor_files import read_tensors

    path = Path(path)
    if not (path / STREAM_FILE).is_file():
        return None
    where = f"LoRA adapter {name!r} ({path})"
    try:
        config = SpecStreamConfig.load(path)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e
    config.validate(deployment.num_hidden_layers, where=f"{where}: {CONFIG_FILE}")
    if config.num_msa_layers != deployment.num_msa_layers:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has num_msa_layers={config.num_msa_layers}, but this "
            f"deployment runs the streams over the last {deployment.num_msa_layers} layers "
            "(config.json: specstream.num_msa_layers); serve adapters trained with the same "
            "num_msa_layers together"
        )
    if config.num_streams < deployment.num_speculative_tokens:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has num_streams={config.num_streams}, fewer than the "
            f"deployment's num_speculative_tokens={deployment.num_speculative_tokens}; serve "
            f"these adapters with at most {config.num_streams} speculative tokens"
        )
    tensors = read_tensors(path / STREAM_FILE)
    check_stream_tensors(
        tensors, config, deployment.hidden_size, f"{where}: {STREAM_FILE}", deployment.hf_config
    )
    if config.draft_vocab_size:
        logger.warning(
            "%s: its draft vocabulary (%d tokens) is not used for a LoRA adapter's streams; "
            "they draft from the whole vocabulary (serve it merged to use it)",
            where,
            config.draft_vocab_size,
        )
    get = lambda key: tensors[key].to(dtype) if key in tensors else None  # noqa: E731
    stream_lora = StreamLoRAWeights(get, config) if config.stream_lora_rank > 0 else None
    return AdapterStreams(
        name, config, get("stream_embeddings"), get("init_a"), get("init_b"), stream_lora
    )


def slot_adapter_ids(lora_manager) -> list[int | None]:
    """vLLM's adapter id in each LoRA slot (None: free), read every step: slots churn."""
    return list(lora_manager.lora_index_to_id)


def registered_adapter(lora_manager, adapter_id: int):
    """vLLM's loaded adapter object of ``adapter_id`` (None if it is not registered),
    without touching its place in the LRU order."""
    return lora_manager._registered_adapters.cache.get(adapter_id)


def request_streams(
    lora_manager, slots: list[int], own: AdapterStreams | None
) -> list[AdapterStreams | None]:
    """Each request's streams from its LoRA slot: its adapter's; ``own`` (the served
    checkpoint's streams, or None on a base served for adapters) for a request without an
    adapter (slot -1) or with a plain LoRA adapter."""
    ids = slot_adapter_ids(lora_manager)
    out: list[AdapterStreams | None] = []
    for slot in slots:
        if slot < 0:
            out.append(own)
            continue
        adapter_id = ids[slot] if slot < len(ids) else None
        adapter = registered_adapter(lora_manager, adapter_id) if adapter_id is not None else None
        if adapter is None:
            out.append(None)  # a slot vLLM has not filled: nothing to draft with
        else:  # a plain LoRA adapter drafts with the checkpoint's streams, if it has any
            out.append(getattr(adapter, ATTRIBUTE, None) or own)
    return out


def group_requests(streams: list[AdapterStreams | None]) -> list[tuple[AdapterStreams, list[int]]]:
    """The requests of each distinct streams object, in first-seen order (None left out)."""
    groups: dict[int, tuple[AdapterStreams, list[int]]] = {}
    for i, s in enumerate(streams):
        if s is not None:
            groups.setdefault(id(s), (s, []))[1].append(i)
    return list(groups.values())
