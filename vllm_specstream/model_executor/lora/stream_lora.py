"""The stream LoRA of a streams-only checkpoint: a delta on the stream rows only.

A streams-only adapter (``specstream train --objective streams-only``) leaves the base
model's weights to the main rows and gives the stream rows ``y + B(A(x))`` in each of the
four projections of each MSA layer (``config.stream_lora_rank``; tensors
``specstream.stream_lora_{layer}_{stage}_{a,b}`` in vLLM's merged layout, q/k/v and
gate/up concatenated). Training adds the same delta
(:class:`~vllm_specstream.training.model.StreamLoRAProjections`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm_specstream.checkpoint.config import STREAM_LORA_STAGES, SpecStreamConfig, stream_lora_name
from vllm_specstream.model_executor.stream_weights import LayerMatmuls, Matmul, StreamWeights
from vllm_specstream.streams.stream_layer import PROJECTIONS

Tensor = torch.Tensor

assert PROJECTIONS == STREAM_LORA_STAGES  # the serving stages are the checkpoint's stages


class StreamLoRAWeights:
    """Per MSA layer and projection, the ``(A, B)`` of the stream rows' delta."""

    def __init__(self, get: Callable[[str], Tensor], config: SpecStreamConfig):
        """``get``: the tensor of a ``stream_lora_*`` name (:func:`stream_lora_name`)."""
        self.layers = [
            {
                stage: (get(stream_lora_name(i, stage, "a")), get(stream_lora_name(i, stage, "b")))
                for stage in STREAM_LORA_STAGES
            }
            for i in range(config.num_msa_layers)
        ]

    @classmethod
    def of(cls, params: nn.Module, config: SpecStreamConfig) -> StreamLoRAWeights | None:
        """The served checkpoint's stream LoRA (its ``params``), or None when it has none."""
        if config.stream_lora_rank == 0 or getattr(params, "stream_embeddings", None) is None:
            return None
        return cls(lambda name: getattr(params, name), config)

    def delta(self, index: int, stage: str, x: Tensor) -> Tensor:
        """``B(A(x))`` of ``stage`` in MSA layer ``index`` for the stream rows ``x``."""
        a, b = self.layers[index][stage]
        return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))

    def dense(self, index: int, stage: str) -> Tensor:
        """``B @ A`` of ``stage`` in MSA layer ``index`` (``[out, in]``, fp32): the delta as
        a weight, merged into the stream pass's bf16 copies."""
        a, b = self.layers[index][stage]
        return b.float() @ a.float()

    def wrap(self, weights: StreamWeights) -> StreamWeights:
        """``weights`` (the second pass's matmuls) with the delta added to each projection,
        unless their copies hold it already."""
        if weights.stream_delta_merged:
            return weights

        def with_delta(base: Matmul, index: int, stage: str) -> Matmul:
            def run(x: Tensor) -> Tensor:
                return base(x) + self.delta(index, stage, x)

            return run

        layers = [
            LayerMatmuls(
                *(
                    with_delta(base, i, stage)
                    for base, stage in zip(mm.matmuls(), STREAM_LORA_STAGES)
                )
            )
            for i, mm in enumerate(weights.layers)
        ]
        return StreamWeights(layers, weights.lm_head)
