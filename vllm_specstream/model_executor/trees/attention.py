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

from vllm_specstream.model_executor.paged_kv import PagedKVLayout
from vllm_specstream.streams.draft_trees import tree_attention_mask

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


def masked_rows_attention(
    query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float
) -> Tensor:
    """``query`` ``[R, N, Hq, D]`` over ``keys``/``values`` ``[R, L, Hkv, D]`` where ``mask``
    ``[R, N, L]`` allows; ``[R, N, Hq, D]`` in float32. Query head ``h`` uses key/value head
    ``h // (Hq // Hkv)`` (no copies of the key/value heads)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(1, 2),
        keys.float().transpose(1, 2),
        values.float().transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


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
    dtype, computed in float32. The one-request form of what :func:`redo_tree_rows`
    computes for a whole step."""
    n = query.shape[0]
    if len(parents) != n or key_step.shape[0] != n + 1:
        raise ValueError(
            f"need n parents and n + 1 step keys for n = {n} node rows, got "
            f"{len(parents)} parents and {key_step.shape[0]} step keys"
        )
    c = key_prefix.shape[0]
    mask = torch.ones(n, c + 1 + n, dtype=torch.bool, device=query.device)
    mask[:, c + 1 :] = tree_attention_mask(tuple(parents), device=query.device)
    keys = torch.cat((key_prefix.float(), key_step.float()))
    values = torch.cat((value_prefix.float(), value_step.float()))
    out = masked_rows_attention(query[None], keys[None], values[None], mask[None], scale)
    return out[0].to(query.dtype)


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


@dataclass(frozen=True)
class _RedoPlan:
    """Where one forward's node rows and their keys/values are, padded to one batch:
    ``R`` tree requests, up to ``N`` nodes and ``C`` cached tokens each."""

    node_rows: Tensor
    """``[R, N]`` flat rows of the nodes (padding: the request's root row)."""
    valid: Tensor
    """``[R, N]`` bool: a real node."""
    step_rows: Tensor
    """``[R, 1 + N]`` flat rows of the root and nodes (padding: the root row)."""
    prefix_k: Tensor
    prefix_v: Tensor
    """``[R, C, Hkv, D]`` flat cache indices of each request's cached tokens (padding: its
    first token, masked)."""
    step_k: Tensor | None
    step_v: Tensor | None
    """``[R, 1 + N, Hkv, D]`` cache indices of the root and nodes, for layers that get no
    keys/values of their own (they share another layer's cache); else None."""
    mask: Tensor
    """``[R, N, C + 1 + N]`` bool: prefix, root, ancestors-or-self."""


#: The plan of the current forward's layers (one cache shape and layout for all of them).
_plans: dict[tuple, _RedoPlan | None] = {}


def _redo_plan(
    step: TreeStep, metadata, layout: PagedKVLayout, shape, from_cache: bool
) -> _RedoPlan | None:
    qsl = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    key = (id(step), tuple(qsl), tuple(seq_lens), tuple(shape), from_cache)
    if key in _plans:
        return _plans[key]
    if len(_plans) > 8:  # a new step: the old plans go
        _plans.clear()
    trees = []
    for tree in step.requests:
        r = tree.req_index
        start, end = qsl[r], qsl[r + 1]
        n = min(len(tree.parents), end - start - 1)  # the scheduler may cut the drafts
        if n > 0:
            trees.append((r, start, n, seq_lens[r] - (end - start), tree.parents[:n]))
    if not trees:
        _plans[key] = None
        return None
    big_n = max(t[2] for t in trees)
    big_c = max(t[3] for t in trees)
    num = len(trees)
    node_rows = torch.zeros(num, big_n, dtype=torch.long)
    valid = torch.zeros(num, big_n, dtype=torch.bool)
    step_rows = torch.zeros(num, 1 + big_n, dtype=torch.long)
    prefix_pos = torch.zeros(num, big_c, dtype=torch.long)
    step_pos = torch.zeros(num, 1 + big_n, dtype=torch.long)
    mask = torch.zeros(num, big_n, big_c + 1 + big_n, dtype=torch.bool)
    for i, (_, start, n, c, parents) in enumerate(trees):
        node_rows[i] = start
        node_rows[i, :n] = torch.arange(start + 1, start + 1 + n)
        valid[i, :n] = True
        step_rows[i] = start
        step_rows[i, : 1 + n] = torch.arange(start, start + 1 + n)
        prefix_pos[i, :c] = torch.arange(c)
        step_pos[i, : 1 + n] = torch.arange(c, c + 1 + n)
        mask[i, :, :c] = True
        mask[i, :, big_c] = True  # the root (padded query rows see only it)
        mask[i, :n, big_c + 1 : big_c + 1 + n] = tree_attention_mask(tuple(parents))
    table = metadata.block_table[torch.tensor([t[0] for t in trees])]
    h_kv = shape[1]
    prefix_k, prefix_v = (
        x.view(num, big_c, h_kv, -1) for x in layout.position_indices(h_kv, table, prefix_pos)
    )
    step_k = step_v = None
    if from_cache:
        step_k, step_v = (
            x.view(num, 1 + big_n, h_kv, -1) for x in layout.position_indices(h_kv, table, step_pos)
        )
    plan = _RedoPlan(node_rows, valid, step_rows, prefix_k, prefix_v, step_k, step_v, mask)
    _plans[key] = plan
    return plan


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
    ``step``'s requests; every other row keeps what is there. All the step's trees in one
    padded :func:`masked_rows_attention` call."""
    problem = tree_attention_problem(impl)
    if problem is not None:
        raise RuntimeError(f"specstream draft trees cannot run with {problem}")
    from_cache = key is None or value is None
    layout = PagedKVLayout.of_cache(kv_cache, layer.isa)
    plan = _redo_plan(step, metadata, layout, kv_cache.shape, from_cache)
    if plan is None:
        return
    out = output.view(output.shape[0], impl.num_heads, impl.head_size)
    k_prefix, v_prefix = torch.take(kv_cache, plan.prefix_k), torch.take(kv_cache, plan.prefix_v)
    if from_cache:
        k_step, v_step = torch.take(kv_cache, plan.step_k), torch.take(kv_cache, plan.step_v)
    else:
        k_step, v_step = key[plan.step_rows], value[plan.step_rows]
    attn = masked_rows_attention(
        query[plan.node_rows],  # [R, N, Hq, D]
        torch.cat((k_prefix.float(), k_step.float()), dim=1),  # [R, C + 1 + N, Hkv, D]
        torch.cat((v_prefix.float(), v_step.float()), dim=1),
        plan.mask,
        impl.scale,
    )
    out[plan.node_rows[plan.valid]] = attn[plan.valid].to(out.dtype)


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
