"""Adaptive speculation: how many drafts each request gets this step.

Verifying ``k`` drafts makes every request's forward ``k + 1`` rows long. At batch 1 the
extra rows are nearly free (the step is bound by reading the weights); as the batch grows
the step becomes bound by arithmetic and the extra rows cost about what they save, then
more. Two rules bound the drafts:

* **Load**: a batch-size schedule in vLLM's own format
  (``num_speculative_tokens_per_batch_size``: inclusive ranges ``(first, last, k)``), so a
  user can set it on the command line like for vLLM's built-in methods; the proposer
  applies it (vLLM does not pass its dynamic draft length to ``custom_class`` proposers).
* **Stream confidence** (``$SPECSTREAM_DRAFT_MIN_PROB``, off by default): a request's draft
  stops before the first stream whose cumulative top-1 probability (the product of the
  streams' top-1 probabilities up to it, an estimate of the chance the whole prefix is
  accepted) falls below the threshold; below it at stream 1, the request does not draft.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from vllm_specstream.config import ConfigError

Schedule = list[tuple[int, int, int]]

#: Measured on the SQL demo checkpoint (fp32, 2-core CPU, benchmarks/adaptive_sweep.py,
#: benchmarks/results/sql-smollm2/adaptive.json): 4 drafts win up to batch 8 (1.06x there),
#: 2 drafts break even at 16 (1.03x vs 0.99x for 4), and at 32 any draft loses (0.92-0.97x).
DEFAULT_SCHEDULE: Schedule = [(1, 15, 4), (16, 31, 2), (32, 1 << 20, 0)]


def validate_schedule(schedule: Sequence[Sequence[int]], where: str = "schedule") -> Schedule:
    """Sorted, non-overlapping ``(first, last, k)`` ranges starting at batch size 1."""
    out: Schedule = []
    for entry in schedule:
        if len(entry) != 3:
            raise ValueError(f"{where}: entry {entry!r} is not (first, last, k)")
        first, last, k = (int(x) for x in entry)
        if first < 1 or last < first or k < 0:
            raise ValueError(f"{where}: entry {entry!r} needs 1 <= first <= last and k >= 0")
        out.append((first, last, k))
    out.sort()
    if not out or out[0][0] != 1:
        raise ValueError(f"{where}: the first range must start at batch size 1")
    for (_, last, _), (first, _, _) in zip(out, out[1:]):
        if first <= last:
            raise ValueError(f"{where}: ranges overlap")
    return out


def clamp_schedule(schedule: Schedule, k: int) -> Schedule:
    """``schedule`` with every draft length capped at ``k``."""
    return [(first, last, min(n, k)) for first, last, n in schedule]


def draft_length(schedule: Schedule | None, batch_size: int, k: int) -> int:
    """Drafts per request for a step of ``batch_size`` requests (at most ``k``).

    Between ranges the previous range's length carries on; past the last range, its
    length (vLLM's reading of the same schedule).
    """
    if not schedule:
        return k
    n = k
    for first, _, length in schedule:
        if batch_size < first:
            break
        n = length
    return min(n, k)


ENV_DRAFT_MIN_PROB = "SPECSTREAM_DRAFT_MIN_PROB"


def draft_min_prob_from_env() -> float:
    """``$SPECSTREAM_DRAFT_MIN_PROB``, checked: a probability in ``[0, 1)``; 0 (the default)
    turns the confidence rule off."""
    text = os.environ.get(ENV_DRAFT_MIN_PROB, "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise ConfigError(
            f"{ENV_DRAFT_MIN_PROB}={text!r}: expected a probability in [0, 1) (0 turns the "
            "confidence rule off)"
        )
    return value


def confident_drafts(tokens: torch.Tensor, top_prob: torch.Tensor, min_prob: float) -> torch.Tensor:
    """``tokens`` (``[N, G]`` stream top-1 tokens per anchor) with -1 from the first stream
    whose cumulative top-1 probability (``top_prob``, ``[N, G]``) is below ``min_prob``."""
    keep = torch.cumprod(top_prob, dim=-1) >= min_prob
    return torch.where(keep, tokens, torch.full_like(tokens, -1))
