"""Tree attention on vLLM's CPU backend: a draft node sees the prefix, the root and its ancestors.

vLLM 0.32's CPU attention kernel masks by row index within a request (causal) and takes no
custom mask, so a draft node would also attend to the siblings listed before it. The backend
here is vLLM's own, registered in its place (``register_backend``; the name stays
``CPU_ATTN``). The stock ``forward`` runs first: the cache already holds this step's keys and
values (vLLM writes them before attention), and the root row, prefill, plain decode and chain
rows come out right. Then, for the requests of this step's :class:`TreeStep` only, the node
rows are computed again with an ancestor mask over the cached prefix, the root and the nodes.
The prefix is read back through the probed cache layout
(:mod:`~vllm_specstream.model_executor.paged_kv`), so every ISA's layout works; the kernel
returns no log-sum-exp, so the stock result cannot be merged with an in-step part instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from vllm_specstream.draft_trees import tree_attention_mask
from vllm_specstream.model_executor.paged_kv import PagedKVLayout

Tensor = torch.Tensor


@dataclass(frozen=True)
class TreeRequest:
    """One request's tree in this step."""

    req_index: int
    """The request's row in the batch (of ``query_start_loc``, ``seq_lens``, ``block_table``)."""
    parents: tuple[int, ...]
    """Parent of each scheduled node (-1: the root); parents precede children."""


@dataclass(frozen=True)
class TreeStep:
    """The trees of one forward step (requests without a tree are not listed)."""

    requests: tuple[TreeRequest, ...]


_step: TreeStep | None = None


def set_tree_step(step: TreeStep | None) -> None:
    """The trees every attention layer of the next forward applies (None: none)."""
    global _step
    _step = step


def current_tree_step() -> TreeStep | None:
    return _step


def tree_rows_attention(
    query: Tensor,
    key_prefix: Tensor,
    value_prefix: Tensor,
    key_step: Tensor,
    value_step: Tensor,
    parents: Sequence[int],
    scale: float,
) -> Tensor:
    """Attention of a request's ``n`` node rows (``query`` ``[n, Hq, D]``) over its cached
    prefix (``[c, Hkv, D]``), its root and its own ancestors-or-self (``key_step`` /
    ``value_step`` ``[n + 1, Hkv, D]``: root, then nodes); ``[n, Hq, D]`` in the query's
    dtype, computed in float32. Query head ``h`` uses key/value head ``h // (Hq // Hkv)``."""
    n, h_q, _ = query.shape
    if len(parents) != n or key_step.shape[0] != n + 1:
        raise ValueError(
            f"need n parents and n + 1 step keys for n = {n} node rows, got "
            f"{len(parents)} parents and {key_step.shape[0]} step keys"
        )
    c = key_prefix.shape[0]
    group = h_q // key_step.shape[1]
    k = torch.cat((key_prefix, key_step)).float().repeat_interleave(group, dim=1)
    v = torch.cat((value_prefix, value_step)).float().repeat_interleave(group, dim=1)
    mask = torch.ones(n, c + 1 + n, dtype=torch.bool, device=query.device)
    mask[:, c + 1 :] = tree_attention_mask(tuple(parents), device=query.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1).to(query.dtype)


def tree_attention_problem(impl) -> str | None:
    """Why tree rows cannot be recomputed for this attention ``impl`` (None: they can)."""
    window = getattr(impl, "sliding_window", None)
    checks = (
        (window not in (None, -1, (-1, -1)), "sliding-window attention"),
        (getattr(impl, "alibi_slopes", None) is not None, "ALiBi"),
        (bool(getattr(impl, "logits_soft_cap", None)), "logit soft-capping"),
        (getattr(impl, "sinks", None) is not None, "attention sinks"),
        (
            getattr(impl, "is_fp8_kv_cache", False)
            or str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8"),
            "an fp8 KV cache",
        ),
        (
            getattr(impl, "attn_type", AttentionType.DECODER)
            in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY),
            "encoder attention",
        ),
    )
    return next((why for bad, why in checks if bad), None)


#: The prefix indices of the current step, shared by every layer (one cache shape and layout).
_prefix_indices: dict[tuple, tuple[Tensor, Tensor]] = {}
_prefix_step: list[TreeStep | None] = [None]


def _prefix_index(
    step: TreeStep, layout: PagedKVLayout, block_table: Tensor, r: int, length: int, shape
) -> tuple[Tensor, Tensor]:
    """Flat cache indices of positions ``0..length-1`` of request ``r``, computed once per
    step: the first layer builds them, the others reuse them."""
    if _prefix_step[0] is not step:
        _prefix_indices.clear()
        _prefix_step[0] = step
    key = (r, length, tuple(shape))
    if key not in _prefix_indices:
        _prefix_indices[key] = layout.position_indices(
            shape[1], block_table[r], torch.arange(length)
        )
    return _prefix_indices[key]


def redo_tree_rows(
    impl: CPUAttentionBackendImpl,
    layer,
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    kv_cache: Tensor,
    metadata: CPUAttentionMetadata,
    output: Tensor,
    step: TreeStep,
) -> None:
    """Overwrite ``output`` (``[T, Hq, D]`` or ``[T, Hq * D]``) at the node rows of
    ``step``'s requests; every other row keeps what is there."""
    problem = tree_attention_problem(impl)
    if problem is not None:
        raise RuntimeError(f"specstream draft trees cannot run with {problem}")
    out = output.view(output.shape[0], impl.num_heads, impl.head_size)
    qsl = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    layout = PagedKVLayout.of_cache(kv_cache, layer.isa)
    for tree in step.requests:
        r = tree.req_index
        start, end = qsl[r], qsl[r + 1]
        n = min(len(tree.parents), end - start - 1)  # the scheduler may cut the drafts
        if n <= 0:
            continue
        c = seq_lens[r] - (end - start)  # tokens cached before this step
        # Layers sharing another layer's cache get no key/value: read the step from the cache.
        last = c if key is not None and value is not None else c + 1 + n
        k_idx, v_idx = _prefix_index(step, layout, metadata.block_table, r, last, kv_cache.shape)
        k_cached, v_cached = torch.take(kv_cache, k_idx), torch.take(kv_cache, v_idx)
        if last == c:
            k_step, v_step = key[start : start + 1 + n], value[start : start + 1 + n]
        else:
            k_step, v_step = k_cached[c:], v_cached[c:]
        rows = slice(start + 1, start + 1 + n)
        out[rows] = tree_rows_attention(
            query[rows],
            k_cached[:c].to(query.dtype),
            v_cached[:c].to(query.dtype),
            k_step.to(query.dtype),
            v_step.to(query.dtype),
            tree.parents[:n],
            impl.scale,
        )


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then the node rows of this step's trees redone."""

    def forward(
        self,
        layer,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: Tensor,
        output_scale: Tensor | None = None,
        output_block_scale: Tensor | None = None,
    ) -> Tensor:
        result = super().forward(
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            output_scale=output_scale,
            output_block_scale=output_block_scale,
        )
        step = _step
        if (
            step is not None
            and step.requests
            and attn_metadata is not None
            # cross-attention reads the encoder's keys, unmasked: the stock rows are right
            and self.attn_type != AttentionType.ENCODER_DECODER
        ):
            redo_tree_rows(self, layer, query, key, value, kv_cache, attn_metadata, output, step)
        return result


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend (same name, builder, cache layout), impl :class:`TreeCPUAttentionImpl`."""

    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl


def register_tree_attention() -> None:
    """Have vLLM build :class:`TreeCPUAttentionBackend` wherever it builds its CPU attention
    (idempotent; before the first model is built)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(
        AttentionBackendEnum.CPU_ATTN, f"{__name__}.{TreeCPUAttentionBackend.__qualname__}"
    )
