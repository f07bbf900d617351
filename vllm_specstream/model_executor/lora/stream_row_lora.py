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
from vllm_specstream.model_executor.stream_weights import (
    LayerMatmuls,
    Matmul,
    StreamWeights,
    layer_linears,
)
from vllm_specstream.streams.stream_layer import PROJECTIONS

Tensor = torch.Tensor

assert PROJECTIONS == STREAM_LORA_STAGES  # the serving stages are the checkpoint's stages


def qkv_rows(
    rank: int,
    heads: int,
    kv_heads: int,
    head_size: int,
    total_heads: int,
    total_kv_heads: int,
    kv_replicas: int,
) -> Tensor:
    """Rows of a merged q/k/v output that tensor-parallel ``rank`` computes: its ``heads``
    query heads and its ``kv_heads`` key and value heads (shared by ``kv_replicas`` ranks
    where there are fewer KV heads than ranks), as vLLM's ``QKVParallelLinear`` shards them."""
    kv_rank = rank // kv_replicas
    q = torch.arange(rank * heads * head_size, (rank + 1) * heads * head_size)
    kv = torch.arange(kv_rank * kv_heads * head_size, (kv_rank + 1) * kv_heads * head_size)
    k_start = total_heads * head_size
    v_start = k_start + total_kv_heads * head_size
    return torch.cat((q, k_start + kv, v_start + kv))


def merged_rows(rank: int, output_sizes: list[int], tp_size: int) -> Tensor:
    """Rows of a merged column-parallel output (gate/up) that ``rank`` computes."""
    parts, start = [], 0
    for size in output_sizes:
        local = size // tp_size
        parts.append(start + torch.arange(rank * local, (rank + 1) * local))
        start += size
    return torch.cat(parts)


def rank_shard(module: nn.Module) -> tuple[Tensor | None, Tensor | None]:
    """``(rows of B, columns of A)`` of a projection's delta on this tensor-parallel rank
    (None: all): a column-parallel layer computes some output rows, a row-parallel one
    reads some input columns (its input is this rank's shard, its output a sum over ranks)."""
    tp, rank = getattr(module, "tp_size", 1), getattr(module, "tp_rank", 0)
    if tp == 1:
        return None, None
    if hasattr(module, "input_is_parallel"):  # RowParallelLinear
        width = module.input_size_per_partition
        return None, torch.arange(rank * width, (rank + 1) * width)
    if hasattr(module, "total_num_kv_heads"):  # QKVParallelLinear
        rows = qkv_rows(
            rank,
            module.num_heads,
            module.num_kv_heads,
            module.head_size,
            module.total_num_heads,
            module.total_num_kv_heads,
            module.num_kv_head_replicas,
        )
        return rows, None
    return merged_rows(rank, list(module.output_sizes), tp), None


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
        #: Under tensor parallelism, per layer and projection: this rank's ``(A, B)`` and
        #: whether its ``A x`` is summed over ranks (:meth:`for_ranks`; None: one rank).
        self._ranked: list[dict[str, tuple[Tensor, Tensor, bool]]] | None = None
        self._one_rank = False

    def for_ranks(self, layers: list[nn.Module]) -> StreamLoRAWeights:
        """Split the delta as vLLM shards the MSA ``layers``' projections over
        tensor-parallel ranks: rows of ``B`` where the output is sharded, columns of ``A``
        where the input is (there ``A x`` is summed over ranks: :meth:`delta`)."""
        if self._ranked is not None or self._one_rank:
            return self
        if all(
            getattr(getattr(m, "base_layer", m), "tp_size", 1) == 1
            for layer in layers
            for m in layer_linears(layer)
        ):
            self._one_rank = True  # asked again at every pass of an adapter's requests
            return self
        self._ranked = []
        for i, layer in enumerate(layers):
            per_stage = {}
            for stage, module in zip(STREAM_LORA_STAGES, layer_linears(layer), strict=True):
                a, b = self.layers[i][stage]
                rows, cols = rank_shard(getattr(module, "base_layer", module))
                per_stage[stage] = (
                    a if cols is None else a[:, cols].contiguous(),
                    b if rows is None else b[rows].contiguous(),
                    cols is not None,
                )
            self._ranked.append(per_stage)
        return self

    @classmethod
    def of(cls, params: nn.Module, config: SpecStreamConfig) -> StreamLoRAWeights | None:
        """The served checkpoint's stream LoRA (its ``params``), or None when it has none."""
        if config.stream_lora_rank == 0 or getattr(params, "stream_embeddings", None) is None:
            return None
        return cls(lambda name: getattr(params, name), config)

    def delta(self, index: int, stage: str, x: Tensor) -> Tensor:
        """``B(A(x))`` of ``stage`` in MSA layer ``index`` for the stream rows ``x``; under
        tensor parallelism this rank's part of the projection's output (``x``: its input
        shard)."""
        if self._ranked is None:
            a, b = self.layers[index][stage]
            return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))
        a, b, summed = self._ranked[index][stage]
        h = F.linear(x, a.to(x.dtype))
        if summed:  # a row-parallel projection: its output is summed over ranks already
            from vllm.distributed import tensor_model_parallel_all_reduce

            h = tensor_model_parallel_all_reduce(h)
        return F.linear(h, b.to(x.dtype))

    def dense(self, index: int, stage: str) -> Tensor:
        """``B @ A`` of ``stage`` in MSA layer ``index`` (``[out, in]``, fp32): the delta as
        a weight, merged into the stream pass's bf16 copies (one rank only)."""
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
        return StreamWeights(layers, weights.lm_head, dtype=weights.dtype)
