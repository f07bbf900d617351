"""Greedy verification of tree drafts, in place of vLLM's chain rejection sampler.

vLLM's sampler reads a request's drafts as a chain: draft ``j`` is accepted if it is the
target's choice at row ``j``. For a tree the target's choice at a node's *parent* row
decides, and the accepted nodes are a root-to-leaf path that need not be the first rows.
:class:`TreeRejectionSampler` runs vLLM's sampler for the whole batch (every request that
is not a tree, and the shapes vLLM expects), then rewrites the rows of the step's trees:
``[path tokens..., bonus, -1...]``. vLLM's scheduler only counts the tokens returned
(accepted = returned - 1), so it keeps ``root + 1 + path length`` tokens in the cache;
before returning, the accepted nodes' keys/values are moved into those slots (rejected
ones are overwritten later). Only requests the proposer found eligible get trees (greedy,
no penalties, bad words, logprobs, min tokens, logit bias or structured output: all of
those read drafts as a chain), so the target's choice is the argmax of the raw logits,
exactly what vLLM's greedy sampler takes.
"""

from __future__ import annotations

from vllm.v1.sample.rejection_sampler import RejectionSampler

from vllm_specstream.model_executor.tree_step import WORKER_TREES, StepTrees, accept_row


def verify_trees(step: StepTrees, metadata, logits) -> dict[int, tuple[list[int], list]]:
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
        argmax = logits[start : start + n + 1].argmax(dim=-1)
        tokens = metadata.draft_token_ids[cu_drafts[t.row] - n : cu_drafts[t.row]]
        accepted = accept_row(t.parents, tokens, argmax)
        row_tokens = [int(tokens[i]) for i in accepted.nodes] + [accepted.bonus]
        step.anchor_offsets[t.row] = 1 + accepted.nodes[-1] if accepted.nodes else 0
        out[t.row] = (row_tokens, accepted.kv_moves(t.root_position))
    return out


class TreeRejectionSampler(RejectionSampler):
    """vLLM's rejection sampler, with the step's tree rows verified greedily as trees."""

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        state = WORKER_TREES
        step = state.step
        if step is None or not step.rows:
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        state.end_forward()  # no later forward of this step is a tree forward
        trees = verify_trees(step, metadata, logits)
        output = super().forward(metadata, draft_probs, logits, sampling_metadata)
        ids = output.sampled_token_ids
        moves = {}
        state.tree_rows += len(trees)
        state.off_chain_rows += sum(1 for _, m in trees.values() if m)
        for row, (tokens, row_moves) in trees.items():
            ids[row] = -1
            ids[row, : len(tokens)] = ids.new_tensor(tokens)
            if row_moves:
                moves[row] = row_moves
        if moves:
            state.compact_kv(moves)
        return output
