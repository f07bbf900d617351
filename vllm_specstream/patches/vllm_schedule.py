"""A user's batch-size schedule, read with vLLM's own validator and expander.

``num_speculative_tokens_per_batch_size`` (inclusive ranges ``(first, last, k)``) is vLLM's
dynamic speculative decoding option; vLLM's scheduler applies it to the tokens it schedules
but does not pass the length to ``custom_class`` proposers, so the proposer reads the same
schedule the same way. The one touch point with ``vllm.v1.spec_decode.dynamic.utils``;
``tests/vllm/test_patches.py`` fails when it changes.
"""

from __future__ import annotations

from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

OPTION = "num_speculative_tokens_per_batch_size"


def schedule_lookup(schedule, max_num_seqs: int, k: int) -> list[int]:
    """Drafts per batch size ``0..max_num_seqs`` (index = batch size), capped at ``k``;
    raises ``ValueError`` naming the option for a malformed schedule."""
    try:
        return build_dynamic_sd_schedule_lookup(schedule, max_num_seqs, k)
    except ValueError as e:
        raise ValueError(f"{OPTION}={schedule!r}: {e}") from e
