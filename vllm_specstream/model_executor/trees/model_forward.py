"""The model's part in verifying draft trees: rotary positions by depth, the decoder's forward
with the trees pruned at the pruning layer (:mod:`.pruning`), and the accepted path's
keys/values moved where vLLM keeps them."""

from __future__ import annotations

import contextlib

import torch

from vllm_specstream.model_executor.forward_batch import (
    ForwardBatch,
    attention_layer_name,
    attn_metadata_of,
)
from vllm_specstream.model_executor.paged_kv import PagedKVLayout, layer_kv_cache
from vllm_specstream.model_executor.trees.pruning import (
    attention_for_kept_rows,
    kept_tree_step,
    node_keep_probs,
    prune_batch,
    prune_head_probs,
    pruned_metadata,
    scatter_rows,
)
from vllm_specstream.model_executor.trees.step import WORKER_TREES, depth_positions
from vllm_specstream.streams.draft_trees import prune_nodes


def tree_positions(positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Rotary positions by depth for this step's tree rows (``root + depth``: siblings share
    one), also in ``batch``; the runner's own tensor is left alone (vLLM's attention
    metadata aliases it)."""
    step = WORKER_TREES.step
    if step is None or not step.rows:
        return positions
    positions = depth_positions(positions, batch.query_start_loc.tolist(), step)
    batch.positions = positions[: batch.positions.shape[0]].clone()
    return positions


def prunes(streams, batch: ForwardBatch | None, input_ids, inputs_embeds) -> bool:
    """Whether this forward prunes its trees at the pruning layer (``streams``: the model's
    :class:`~vllm_specstream.model_executor.stream_pass.StreamPass`)."""
    step = WORKER_TREES.step
    return (
        streams.prune_threshold > 0
        and streams.prune_trees
        and batch is not None
        and step is not None
        and bool(step.rows)
        and input_ids is not None
        and inputs_embeds is None
    )


def decode_with_pruning(model, input_ids, positions, batch: ForwardBatch):
    """The decoder's forward (as vLLM's ``LlamaModel.forward`` on one rank) with the step's
    trees pruned at the pruning layer: the layers from there run on the kept rows only.
    Returns ``(hidden, [residual stream entering L0])`` in the runner's row layout, like the
    decoder with its aux-hidden-state hook."""
    from vllm_specstream.model_executor.trees.attention import current_tree_step, set_tree_step

    decoder, step = model.model, WORKER_TREES.step
    query_start = batch.query_start_loc.tolist()
    hidden = decoder.embed_input_ids(input_ids)
    residual = None
    num_rows = hidden.shape[0]
    msa_input = pruned = None
    with contextlib.ExitStack() as stack:
        stack.callback(set_tree_step, current_tree_step())  # the full trees, after
        for idx, layer in enumerate(decoder.layers):
            if idx == model.prune_layer:
                stream = hidden if residual is None else hidden + residual
                pruned = _prune(model, stream, input_ids, query_start, step, num_rows)
                if pruned is not None:
                    keep = pruned.keep_rows
                    hidden, positions = hidden[keep], positions[keep]
                    residual = None if residual is None else residual[keep]
                    attn = decoder.layers[idx].self_attn.attn
                    names = [
                        attention_layer_name(model.layer_prefix, i)
                        for i in range(idx, len(decoder.layers))
                    ]
                    metadata = pruned_metadata(
                        attn_metadata_of(names[0]), pruned, attn, model.model_dtype
                    )
                    stack.enter_context(attention_for_kept_rows(names, metadata, pruned))
                    set_tree_step(kept_tree_step(step, pruned))
            if idx == model.first_msa_layer:
                msa_input = hidden if residual is None else hidden + residual
                if pruned is not None:
                    msa_input = scatter_rows(msa_input, pruned.keep_rows, num_rows)
            hidden, residual = layer(positions, hidden, residual)
    hidden, _ = decoder.norm(hidden, residual)
    if pruned is not None:
        hidden = scatter_rows(hidden, pruned.keep_rows, num_rows)
    return hidden, [msa_input]


def _prune(model, stream, input_ids, query_start, step, num_rows):
    """The kept rows of this step's trees (None: nothing pruned); records what was kept for
    the sampler."""
    streams = model.streams
    streams.runner()  # the LM head for rows of its own (prepacked where it is)
    spec, norm = model.specstream, model.model.norm

    def head(rows):
        return prune_head_probs(rows, spec.prune_a, spec.prune_b, norm, streams.head.logits)

    probs = node_keep_probs(stream, input_ids, query_start, step, head)
    parents = {t.row: t.parents for t in step.rows}
    threshold = streams.prune_threshold
    keep = {row: prune_nodes(parents[row], p, threshold) for row, p in probs.items()}
    pruned = prune_batch(num_rows, query_start, step, keep)
    removed = 0 if pruned is None else sum(pruned.removed)
    WORKER_TREES.count_pruned(sum(len(p) for p in parents.values()), removed)
    if pruned is not None:
        step.kept.update(pruned.kept)
    return pruned


def move_kv(model, moves: dict[int, list[tuple[int, int]]]) -> None:
    """Copy, in every layer's cache, the keys/values of request row ``r`` from position
    ``src`` to ``dst`` for each ``(src, dst)`` of ``moves[r]`` (tree verification: the
    accepted path into the slots vLLM keeps). All sources are read before any write."""
    stash = model.streams.stash
    if stash is None:
        raise RuntimeError("specstream tree verification: no forward batch to move KV in")
    rows = [r for r, pairs in moves.items() for _ in pairs]
    pos = torch.tensor([p for pairs in moves.values() for p in pairs], dtype=torch.long)
    layers = [layer for layer in model.model.layers if hasattr(layer, "self_attn")]
    first = layer_kv_cache(layers[0])
    layout = PagedKVLayout.of_cache(first, layers[0].self_attn.attn.isa)
    table = stash.batch.block_table[torch.tensor(rows)]
    (k_src, v_src), (k_dst, v_dst) = (
        layout.position_indices(first.shape[1], table, pos[:, col : col + 1])
        for col in (0, 1)  # src, dst
    )
    for layer in layers:
        flat = layer_kv_cache(layer).view(-1)
        flat[k_dst], flat[v_dst] = flat[k_src], flat[v_src]
