"""``SpecStreamProposer``: vLLM's ``custom_class`` proposer that hands out the stream drafts.

The drafts were computed inside the target's own forward (:mod:`model_executor.specstream`);
the proposer only picks, per request, the row of the last accepted token and returns its
stream tokens, clipped to ``num_speculative_tokens``. It keeps no per-row state: rows of
vLLM's input batch move between steps.
"""

from __future__ import annotations

import numpy as np

from vllm_specstream.config import ConfigError
from vllm_specstream.logger import init_logger
from vllm_specstream.policy import (
    DEFAULT_SCHEDULE,
    clamp_schedule,
    draft_length,
    validate_schedule,
)

logger = init_logger(__name__)


def last_accepted_index(query_start: int, first_position: int, num_tokens_no_spec: int) -> int:
    """Flat index, in the last forward, of a request's last accepted token.

    After rejection sampling and bookkeeping, the request holds ``num_tokens_no_spec``
    tokens and the newest one (just sampled) is not in the cache yet; so the last accepted
    token sits at position ``num_tokens_no_spec - 2``, i.e. ``that - first_position`` tokens
    after the first scheduled token of the request.
    """
    return query_start + (num_tokens_no_spec - 2 - first_position)


def anchor_rows(
    sampled_token_ids: list[list[int]],
    num_tokens_no_spec: np.ndarray,
    query_start_loc: list[int],
    first_positions: list[int],
) -> tuple[list[int], list[int]]:
    """Rows that sampled something and the flat index, in the last forward, of each one's
    last accepted token (rows that sampled nothing, e.g. a partial prefill chunk, and
    indices outside the row's scheduled tokens are left out)."""
    rows: list[int] = []
    indices: list[int] = []
    for i, sampled in enumerate(sampled_token_ids):
        if not sampled or i + 1 >= len(query_start_loc):
            continue
        idx = last_accepted_index(
            query_start_loc[i], first_positions[i], int(num_tokens_no_spec[i])
        )
        if query_start_loc[i] <= idx < query_start_loc[i + 1]:
            rows.append(i)
            indices.append(idx)
    return rows, indices


def select_drafts(
    sampled_token_ids: list[list[int]],
    num_tokens_no_spec: np.ndarray,
    query_start_loc: list[int],
    first_positions: list[int],
    draft_table,
    k: int,
) -> list[list[int]]:
    """Per request row: the stream drafts at its last accepted token (``[]`` for rows that
    sampled nothing, e.g. a partial prefill chunk, or whose anchor has no drafts)."""
    rows, indices = anchor_rows(
        sampled_token_ids, num_tokens_no_spec, query_start_loc, first_positions
    )
    return drafts_at(len(sampled_token_ids), rows, indices, draft_table, k)


def drafts_at(
    num_rows: int, rows: list[int], indices: list[int], draft_table, k: int
) -> list[list[int]]:
    """``draft_table[indices[i]][:k]`` up to its first -1 (no draft from that stream on) for
    row ``rows[i]``, ``[]`` for the other rows."""
    drafts: list[list[int]] = [[] for _ in range(num_rows)]
    for i, idx in zip(rows, indices):
        row = [int(t) for t in draft_table[idx][:k]]
        drafts[i] = row[: next((j for j, t in enumerate(row) if t < 0), len(row))]
    return drafts


class SpecStreamProposer:
    """Speculative streaming drafts for vLLM's ``custom_class`` speculative method.

    ``placement`` says where the model runs the streams (see
    :mod:`vllm_specstream.model_executor.specstream`); this class uses the faster one on
    CPU, the subclasses below pin either.

    Draft length per step follows a batch-size schedule (:mod:`vllm_specstream.policy`):
    vLLM's ``num_speculative_tokens_per_batch_size`` when set, else ``DEFAULT_SCHEDULE``;
    with ``$SPECSTREAM_DRAFT_MIN_PROB`` the model also cuts each draft where the streams'
    confidence runs out (-1 in its draft table).
    """

    placement = "accepted"

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = spec.num_speculative_tokens
        user = getattr(spec, "num_speculative_tokens_per_batch_size", None)
        self.schedule = clamp_schedule(
            validate_schedule(user, "num_speculative_tokens_per_batch_size")
            if user
            else DEFAULT_SCHEDULE,
            self.k,
        )
        logger.info(
            "specstream drafts per request by batch size (first, last, k): %s%s",
            self.schedule,
            "" if user else " (default; set num_speculative_tokens_per_batch_size to change)",
        )
        self.target = None

    def load_model(self, target_model) -> None:
        # Stored as `target`, not `model`: vLLM probes `drafter.model` in some paths.
        if not hasattr(target_model, "spec_config") or not hasattr(target_model, "stash"):
            raise ConfigError(
                f"the specstream proposer needs a SpecStreamForCausalLM checkpoint, got "
                f"{type(target_model).__name__}; export one with `specstream export --merge`"
            )
        target_model.set_placement(self.placement)
        self.target = target_model

    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_
    ):
        stash = self.target.stash
        k = draft_length(self.schedule, len(sampled_token_ids), self.k)
        if stash is None or k == 0:
            return [[] for _ in sampled_token_ids]
        batch = stash.batch
        qsl = batch.query_start_loc.tolist()
        first_positions = batch.positions[batch.query_start_loc[:-1]].tolist()
        rows, indices = anchor_rows(sampled_token_ids, num_tokens_no_spec, qsl, first_positions)
        table = stash.draft_table
        if self.placement == "accepted":
            table = self.target.draft_at(rows, indices)
        return drafts_at(len(sampled_token_ids), rows, indices, table, k)


class WindowSpecStreamProposer(SpecStreamProposer):
    """Streams at every window position inside the forward (the paper's parallel design)."""

    placement = "window"


class AcceptedSpecStreamProposer(SpecStreamProposer):
    """Streams only at each request's last accepted position, after rejection sampling."""

    placement = "accepted"
