"""The adaptive policy on simulated traffic: requests whose drafts the target keeps with a
given acceptance, steps that cost what a given CPU makes them cost. What it must do: find
the draft length of best speedup, stop drafting where drafting loses, draft again when
acceptance returns, learn step costs unlike its prior, weigh trees like chains."""

import numpy as np
import pytest

from vllm_specstream.speculation.acceptance import (
    AcceptanceStats,
    TreeStats,
    template_tokens,
    tokens_per_step,
)
from vllm_specstream.speculation.choices import (
    AnchoredChain,
    TreeChoice,
    rows_of,
    tree_choices,
    tree_widths,
)
from vllm_specstream.speculation.policy import DraftPolicy
from vllm_specstream.speculation.step_cost import RowModel, StepCosts, StepTimer, batch_bucket
from vllm_specstream.streams.draft_trees import tree_template

PLAIN_S = 0.01


def cpu(stream_pass: float, row_cost: float, half_batch: float):
    """A CPU's step cost over a plain step, by batch size and draft rows."""
    return RowModel(stream_pass, row_cost, half_batch).ratio


#: CPUs unlike the policy's prior (0.2, 0.8, 8): dear rows from small batches on
#: (AVX2-like), cheap rows (AMX-like), and the fit of the step costs measured on an AVX-512
#: Zen 4 (where 4 drafts for 8 requests cost 3 plain steps).
AVX2_LIKE = cpu(0.5, 0.45, 4.0)
AMX_LIKE = cpu(0.3, 0.35, 8.0)
ZEN4 = cpu(0.22, 1.35, 16.0)


def serve(policy, steps, batch, accept, cost, rng, noise=0.03, tree_kept=None):
    """``steps`` decode steps of ``batch`` requests; draft ``j`` is kept with conditional
    probability ``accept[j - 1]`` (a tree: ``tree_kept`` drafts per row). Returns the
    speedup over plain decoding and the choices made."""
    tokens, seconds, chosen = 0, 0.0, []
    for _ in range(steps):
        choice = policy.draft_length(batch)
        rows = rows_of(choice)
        kept = []
        for _ in range(batch):
            n = 0
            if isinstance(choice, TreeChoice):
                n = tree_kept
            else:
                while n < rows and rng.random() < accept[n]:
                    n += 1
            kept.append(n)
        if isinstance(choice, TreeChoice):
            policy.stats.record_proposed([[]] * batch)
            policy.tree_stats[choice].record(kept)
        else:
            policy.stats.record_proposed([[1] * rows] * batch)
        policy.stats.record_verified([[0] * (n + 1) for n in kept])
        t = PLAIN_S * cost(batch, rows) * (1 + noise * rng.standard_normal())
        policy.costs.record(batch, choice, t)
        tokens += batch + sum(kept)
        seconds += t
        chosen.append(choice)
    return tokens / seconds / (batch / PLAIN_S), chosen


def best_speedup(accept, cost, batch, k_max=4):
    rates = np.cumprod(accept)
    return max(tokens_per_step(rates, k) / cost(batch, k) for k in range(k_max + 1))


@pytest.mark.parametrize("cost", [AVX2_LIKE, AMX_LIKE, ZEN4], ids=["avx2", "amx", "zen4"])
@pytest.mark.parametrize("accept", [(0.85, 0.85, 0.8, 0.8), (0.6, 0.4, 0.3, 0.2)])
def test_it_finds_the_draft_length_of_best_speedup(cost, accept):
    rng = np.random.default_rng(0)
    policy = DraftPolicy(4)
    for batch in (1, 4, 8, 16):  # one engine, as a server sees growing batches
        got, chosen = serve(policy, 400, batch, accept, cost, rng)
        best = best_speedup(accept, cost, batch)
        if best < 1.0 + policy.margin:  # too little to be sure of: plain steps
            assert got > 0.97 and sum(map(bool, chosen[-100:])) < 10, (batch, got, best)
            continue
        # Near the best fixed choice (the noise, the exploring), and once the estimates
        # have settled it keeps to one within 3% of it.
        assert got > 0.93 * best, (batch, got, best)
        settled = max(set(chosen[-100:]), key=chosen[-100:].count)
        rates = np.cumprod(accept)
        settled_speedup = tokens_per_step(rates, settled) / cost(batch, settled)
        assert settled_speedup > 0.97 * best, (batch, settled, chosen[-100:])


def test_a_larger_batch_is_not_drafted_for_on_the_strength_of_smaller_ones():
    # On the Zen 4 fit, 4 drafts pay at batch 1 and 4 but cost 3.9 plain steps at 16: the
    # first steps at batch 16 (a short benchmark cell: before they are timed) stay plain.
    rng = np.random.default_rng(6)
    policy = DraftPolicy(4)
    accept = (0.85, 0.85, 0.8, 0.8)
    for batch in (1, 4):
        serve(policy, 200, batch, accept, ZEN4, rng)
    got, _ = serve(policy, 30, 16, accept, ZEN4, rng)
    assert got > 0.97 and best_speedup(accept, ZEN4, 16) < 1.05


def test_it_stops_drafting_where_drafting_loses_and_drafts_again_when_acceptance_returns():
    rng = np.random.default_rng(1)
    for batch in (1, 4):
        policy = DraftPolicy(4)
        serve(policy, 300, batch, [0.85] * 4, AVX2_LIKE, rng)
        got, chosen = serve(policy, 2000, batch, [0.1] * 4, AVX2_LIKE, rng)
        assert got > 0.97  # never slower than plain by more than the noise
        assert sum(1 for c in chosen[100:] if c) < 0.03 * 1900  # probes only
        got, chosen = serve(policy, 1000, batch, [0.85] * 4, AVX2_LIKE, rng)
        first = next(i for i, c in enumerate(chosen) if all(chosen[i : i + 10]))
        assert first < 250, first  # noticed within a probe interval or two
        assert got > 0.85 * best_speedup([0.85] * 4, AVX2_LIKE, batch)


def test_where_no_acceptance_would_pay_it_never_drafts():
    # Steps that cost 4 plain ones at batch 16: even the prior's acceptance does not pay,
    # so the idle engine does not even probe.
    policy = DraftPolicy(4)
    for k in range(1, 5):
        for _ in range(4):
            policy.costs.record(16, 0, PLAIN_S)
            policy.costs.record(16, k, 4 * PLAIN_S)
    policy.stats.forget(0.0)
    got, chosen = serve(policy, 1000, 16, [0.1] * 4, cpu(3.0, 0.0, 8), np.random.default_rng(2))
    assert not any(chosen) and got == pytest.approx(1.0, abs=0.02)


def test_probes_cost_at_most_their_budget_of_the_idle_steps():
    policy = DraftPolicy(4, probe_every=64, explore_budget=0.01)
    _, chosen = serve(policy, 5000, 1, [0.0] * 4, AVX2_LIKE, np.random.default_rng(3))
    probes = [i for i, c in enumerate(chosen[500:]) if c]
    extra = sum(AVX2_LIKE(1, rows_of(chosen[500 + i])) - 1 for i in probes)
    assert len(probes) > 0 and extra <= 0.01 * 4500 * 1.5


def test_it_takes_plain_steps_to_compare_its_drafting_steps_with():
    policy = DraftPolicy(4, calibrate_every=4)
    policy.costs.min_samples = 2
    policy.costs.record(1, 4, 0.07)
    lengths = [policy.draft_length(1) for _ in range(8)]
    assert lengths.count(0) == 2 and lengths[3] == 0  # one drafting step in four is plain
    policy.costs.record(1, 0, 0.05)
    policy.costs.record(1, 0, 0.05)
    assert 0 not in [policy.draft_length(1) for _ in range(8)]


def test_step_costs_are_measured_where_timed_and_modelled_elsewhere():
    costs = StepCosts(min_samples=2)
    assert costs.ratio(1, 4) == RowModel().ratio(1, 4)  # the prior before any step
    for batch, k, seconds in [(1, 0, 0.010), (1, 2, 0.015), (4, 0, 0.020), (4, 2, 0.044)]:
        costs.record(batch, k, seconds)
        costs.record(batch, k, seconds)
    assert costs.ratio(1, 2) == pytest.approx(1.5) and costs.ratio(5, 2) == pytest.approx(2.2)
    assert costs.timed(6, 2) and not costs.timed(6, 3) and not costs.timed(8, 2)
    # Untimed: the row model fitted to what was timed (close to it at the timed points).
    fit = costs.model()
    assert fit.ratio(1, 2) == pytest.approx(1.5, abs=0.1)
    assert fit.ratio(4, 2) == pytest.approx(2.2, abs=0.15)
    assert costs.ratio(4, 3) > costs.ratio(4, 2) > costs.ratio(4, 1)
    # An untimed bucket costs at least what the nearest smaller one timed.
    assert costs.ratio(16, 2) >= 2.2 and costs.ratio(16, 3) > costs.ratio(16, 2)


def test_the_row_model_fit_recovers_a_cpus_costs():
    truth = RowModel(0.5, 0.45, 4.0)
    points = [(b, k, truth.ratio(b, k)) for b in (1, 4, 8) for k in (1, 2, 3, 4)]
    fit = RowModel().fitted(points, weight=1e-6)
    assert fit.half_batch == 4.0
    assert fit.ratio(32, 4) == pytest.approx(truth.ratio(32, 4), rel=0.01)
    assert RowModel().fitted([]) == RowModel()


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 16, 17)] == [1, 2, 2, 4, 4, 8, 16, 16]


def test_acceptance_stats_count_what_vllm_kept():
    stats = AcceptanceStats(num_positions=3, decay=1.0, prior_weight=1e-9)
    stats.record_proposed([[1, 2, 3], [4, 5], [], [6, 7, 8]])
    # Kept 2, 0, (none drafted), 3 drafts: sampled = kept + the bonus token.
    stats.record_verified([[1, 2, 9], [9], [9], [6, 7, 8, 9]])
    assert stats.accepted.tolist() == [2, 2, 1]
    # A second draft is tried where the first was kept, a third where the second was.
    assert stats.tried.tolist() == [3, 2, 2]
    np.testing.assert_allclose(stats.accept_rates(), [2 / 3, 2 / 3, 1 / 3])
    stats.record_proposed([[], []])  # a step without drafts adds nothing
    stats.record_verified([[5], [6]])
    assert stats.tried.tolist() == [3, 2, 2]


def test_positions_not_yet_drafted_follow_the_acceptance_seen_before_them():
    stats = AcceptanceStats(num_positions=4, decay=1.0)
    np.testing.assert_allclose(stats.accept_rates(), 0.7 ** np.arange(1, 5))
    for _ in range(40):  # two drafts a step, 90% of firsts and 81% of seconds kept
        stats.record_proposed([[1, 2]] * 10)
        stats.record_verified([[1, 2, 3]] * 8 + [[1, 3]] + [[3]])
    rates = stats.accept_rates()
    np.testing.assert_allclose(rates[:2], [0.9, 0.8], atol=0.01)
    # Positions 3 and 4 were never drafted: priced at the conditional acceptance seen at
    # position 2, not at the prior's 0.7 ** j.
    np.testing.assert_allclose(rates[2:], [0.8 * 0.89, 0.8 * 0.89**2], atol=0.02)


def test_trees_weighed_are_template_prefixes_of_a_few_widths():
    assert tree_widths(16, 4) == [6, 8, 12, 16]  # the paper's Figure 5 sizes
    assert tree_widths(8, 4) == [6, 8] and tree_widths(5, 4) == [5]
    assert tree_choices(6, 4, prune=True) == (TreeChoice(6), TreeChoice(6, prune=True))
    assert str(TreeChoice(8, prune=True)) == "tree8-pruned" and rows_of(TreeChoice(6)) == 6


def test_tree_prior_sums_the_chance_each_node_is_on_the_accepted_path():
    rates = np.array([0.5, 0.25])  # the top-1 accepted with 1/2 at each depth
    t = tree_template(2, 2)  # (0), (0,0), (1), then (0,1), (1,0), (1,1)
    assert template_tokens(t, rates)[1] == pytest.approx(tokens_per_step(rates, 2))
    # (1) catches half of what (0) misses; (0,1) 0.5 x 0.25; (1,0) 0.25 x 0.5; (1,1) 0.25^2.
    assert template_tokens(t, rates)[2] == pytest.approx(1.75 + 0.25)
    assert template_tokens(t, rates)[5] == pytest.approx(1.75 + 0.25 + 0.125 + 0.125 + 0.0625)
    tree = TreeStats(decay=1.0, prior_weight=4.0)
    assert tree.expected_tokens(2.5) == pytest.approx(2.5)
    tree.record([3] * 100)  # then the tree rows' paths take over
    assert tree.expected_tokens(2.5) == pytest.approx(1 + (300 + 6) / 104)


def test_a_tree_is_drafted_where_its_paths_pay_more_than_the_chains():
    template = tree_template(4, 2, max_nodes=8)
    trees = tree_choices(8, 4, prune=False)
    rng = np.random.default_rng(4)
    accept = (0.6, 0.5, 0.4, 0.3)  # chains keep ~1.1 drafts; the trees' rows keep 3
    policy = DraftPolicy(4, template=template, trees=trees)
    _, chosen = serve(policy, 600, 1, accept, AMX_LIKE, rng, tree_kept=3)
    assert isinstance(max(set(chosen[-100:]), key=chosen[-100:].count), TreeChoice)
    # Where the trees' rows keep no more than a chain's, chains are drafted.
    policy = DraftPolicy(4, template=template, trees=trees)
    _, chosen = serve(policy, 600, 1, accept, AMX_LIKE, rng, tree_kept=1)
    assert sum(isinstance(c, TreeChoice) for c in chosen[-100:]) < 10  # timings only


def test_a_window_engine_drafts_from_the_anchors_where_window_streams_are_dear():
    # Window streams: k + 1 stream rows per request and stream, cheap at batch 1, dear from
    # a few requests on; anchored: one more pass over the top layers at the anchors.
    window, anchored = cpu(0.1, 0.6, 8.0), cpu(0.5, 0.15, 8.0)

    def cost(batch, rows, kind=int):
        return (anchored if kind is AnchoredChain else window)(batch, rows)

    rng = np.random.default_rng(5)
    policy = DraftPolicy(4, anchored=True)
    accept = (0.85, 0.85, 0.8, 0.8)
    for batch, want in ((1, int), (8, AnchoredChain)):
        chosen = []
        for _ in range(400):
            choice = policy.draft_length(batch)
            rows = rows_of(choice)
            policy.stats.record_proposed([[1] * rows] * batch)
            kept = [next((j for j in range(rows) if rng.random() > accept[j]), rows)] * batch
            policy.stats.record_verified([[0] * (n + 1) for n in kept])
            policy.costs.record(batch, choice, PLAIN_S * cost(batch, rows, type(choice)))
            chosen.append(choice)
        settled = max(set(chosen[-100:]), key=chosen[-100:].count)
        assert type(settled) is want and settled != 0, (batch, chosen[-100:])


def test_step_timer_files_only_decode_steps_of_one_batch():
    costs = StepCosts(min_samples=1)
    now = [0.0]
    timer = StepTimer(clock=lambda: now[0])
    ids = np.arange(1000).reshape(2, 500)  # token_ids_cpu: row r holds 500r, 500r + 1, ...

    def call(seconds, tokens, choice):
        now[0] += seconds
        timer.record(costs, [[1]] * len(tokens), np.array(tokens), ids)
        timer.proposed(choice)

    call(0.0, [10, 20], 2)
    call(0.1, [13, 21], 2)  # +3 and +1 tokens with k = 2: a decode step of one batch
    call(0.2, [14, 22], 0)
    call(0.05, [15, 23], None)  # plain step; then not one clean choice
    call(0.3, [16, 24], 2)  # not filed
    call(0.1, [30, 24], 2)  # not filed: row 0 grew by 14 (a prefill, another request)
    call(0.1, [31], 2)  # not filed: the batch changed
    assert {key: list(v) for key, v in costs.times.items()} == {
        (2, 2): [pytest.approx(0.1), pytest.approx(0.2)],
        (2, 0): [pytest.approx(0.05)],
    }
