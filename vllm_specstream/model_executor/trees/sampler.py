"""Verification of tree drafts, in place of vLLM's chain rejection sampler.

vLLM's sampler reads a request's drafts as a chain: draft ``j`` is checked against the
target at row ``j``. For a tree the target at a node's *parent* row decides, and the
accepted nodes are a root-to-leaf path that need not be the first rows.
:class:`TreeRejectionSampler` runs vLLM's sampler for the whole batch (every request that
is not a tree, and the shapes vLLM expects), then rewrites the rows of the step's trees:
``[path tokens..., bonus, -1...]``. vLLM's scheduler only counts the tokens returned
(accepted = returned - 1), so it keeps ``root + 1 + path length`` tokens in the cache;
before returning, the accepted nodes' keys/values are moved into those slots (rejected
ones are overwritten later).

Greedy requests follow the child equal to the target's argmax of the raw logits (what
vLLM's greedy sampler takes). Requests with temperature > 0 use speculative sampling over
the tree (:func:`~vllm_specstream.streams.draft_trees.tree_accept_sampled`) on the target's
distribution as vLLM's rejection sampler forms it (temperature, top-k, top-p), drawing
from the request's own generator when it has a seed. Requests whose sampling reads drafts
as a chain (penalties, bad words, logprobs, min tokens, min-p, logit bias, allowed tokens,
structured output) never get trees (:func:`~vllm_specstream.model_executor.trees.step.tree_problem`).
"""

from __future__ import annotations

import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import RejectionSampler

from vllm_specstream.model_executor.trees.step import (
    WORKER_TREES,
    AcceptedPath,
    StepTrees,
    accept_row,
    kept_subtree,
)
from vllm_specstream.streams.draft_trees import tree_accept_sampled


def sampling_temperature(sampling_metadata, row: int) -> float:
    """Temperature of batch row ``row`` (0: greedy)."""
    if sampling_metadata is None or sampling_metadata.all_greedy:
        return 0.0
    return float(sampling_metadata.temperature[row])


def target_probs(logits: torch.Tensor, sampling_metadata, row: int) -> torch.Tensor:
    """The distribution vLLM's rejection sampler checks drafts against, for ``logits``
    (``[m, V]``, rows of batch row ``row``): temperature, then top-k and top-p."""
    x = logits.to(torch.float32) / sampling_temperature(sampling_metadata, row)
    m = x.shape[0]
    top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
    x = apply_top_k_top_p(
        x,
        None if top_k is None else top_k[row].expand(m),
        None if top_p is None else top_p[row].expand(m),
    )
    return x.softmax(dim=-1)


def verify_trees(
    step: StepTrees, metadata, logits, sampling_metadata=None
) -> dict[int, tuple[list[int], list]]:
    """Per tree row: the tokens to return and its ``(src, dst)`` KV moves. Reads ``logits``
    (one row per scheduled token of a drafting request, ``[root, nodes...]``) before vLLM's
    sampler may modify them in place."""
    cu_sampled = metadata.cu_num_sampled_tokens.tolist()
    cu_drafts = metadata.cu_num_draft_tokens.tolist()
    out: dict[int, tuple[list[int], list]] = {}
    for t in step.rows:
        n = metadata.num_draft_tokens[t.row]
        if n != len(t.parents):
            raise RuntimeError(
                f"specstream tree verification: row {t.row} has {n} drafts scheduled but a "
                f"tree of {len(t.parents)} nodes was prepared"
            )
        start = cu_sampled[t.row] - (n + 1)
        rows = logits[start : start + n + 1]
        tokens = metadata.draft_token_ids[cu_drafts[t.row] - n : cu_drafts[t.row]]
        parents, candidates = t.parents, tokens
        kept = step.kept.get(t.row)
        if kept is not None:  # pruned nodes were not computed above the pruning layer
            index = torch.tensor(kept, dtype=torch.long)
            parents, candidates = kept_subtree(t.parents, kept), tokens[index]
            rows = rows[torch.cat((index.new_zeros(1), index + 1))]
        if sampling_temperature(sampling_metadata, t.row) > 0:
            probs = target_probs(rows, sampling_metadata, t.row)
            generator = sampling_metadata.generators.get(t.row)
            nodes, bonus = tree_accept_sampled(parents, candidates.tolist(), probs, generator)
        else:
            got = accept_row(parents, candidates, rows.argmax(dim=-1))
            nodes, bonus = got.nodes, got.bonus
        if kept is not None:  # back to the tree's node indices
            nodes = tuple(kept[i] for i in nodes)
        accepted = AcceptedPath(nodes, bonus)
        row_tokens = [int(tokens[i]) for i in accepted.nodes] + [accepted.bonus]
        step.anchor_offsets[t.row] = 1 + accepted.nodes[-1] if accepted.nodes else 0
        out[t.row] = (row_tokens, accepted.kv_moves(t.root_position))
    return out


class TreeRejectionSampler(RejectionSampler):
    """vLLM's rejection sampler, with the step's tree rows verified as trees."""

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        state = WORKER_TREES
        step = state.step
        if step is None or not step.rows:
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        state.end_forward()  # no later forward of this step is a tree forward
        trees = verify_trees(step, metadata, logits, sampling_metadata)
        output = super().forward(metadata, draft_probs, logits, sampling_metadata)
        ids = output.sampled_token_ids
        moves = {}
        state.count_rows([len(t.parents) for t in step.rows if t.row in trees])
        state.off_chain_rows += sum(1 for _, m in trees.values() if m)
        for row, (tokens, row_moves) in trees.items():
            ids[row] = -1
            ids[row, : len(tokens)] = ids.new_tensor(tokens)
            if row_moves:
                moves[row] = row_moves
        if moves:
            state.compact_kv(moves)
        return output
