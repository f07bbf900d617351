"""Helpers of the benchmark scripts (`benchmarks/`): what their tables are computed with."""

from collections import Counter

import pytest
from helpers import load_benchmark


def test_interleaved_turns_put_every_engine_in_every_position_alike():
    rotated = load_benchmark("bs1_child").rotated
    order = ["plain", "control", "specstream"]
    turns = [rotated(order, t) for t in range(2 * len(order))]
    assert turns[:3] == [order, order[1:] + order[:1], order[2:] + order[:2]]
    assert turns[3] == order[::-1]  # the second cycle runs reversed
    for position in range(len(order)):
        assert Counter(t[position] for t in turns) == Counter({name: 2 for name in order})
    # Over the two cycles each engine runs right before each other one equally often.
    pairs = Counter((t[i], t[i + 1]) for t in turns for i in range(len(order) - 1))
    assert len(pairs) == 6 and set(pairs.values()) == {2}
    assert order == ["plain", "control", "specstream"]  # not reordered in place


def test_policy_forecast_sets_realized_against_forecast_per_bucket():
    forecast = load_benchmark("policy_forecast")
    rows, t = [], 0.0

    def call(b, k, seconds, kept=0.0, tokens=None, cost=None):
        nonlocal t
        row = {"t": t, "b": b, "k": k, "kept": kept}
        if k != "k0":
            row.update(tokens=tokens, cost=cost)
        rows.append(row)
        t += seconds

    for _ in range(4):  # batch 1: plain steps of 20 ms, drafting steps of 30 ms
        call(1, "k0", 0.020)
        call(1, "k2", 0.030, tokens=2.4, cost=1.2)
        call(1, "k2", 5.0, kept=1.0, tokens=2.4, cost=1.2)  # another engine runs after it
    call(1, "k0", 0.020, kept=1.0)
    call(4, "k0", 0.025)  # a new batch: the batch-1 step before it is not one of its steps
    call(4, "k0", 0.025)
    call(4, "k0", 0.025)
    out = forecast.forecast_by_bucket(rows)
    one, four = out
    # Each 30 ms drafting step kept 1 draft: 2 tokens for 1.5 plain steps.
    assert one["drafting_steps"] == 4 and one["plain_steps"] == 4
    assert one["cost"] == 1.5 and one["tokens"] == 2.0
    assert one["realized"] == round(2 / 1.5, 3) and one["forecast"] == 2.0
    assert one["forecast_tokens"] == 2.4 and one["forecast_cost"] == 1.2
    assert one["won_ms"] == 4 * 10.0
    assert four == {"bucket": 4, "plain_steps": 2, "drafting_steps": 0}
    assert "1.33x (forecast 1.20 for 2.40, 2.00x; +40 ms)" in forecast.describe(out)


def test_policy_forecast_prices_tokens_at_the_mean_plain_step():
    forecast = load_benchmark("policy_forecast")
    rows, t = [], 0.0
    # plain steps of 20, 20 and 50 ms (mean 30, median 20), two drafting steps of 45 ms
    for b, k, seconds, kept in [
        (1, "k0", 0.020, 0.0),
        (1, "k0", 0.020, 0.0),
        (1, "k0", 0.050, 0.0),
        (1, "k1", 0.045, 0.0),
        (1, "k1", 0.045, 1.0),
        (1, "k0", 0.020, 1.0),
    ]:
        rows.append({"t": t, "b": b, "k": k, "kept": kept, "tokens": 2.0, "cost": 1.5})
        t += seconds
    (one,) = forecast.forecast_by_bucket(rows)
    assert one["plain_ms"] == 30.0 and one["plain_median_ms"] == 20.0
    # each drafting step kept its draft (read at the next call): 4 tokens in 90 ms, where
    # plain steps take 120 (at the median they would be priced at 80: a loss)
    assert one["tokens"] == 2.0 and one["realized"] == round(120 / 90, 3)
    assert one["won_ms"] == 30.0


def test_policy_forecast_log_wraps_one_policy_only():
    from vllm_specstream.policy import AcceptanceStats, DraftPolicy
    from vllm_specstream.step_cost import StepCostTable

    forecast = load_benchmark("policy_forecast")
    table = StepCostTable("test", (1,), {1: (1.1,), 2: (1.2,)}, "test")
    logged, other = (DraftPolicy(2, table, AcceptanceStats(2)) for _ in range(2))
    log = forecast.ForecastLog(logged)
    assert logged.draft_length(1) == 2  # the prior drafts on a fresh engine
    other.draft_length(1)
    (row,) = log.take()
    assert row["b"] == 1 and row["k"] == "k2" and row["kept"] == 0.0
    assert row["tokens"] == logged.expected_tokens(2) and row["cost"] == 1.2
    assert log.take() == []


def test_acceptance_spread_separates_the_requests_spread_from_chance():
    spread = load_benchmark("acceptance_spread").spread
    # Alike requests: every one keeps its first draft at half its steps, in alternation
    # (no runs), so the rates differ by nothing and the steps are anti-correlated.
    alike = spread([[1, 0] * 10, [0, 2] * 10, [3, 0] * 10])
    assert alike["first_kept_pooled"] == 0.5
    assert alike["first_kept_sd_observed"] == 0.0
    assert alike["first_kept_sd_by_chance"] == pytest.approx((0.25 / 20) ** 0.5)
    assert alike["first_kept_sd_requests"] == 0.0
    assert alike["lag1_correlation"] < -0.9
    # Requests that differ: one always keeps it, one never: their own spread is most of it.
    apart = spread([[2] * 20, [0] * 20, []])  # a request with no steps is left out
    assert apart["requests"] == 2 and apart["steps"] == 40
    assert apart["first_kept_sd_observed"] == 0.5
    assert 0.48 < apart["first_kept_sd_requests"] < 0.5
    assert apart["first_kept_range"] == [0.0, 1.0]
    assert apart["tokens_per_step"] == 2.0 and apart["tokens_per_step_range"] == [1.0, 3.0]
    assert apart["lag1_correlation"] > 0.9
