"""Early-exit pruning of draft trees inside the verification forward (paper 3.2.3).

At the pruning layer ``Lp`` the residual stream of every tree row is known. The pruning
adapter turns a node's *parent* row into next-token probabilities
(``lm_head(norm(h + Bp(Ap(h))))``, as in training); a node whose own token gets less than
the threshold leaves the tree with its subtree. The layers from ``Lp`` up then run on the
kept rows only: vLLM's attention metadata for those layers is rebuilt for the shorter
batch (:func:`pruned_metadata`, the one vLLM touch point here), the kept nodes keep their
cache slots, and the final hidden states are put back in the runner's row layout. Pruned
nodes can never be accepted (:meth:`StepTrees.kept` tells the sampler), so pruning never
changes outputs: it only trades the pruning head's cost for fewer rows in the top layers.

The forward here is the base decoder's own loop (embedding, layers, final norm), run in
Python: it needs the decoder to run eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch

from vllm_specstream.model_executor.trees.step import StepTrees

Tensor = torch.Tensor


def prune_head_probs(
    rows: Tensor, prune_a: Tensor, prune_b: Tensor, norm: Callable, logits: Callable
) -> Tensor:
    """Next-token probabilities of the pruning adapter at residual-stream ``rows`` ``[m, h]``
    (``norm``: the decoder's final norm; ``logits``: the LM head on rows)."""
    x = rows + (rows @ prune_a.t().to(rows.dtype)) @ prune_b.t().to(rows.dtype)
    return logits(norm(x)).float().softmax(dim=-1)


def node_keep_probs(
    stream: Tensor,
    input_ids: Tensor,
    query_start: Sequence[int],
    step: StepTrees,
    head: Callable[[Tensor], Tensor],
) -> dict[int, Tensor]:
    """Per tree row of ``step``: ``[n]`` probability of each node's token under ``head``
    (rows -> probabilities) applied at the node's parent, from the residual ``stream``
    ``[T, h]`` entering the pruning layer. One head call for every parent row of the step."""
    parent_rows: list[int] = []
    where: list[tuple[int, list[int], list[int]]] = []
    for t in step.rows:
        start = query_start[t.row]
        n = len(t.parents)
        parents = [start + (1 + p if p >= 0 else 0) for p in t.parents]
        nodes = list(range(start + 1, start + 1 + n))
        where.append((t.row, parents, nodes))
        parent_rows.extend(parents)
    unique = sorted(set(parent_rows))
    probs = head(stream[torch.tensor(unique, dtype=torch.long)])
    slot = {r: i for i, r in enumerate(unique)}
    out = {}
    for row, parents, nodes in where:
        tokens = input_ids[torch.tensor(nodes, dtype=torch.long)].long()
        rows = torch.tensor([slot[p] for p in parents], dtype=torch.long)
        out[row] = probs[rows, tokens]
    return out


@dataclasses.dataclass(frozen=True)
class PrunedBatch:
    """The rows that go on above the pruning layer, and the batch shape they make."""

    keep_rows: Tensor
    """``[T']`` long: flat rows kept, in order (every row that is not a pruned node)."""
    query_start_loc: list[int]
    """``[R + 1]``: each request's rows among the kept ones."""
    removed: list[int]
    """``[R]``: nodes pruned from each request."""
    kept: dict[int, tuple[int, ...]]
    """Tree row -> node indices kept (in template order)."""


def prune_batch(
    num_rows: int, query_start: Sequence[int], step: StepTrees, keep: dict[int, Tensor]
) -> PrunedBatch | None:
    """The kept rows for per-tree-row node masks ``keep`` (closed under parents); None when
    nothing is pruned."""
    drop: list[int] = []
    removed = [0] * (len(query_start) - 1)
    kept: dict[int, tuple[int, ...]] = {}
    for t in step.rows:
        mask = keep[t.row]
        start = query_start[t.row]
        nodes = tuple(i for i in range(len(t.parents)) if bool(mask[i]))
        kept[t.row] = nodes
        gone = [start + 1 + i for i in range(len(t.parents)) if not bool(mask[i])]
        drop.extend(gone)
        removed[t.row] = len(gone)
    if not drop:
        return None
    keep_mask = torch.ones(num_rows, dtype=torch.bool)
    keep_mask[torch.tensor(drop, dtype=torch.long)] = False
    qsl = [0]
    for r in range(len(removed)):
        qsl.append(qsl[-1] + (query_start[r + 1] - query_start[r]) - removed[r])
    return PrunedBatch(keep_mask.nonzero().flatten(), qsl, removed, kept)


def kept_slots(slot_mapping: Tensor, pruned: PrunedBatch) -> Tensor:
    """The cache slots of the kept rows (a slot mapping may be shorter than the padded batch)."""
    rows = pruned.keep_rows
    return slot_mapping[rows[rows < slot_mapping.shape[0]]]


def pruned_metadata(metadata, pruned: PrunedBatch, attn_layer, dtype: torch.dtype):
    """vLLM CPU attention metadata for the kept rows of ``pruned``: shorter queries and
    sequences for the pruned requests, the kept rows' own cache slots, and the kernel's
    work split computed again for that shape, as vLLM's metadata builder does (``dtype``:
    the model's)."""
    from vllm import _custom_ops as ops
    from vllm import envs

    num_reqs = len(pruned.removed)
    qsl = torch.tensor(pruned.query_start_loc, dtype=metadata.query_start_loc.dtype)
    removed = torch.tensor(pruned.removed, dtype=metadata.seq_lens.dtype)
    seq_lens = metadata.seq_lens[:num_reqs] - removed
    impl = attn_layer.impl
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs,
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=qsl,
        causal=metadata.causal,
        sliding_window_size=-1,
        isa=attn_layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    lengths = qsl[1:] - qsl[:-1]
    return dataclasses.replace(
        metadata,
        num_actual_tokens=metadata.num_actual_tokens - int(removed.sum()),
        max_query_len=int(lengths.max()),
        query_start_loc=qsl,
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens,
        slot_mapping=kept_slots(metadata.slot_mapping, pruned),
        scheduler_metadata=scheduler,
    )


@contextlib.contextmanager
def attention_for_kept_rows(layer_names: Sequence[str], metadata, pruned: PrunedBatch):
    """Within the block, attention layers ``layer_names`` of the running forward read
    ``metadata`` and write the cache at the kept rows' slots only; restored after."""
    from vllm.forward_context import get_forward_context

    ctx = get_forward_context()
    meta_dict = ctx.attn_metadata[0] if isinstance(ctx.attn_metadata, list) else ctx.attn_metadata
    slots = ctx.slot_mapping
    saved = [(name, meta_dict[name], slots.get(name)) for name in layer_names]
    try:
        for name, _, slot in saved:
            meta_dict[name] = metadata
            if slot is not None:
                slots[name] = kept_slots(slot, pruned)
        yield
    finally:
        for name, meta, slot in saved:
            meta_dict[name] = meta
            if slot is not None:
                slots[name] = slot


def kept_tree_step(step: StepTrees, pruned: PrunedBatch):
    """The attention override's trees for the layers that run on the kept rows: each
    request's kept subtree (requests that kept no node have no node rows there)."""
    from vllm_specstream.model_executor.trees.attention import TreeRequest, TreeStep
    from vllm_specstream.model_executor.trees.step import kept_subtree

    return TreeStep(
        tuple(
            TreeRequest(t.row, kept_subtree(t.parents, pruned.kept[t.row]))
            for t in step.rows
            if pruned.kept[t.row]
        )
    )


def scatter_rows(values: Tensor, keep_rows: Tensor, num_rows: int) -> Tensor:
    """``values`` ``[T', ...]`` of the kept rows back at their flat rows of ``num_rows``
    (pruned rows: zeros; nothing reads them)."""
    out = values.new_zeros((num_rows, *values.shape[1:]))
    out[keep_rows] = values
    return out


__all__ = [
    "PrunedBatch",
    "attention_for_kept_rows",
    "kept_slots",
    "kept_tree_step",
    "node_keep_probs",
    "prune_batch",
    "prune_head_probs",
    "pruned_metadata",
    "scatter_rows",
]
