"""The adaptive policy's forecast for its drafting steps against what those steps gave.

The policy drafts where the tokens a step is expected to yield (its acceptance estimate),
over the step's expected cost in plain steps (measured or from the table), beat a plain
step by its margin. :class:`ForecastLog` wraps one engine's ``DraftPolicy.draft_length``
and records, per proposer call, the time, the batch size, the choice with its expected
tokens and cost, and the drafts per request the last call's drafts kept. The time from one
call to the next is the step the choice paid for (its stream pass, the forward verifying
its drafts, sampling), and the next call's count is what those drafts gave, so
:func:`forecast_by_bucket` can set, per batch-size bucket, the realized speedup of the
drafting steps (their tokens over their time in the bucket's mean plain step) beside
the forecast, and the time they won or lost against plain steps of the same engine.

Used by ``benchmarks/interleaved_speed.py --forecast``. The log prices the chosen step
again (the policy keeps no record of its pricing), so each drafting call of the measured
engine also pays one choice's pricing: speeds measured with ``--forecast`` include it.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict


class ForecastLog:
    """Per-call records of one policy (installed on the instance, so other engines'
    policies are left alone)."""

    def __init__(self, policy) -> None:
        from vllm_specstream.policy import choice_label

        self.rows: list[dict] = []
        choose = policy.draft_length

        def draft_length(batch_size: int):
            now = time.perf_counter()
            kept = policy.stats.kept_per_row
            choice = choose(batch_size)
            row = {"t": now, "b": batch_size, "k": choice_label(choice), "kept": kept}
            if choice != 0:
                row["tokens"] = policy.expected_tokens(choice)
                row["cost"] = policy.step_cost(batch_size, choice)
            self.rows.append(row)
            return choice

        policy.draft_length = draft_length

    def take(self) -> list[dict]:
        rows, self.rows = self.rows, []
        return rows


def forecast_by_bucket(rows: list[dict], max_gap: float = 5.0) -> list[dict]:
    """Per batch-size bucket, the drafting steps' realized and forecast speedup.

    A step is a call and the next one of the same batch size; one longer than ``max_gap``
    times the median step (another engine ran between, or a new request's prefill) is left
    out. Realized: the tokens per request the steps gave (1 + drafts kept) over their summed
    time in the bucket's mean plain step; forecast: the mean expected tokens
    (``forecast_tokens``) over the mean expected cost (``forecast_cost``); ``won_ms``:
    plain steps' time for those tokens less the steps' time.
    """
    from vllm_specstream.policy import batch_bucket

    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if a["b"] == b["b"]]
    if not pairs:
        return []
    typical = statistics.median(b["t"] - a["t"] for a, b in pairs)
    plain, drafting = defaultdict(list), defaultdict(list)
    for a, b in pairs:
        seconds = b["t"] - a["t"]
        if seconds > max_gap * typical:
            continue
        if a["k"] == "k0":
            plain[batch_bucket(a["b"])].append(seconds)
        else:
            drafting[batch_bucket(a["b"])].append(
                (seconds, 1.0 + b["kept"], a["tokens"], a["cost"])
            )
    out = []
    for bucket in sorted(set(plain) | set(drafting)):
        steps = drafting.get(bucket, [])
        row = {
            "bucket": bucket,
            "plain_steps": len(plain.get(bucket, [])),
            "drafting_steps": len(steps),
        }
        if steps and plain.get(bucket):
            # The mean plain step: the time those tokens would have taken without drafts
            # (step times are skewed: the median would price them cheaper than they run).
            step = statistics.fmean(plain[bucket])
            seconds = sum(s[0] for s in steps)
            tokens = sum(s[1] for s in steps)
            expected_tokens = statistics.mean(s[2] for s in steps)
            expected_cost = statistics.mean(s[3] for s in steps)
            row.update(
                plain_ms=round(1e3 * step, 2),
                plain_median_ms=round(1e3 * statistics.median(plain[bucket]), 2),
                cost=round(seconds / len(steps) / step, 3),
                tokens=round(tokens / len(steps), 3),
                realized=round(tokens * step / seconds, 3),
                forecast_tokens=round(expected_tokens, 3),
                forecast_cost=round(expected_cost, 3),
                forecast=round(expected_tokens / expected_cost, 3),
                won_ms=round(1e3 * (tokens * step - seconds), 1),
            )
        out.append(row)
    return out


def describe(buckets: list[dict]) -> str:
    """One line: each bucket's drafting steps, realized speedup and forecast."""
    parts = []
    for r in buckets:
        if "realized" in r:
            parts.append(
                f"bucket {r['bucket']}: {r['drafting_steps']} drafting steps of "
                f"{r['drafting_steps'] + r['plain_steps']}, {r['cost']:.2f} plain steps for "
                f"{r['tokens']:.2f} tokens, {r['realized']:.2f}x (forecast "
                f"{r['forecast_cost']:.2f} for {r['forecast_tokens']:.2f}, "
                f"{r['forecast']:.2f}x; {r['won_ms']:+.0f} ms)"
            )
        elif r["drafting_steps"]:
            parts.append(f"bucket {r['bucket']}: {r['drafting_steps']} drafting steps, no plain")
    return "; ".join(parts) or "no drafting steps"
