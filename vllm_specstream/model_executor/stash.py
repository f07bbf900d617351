"""``StreamStash``: what one forward leaves for the proposer, tagged with that forward.

The model computes (placement ``"window"``) or prepares (``"accepted"``) the streams in
its forward; the proposer reads them after rejection sampling, with nothing of ours in
between (window streams whose LM head was left for later go through it then, at the
anchors the proposer reads only). A stash from another step would hand its drafts to the wrong rows: lossless
(vLLM verifies every draft) but the speedup silently gone. So the model tags each stash
with its forward counter and drops it when the next forward starts, the proposer takes it
(clearing it) and refuses one that fails :func:`stash_problem` or
:func:`anchor_token_problem`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specstream.model_executor.forward_batch import ForwardBatch


@dataclass
class StreamStash:
    """What the last forward left for the proposer."""

    step: int
    """The model's ``forward_step`` of the forward that made it."""
    batch: ForwardBatch
    input_ids: torch.Tensor | None
    """``[num_tokens]`` the scheduled tokens of the forward (None for embedding inputs)."""
    draft_table: torch.Tensor
    """``[num_tokens, G]`` top-1 stream tokens of each anchor token; -1 elsewhere and from
    the first stream below the confidence threshold on."""
    msa_input: torch.Tensor | None = None
    """``[num_tokens, h]`` residual stream entering L0, kept until ``draft_at`` (placement
    ``"accepted"``)."""
    stream_states: tuple[torch.Tensor, torch.Tensor] | None = None
    """``(anchors [R, A], states [R, A, G, h])``: window streams whose final states have not
    been through the LM head yet (flat token index per anchor, -1: none). Only the anchors
    the proposer reads go through it (:func:`take_stream_rows`); the others never do."""
    draft_topk: torch.Tensor | None = None
    """``[num_tokens, G, K]`` each stream's top-K tokens at each anchor, best first (draft
    trees only)."""
    drafting_rank: bool = True
    """False on tensor-parallel ranks whose drafts vLLM ignores (their LM head gathers to
    rank 0): an empty draft table there is expected."""


def stash_problem(stash: StreamStash, forward_step: int, num_rows: int) -> str | None:
    """Why ``stash`` is not the one of the forward just run for ``num_rows`` requests
    (None: it is)."""
    if stash.step != forward_step:
        return f"it was made by forward {stash.step}, the last forward was {forward_step}"
    if stash.batch.num_reqs < num_rows:
        return f"it holds {stash.batch.num_reqs} requests, this step has {num_rows}"
    return None


def anchor_token_problem(
    input_ids: torch.Tensor | None,
    token_ids_cpu: np.ndarray | None,
    num_tokens_no_spec: np.ndarray,
    rows: list[int],
    indices: list[int],
) -> str | None:
    """Whether the forward's token at each anchor (``indices[i]``, flat) is request row
    ``rows[i]``'s last accepted token (position ``num_tokens_no_spec - 2`` after
    bookkeeping). None when they all agree or there is nothing to compare."""
    if input_ids is None or token_ids_cpu is None or not rows:
        return None
    rows_np = np.asarray(rows)
    want = token_ids_cpu[rows_np, np.asarray(num_tokens_no_spec)[rows_np] - 2]
    seen = input_ids[torch.as_tensor(indices)].cpu().numpy()
    bad = np.flatnonzero(seen != want)
    if bad.size == 0:
        return None
    i = int(bad[0])
    return (
        f"row {rows[i]}'s last accepted token is {int(want[i])} but the stash has "
        f"{int(seen[i])} there ({bad.size} of {len(rows)} rows differ)"
    )


def take_stream_rows(
    stash: StreamStash, indices: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(anchors [R, A], states [R, A, G, h])`` of ``stash``'s pending stream states at
    the flat token ``indices`` (None: at every anchor), the other anchors -1; the taken
    anchors are no longer pending. None when none of them is pending."""
    if stash.stream_states is None:
        return None
    anchors, states = stash.stream_states
    pending = anchors >= 0
    take = (
        pending
        if indices is None
        else pending & torch.isin(anchors, torch.tensor(indices, dtype=torch.long))
    )
    if not bool(take.any()):
        return None
    left = pending & ~take
    stash.stream_states = (torch.where(left, anchors, -1), states) if bool(left.any()) else None
    return torch.where(take, anchors, -1), states
