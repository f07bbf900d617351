"""What the stream computation needs from vLLM's forward context (the one touch point).

vLLM 0.32 passes per-layer attention metadata through ``get_forward_context()``; on CPU it
is a ``CPUAttentionMetadata`` with ``query_start_loc``, ``seq_lens`` and ``block_table``.
This module reads those into a plain :class:`ForwardBatch`, so that the rest of the plugin
never touches vLLM's context objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class ForwardBatch:
    """The requests of one model forward, as the stream computation sees them."""

    query_start_loc: Tensor
    """``[R + 1]`` int: request ``r``'s scheduled tokens are ``query_start_loc[r]:[r+1]``."""
    seq_lens: Tensor
    """``[R]`` int: tokens in the KV cache for request ``r`` after this step's writes."""
    block_table: Tensor
    """``[R, max_blocks]`` int: the cache blocks of request ``r``."""
    positions: Tensor
    """``[num_tokens]`` int: position of each scheduled token."""

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


def current_forward_batch(layer_name: str, positions: Tensor) -> ForwardBatch | None:
    """The batch of the running forward, from the metadata of attention layer ``layer_name``;
    None outside a real step (profiling and warm-up runs have no metadata)."""
    from vllm.forward_context import is_forward_context_available

    if not is_forward_context_available():
        return None
    m = attn_metadata_of(layer_name)
    if m is None:
        return None
    num_reqs = m.seq_lens.shape[0]
    return ForwardBatch(
        query_start_loc=m.query_start_loc[: num_reqs + 1].to(torch.long, copy=True),
        seq_lens=m.seq_lens[:num_reqs].to(torch.long, copy=True),
        block_table=m.block_table[:num_reqs],
        positions=positions[: m.num_actual_tokens].clone(),
    )


def attn_metadata_of(layer_name: str):
    """vLLM's attention metadata of layer ``layer_name`` in the running forward (None: the
    forward has none for it, e.g. a warm-up run)."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # one dict per micro-batch (ubatching); not used on CPU
        metadata = metadata[0] if metadata else None
    return metadata.get(layer_name) if isinstance(metadata, dict) else None


def no_forward_batch_reason(layer_name: str) -> str:
    """Why :func:`current_forward_batch` found no batch for attention layer ``layer_name``
    (for the proposer's warning when drafts stop: a renamed layer shows up here)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return "vLLM set no forward context"
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if metadata is None:
        return "vLLM passed no attention metadata"
    if not isinstance(metadata, dict):
        return f"vLLM's attention metadata is a {type(metadata).__name__}, not a dict by layer"
    names = sorted(metadata)
    if layer_name in metadata:
        return f"vLLM's attention metadata for it is {metadata[layer_name]!r}"
    return f"vLLM's attention metadata has no such layer (it has {len(names)}, e.g. {names[:2]})"


def attention_layer_name(prefix: str, layer_index: int) -> str:
    """vLLM's name of the attention module of decoder layer ``layer_index``."""
    return f"{prefix}layers.{layer_index}.self_attn.attn"
