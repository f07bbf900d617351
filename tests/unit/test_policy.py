"""The adaptive speculation policy (step cost against acceptance), the user's schedule read
with vLLM's validator, the runtime options, and the proposer that applies them."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specstream import PROPOSER, speculative_config
from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.machine import CPU_CLASSES, cpu_class, native_bf16
from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.proposer import SpecStreamProposer, drafts_at
from vllm_specstream.model_executor.stash import StreamStash
from vllm_specstream.speculation.options import read_options
from vllm_specstream.speculation.policy import (
    AcceptanceStats,
    AnchoredChain,
    DraftPolicy,
    MeasuredCost,
    StepTimer,
    TreeChoice,
    TreeStats,
    WindowEntry,
    batch_bucket,
    confident_drafts,
    lookup_length,
    rows_of,
    template_tokens,
    tokens_per_step,
    tree_choices,
    tree_widths,
)
from vllm_specstream.speculation.step_cost import TABLES, StepCostTable, table_for


def _seen(accepted: list[int]) -> AcceptanceStats:
    """Acceptance seen on 100 drafts at each of 4 positions (no prior, no decay)."""
    stats = AcceptanceStats(num_positions=4, decay=1.0, prior_weight=1e-9)
    stats.proposed[:] = 100
    stats.tried[:] = [100, *accepted[:-1]]
    stats.accepted[:] = accepted
    return stats


#: A made-up CPU: extra rows cheap at batch 1, dear at 32.
TABLE = StepCostTable(
    cpu_class="test",
    batch_sizes=(1, 8, 32),
    ratios={1: (1.1, 1.3, 1.8), 2: (1.2, 1.6, 2.6), 4: (1.3, 2.4, 4.4)},
    source="test",
)


def test_step_cost_interpolates_in_batch_size_and_draft_length():
    assert TABLE.ratio(1, 0) == 1.0
    assert TABLE.ratio(1, 4) == pytest.approx(1.3)
    assert TABLE.ratio(4, 1) == pytest.approx(1.1 + 3 / 7 * 0.2)  # between batch 1 and 8
    assert TABLE.ratio(8, 3) == pytest.approx((1.6 + 2.4) / 2)  # between k = 2 and 4
    assert TABLE.ratio(64, 1) == pytest.approx(1.8 + 32 / 24 * 0.5)  # the trend goes on
    with pytest.raises(ValueError, match="one ratio per batch size"):
        StepCostTable("x", (1, 2), {1: (1.0,)}, "x")


def test_every_cpu_class_gets_a_table():
    for cls in CPU_CLASSES:
        for placement in ("window", "accepted"):
            table = table_for(placement, cls)
            assert table.ratio(1, 1) > 1.0
            assert table is TABLES[cls, placement] and table.cpu_class == cls
    assert cpu_class(frozenset({"avx2"})) == "avx2"
    assert cpu_class(frozenset({"avx2", "avx512f"})) == "avx512"
    assert cpu_class(frozenset({"avx2", "avx512f", "avx512_bf16"})) == "avx512_bf16"
    assert cpu_class(frozenset({"avx512f", "avx512_bf16", "amx_bf16"})) == "amx"
    assert [native_bf16(cls) for cls in CPU_CLASSES] == [False, False, True, True]


def test_onednn_isa_limit_caps_the_cpu_class(monkeypatch):
    # ONEDNN_MAX_CPU_ISA makes vLLM's GEMMs run as on a lesser CPU: the tables, the bf16
    # advice and the stream pass's bf16 copies follow it; it never raises the class.
    bf16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
    assert cpu_class(bf16, "AVX512_CORE") == "avx512"
    assert cpu_class(bf16, "avx2") == "avx2"
    assert cpu_class(bf16, "AVX512_CORE_BF16") == cpu_class(bf16, "ALL") == "avx512_bf16"
    # oneDNN's AMX kernels are off below its AMX ISAs: the class drops to AVX512-BF16's
    amx = bf16 | {"amx_bf16"}
    for isa in ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "avx10_1_512"):
        assert cpu_class(amx, isa) == "avx512_bf16", isa
    assert cpu_class(amx, "AVX512_CORE_AMX") == cpu_class(amx, "ALL") == "amx"
    assert cpu_class(amx, "AVX512_CORE") == "avx512"
    assert cpu_class(frozenset({"avx2"}), "AVX512_CORE") == "avx2"
    assert cpu_class(bf16, None) == "avx512_bf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_class() == "avx2" and table_for("window").cpu_class == "avx2"
    from vllm_specstream.speculation.preflight import dtype_advice

    assert dtype_advice("bfloat16", "auto")[0] == "float32"


def test_the_default_placement_is_the_cheaper_at_batch_1_per_cpu_class(monkeypatch):
    from vllm_specstream.speculation import step_cost

    # window on every measured class (1-4 drafts summed: AVX2 6.7 against 7.0 plain steps)
    for cls in CPU_CLASSES:
        assert step_cost.cheaper_placement(cls) == "window", cls
    # A class whose accepted steps cost less gets accepted.
    cheap = StepCostTable("avx2", (1,), {1: (1.1,), 4: (1.3,)}, "x")
    monkeypatch.setitem(step_cost.TABLES, ("avx2", "accepted"), cheap)
    assert step_cost.cheaper_placement("avx2") == "accepted"
    assert step_cost.cheaper_placement("avx512") == "window"


def test_measured_tables_never_price_more_drafts_or_more_requests_cheaper():
    for (cls, placement), table in TABLES.items():
        assert table.cpu_class == cls
        for b, size in enumerate(table.batch_sizes):
            row = [table.ratios[k][b] for k in sorted(table.ratios)]
            assert row == sorted(row), (cls, placement, size)
            assert row[0] > 1.0
        # nor a batch of more requests cheaper (what bounds an untimed bucket's estimate)
        for k, by_batch in table.ratios.items():
            assert list(by_batch) == sorted(by_batch), (cls, placement, k)


def test_acceptance_stats_count_what_vllm_kept():
    stats = AcceptanceStats(num_positions=3, decay=1.0, prior_weight=1e-9)
    stats.record_proposed([[1, 2, 3], [4, 5], [], [6, 7, 8]])
    # Kept 2, 0, (none drafted), 3 drafts: sampled = kept + the bonus token.
    stats.record_verified([[1, 2, 9], [9], [9], [6, 7, 8, 9]])
    assert stats.proposed.tolist() == [3, 3, 2]
    assert stats.accepted.tolist() == [2, 2, 1]
    # A second draft is tried where the first was kept, a third where the second was.
    assert stats.tried.tolist() == [3, 2, 2]
    np.testing.assert_allclose(stats.conditional_rates(), [2 / 3, 1, 1 / 2])
    np.testing.assert_allclose(stats.accept_rates(), [2 / 3, 2 / 3, 1 / 3])
    assert stats.expected_tokens(2) == pytest.approx(1 + 4 / 3)
    # A step without drafts adds nothing.
    stats.record_proposed([[], []])
    stats.record_verified([[5], [6]])
    assert stats.proposed.tolist() == [3, 3, 2]


def test_acceptance_estimate_starts_at_the_prior_and_follows_the_evidence():
    stats = AcceptanceStats(num_positions=2)
    np.testing.assert_allclose(stats.accept_rates(), [0.7, 0.49])
    for _ in range(50):  # every draft rejected
        stats.record_proposed([[1, 2]])
        stats.record_verified([[3]])
    assert stats.accept_rates()[0] < 0.15
    for _ in range(300):  # steps without drafts change nothing
        stats.record_proposed([])
        stats.record_verified([[3]])
    assert stats.accept_rates()[0] < 0.15
    for _ in range(50):  # then every draft kept: the old evidence fades
        stats.record_proposed([[1, 2]])
        stats.record_verified([[1, 2, 3]])
    assert stats.accept_rates()[1] > 0.6


def test_positions_not_yet_drafted_follow_the_acceptance_seen_before_them():
    stats = AcceptanceStats(num_positions=4, decay=1.0)
    np.testing.assert_allclose(stats.accept_rates(), 0.7 ** np.arange(1, 5))
    for _ in range(40):  # two drafts a step, 90% of firsts and 81% of seconds kept
        stats.record_proposed([[1, 2]] * 10)
        stats.record_verified([[1, 2, 3]] * 8 + [[1, 3]] + [[3]])
    rates = stats.accept_rates()
    np.testing.assert_allclose(rates[:2], [0.9, 0.8], atol=0.01)
    # Positions 3 and 4 were never drafted: priced at the conditional acceptance seen at
    # position 2 (~0.89), not at the fixed 0.7 ** j (0.34, 0.24) that kept the policy at
    # two drafts.
    np.testing.assert_allclose(rates[2:], [0.8 * 0.89, 0.8 * 0.89**2], atol=0.02)
    policy = DraftPolicy(4, TABLE, stats, margin=0.03)
    assert policy.draft_length(1) == 4
    for _ in range(40):  # the fourth draft tried and never kept: the evidence wins
        stats.record_proposed([[1, 2, 3, 4]] * 10)
        stats.record_verified([[1, 2, 3, 9]] * 8 + [[1, 2, 9]] * 2)
    assert stats.accept_rates()[3] < 0.05 and policy.draft_length(1) == 3


def test_a_rejected_first_draft_does_not_price_the_deeper_drafts_low():
    stats = AcceptanceStats(num_positions=4)
    stats.record_proposed([[1, 2]])
    stats.record_verified([[3]])  # the first draft rejected: the second was never tried
    assert stats.tried.tolist() == [1, 0, 0, 0]
    c = stats.conditional_rates()
    assert c[0] == pytest.approx(4 * 0.7 / 5)
    np.testing.assert_allclose(c[1:], 0.7)  # the prior: nothing was learnt past the first
    # Each further rejected first draft lowers the first position alone.
    for _ in range(10):
        stats.record_proposed([[1, 2]])
        stats.record_verified([[3]])
    np.testing.assert_allclose(stats.conditional_rates()[1:], 0.7)
    assert stats.accept_rates()[0] < 0.3


def test_policy_drafts_what_pays_at_each_batch_size():
    stats = _seen([90, 80, 60, 40])
    policy = DraftPolicy(4, TABLE, stats, margin=0.03)
    # E = 1.9, 2.7, 3.3, 3.7 tokens for k = 1..4.
    assert policy.draft_length(1) == 4  # 3.7 / 1.3
    assert policy.draft_length(8) == 2  # 2.7 / 1.6 beats 3.3 / 2.0, 3.7 / 2.4, 1.9 / 1.3
    assert policy.draft_length(32) == 1  # 1.9 / 1.8 = 1.06 beats 2.7 / 2.6
    assert policy.draft_length(64) == 0  # nothing beats plain by the margin
    # The default margin also covers a speculating engine's own overhead: 1.06x is not a gain.
    assert DraftPolicy(4, TABLE, stats).draft_length(32) == 0
    stats.accepted[:] = [10, 0, 0, 0]  # a checkpoint that does not fit the traffic
    stats.tried[:] = [100, 10, 0, 0]
    got = [policy.draft_length(1) for _ in range(2 * policy.probe_every)]
    # Off, but one step in probe_every probes with the prior's choice (old evidence halved);
    # the idle step at batch 64 above counts towards the first.
    assert got.count(0) == 2 * policy.probe_every - 2 and got[policy.probe_every - 2] == 4
    assert stats.proposed[0] == 25 and stats.tried[0] == 25  # halved at each probe


def test_probes_cost_at_most_their_budget_of_the_idle_steps():
    # A checkpoint whose drafts are not accepted, where a drafting step is dear (2.3 plain
    # steps: batch 4 on AVX2): probes are spaced so that their extra over plain steps stays
    # within explore_budget of the steps between them; cheap probes keep probe_every.
    dear = StepCostTable("test", (1,), {k: (2.3,) for k in range(1, 5)}, "test")
    stats = AcceptanceStats(4)
    stats.tried[:] = [40, 2, 0, 0]
    stats.accepted[:] = [2, 0, 0, 0]
    policy = DraftPolicy(4, dear, stats, margin=0.0)
    assert policy.best_length(1) == 0
    probe = policy.best_length(1, stats.prior_rates(), steady=True)
    assert probe == 4 and policy.probe_interval(1, probe) == 130  # 1.3 / 0.01
    got = _serve(policy, 10 * 130, kept_rate=0.0)  # every draft rejected
    assert [i for i, k in enumerate(got) if k] == [130 * n - 1 for n in range(1, 11)]
    extra = sum(dear.ratio(1, k) - 1.0 for k in got if k)
    assert extra <= policy.explore_budget * len(got)
    cheap = DraftPolicy(4, TABLE, AcceptanceStats(4))
    assert cheap.probe_interval(1, 4) == cheap.probe_every


def _serve(policy: DraftPolicy, steps: int, kept_rate: float, batch: int = 1) -> list:
    """``steps`` decisions at ``batch``, each request keeping its drafts at ``kept_rate``
    (0: none; 1: all)."""
    got = []
    for _ in range(steps):
        k = policy.draft_length(batch)
        got.append(k)
        n = rows_of(k)
        policy.stats.record_proposed([[7] * n] * batch)
        policy.stats.record_verified([[7] * (1 + round(n * kept_rate))] * batch)
    return got


def test_a_probes_run_is_what_exploring_costs():
    # Drafting steps cheap (1.07-1.25 plain steps: batch 1 on AVX-512), drafts never
    # accepted: each probe halves the evidence, and the halved estimate keeps drafting
    # for several steps. The next probe waits until the run's loss is within the budget.
    cheap = StepCostTable("test", (1,), {1: (1.07,), 2: (1.07,), 3: (1.16,), 4: (1.25,)}, "test")
    policy = DraftPolicy(4, cheap, AcceptanceStats(4))
    got = _serve(policy, 3000, kept_rate=0.0)
    runs = []  # (start, length) of each run of drafting steps
    for i, k in enumerate(got):
        if k and (i == 0 or not got[i - 1]):
            runs.append([i, 0])
        if k:
            runs[-1][1] += 1
    probes = runs[1:]  # the first run is a fresh engine's prior drafting
    assert len(probes) >= 5 and all(length > 5 for _, length in probes)
    loss = policy.probe_loss[1]
    assert loss > 0.5  # ~10 steps at ~0.1 plain steps each
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(probes, probes[1:])]
    # each run's loss sets the gap after it (runs differ by a step or so)
    assert all(abs(gap - loss / policy.explore_budget) < 20 for gap in gaps), (gaps, loss)
    extra = sum(cheap.ratio(1, rows_of(k)) - 1.0 for k in got[probes[0][0] :] if k)
    share = extra / (len(got) - probes[0][0])
    assert share <= 1.1 * policy.explore_budget, share  # 1.3% with probes probe_every apart
    # A probe's run whose drafts are kept costs nothing: probes stay probe_every apart.
    stats = AcceptanceStats(4)
    policy = DraftPolicy(4, cheap, stats)
    policy._probe_bucket, policy._probe_loss = 1, 0.0
    _serve(policy, 3, kept_rate=1.0)
    stats.tried[:], stats.accepted[:] = [400, 20, 0, 0], [4, 0, 0, 0]  # traffic turned
    _serve(policy, 1, kept_rate=0.0)
    assert policy.probe_loss == {1: 0.0}
    assert policy.probe_interval(1, 4) == policy.probe_every


class _FlippableCost:
    """Every drafting step costs ``ratio`` plain steps (changed by the test)."""

    def __init__(self, ratio: float):
        self.value = ratio

    def ratio(self, batch_size: int, k) -> float:
        return 1.0 if k == 0 else self.value


def _idle_policy(cost, **kw) -> DraftPolicy:
    """A policy whose evidence says drafting does not pay at 3 plain steps a drafting step
    (the prior says it would at 1.05), with its pricing counted in ``policy.priced``."""
    stats = AcceptanceStats(4)
    stats.tried[:] = [40, 2, 0, 0]
    stats.accepted[:] = [20, 1, 0, 0]
    policy = DraftPolicy(4, cost, stats, **kw)
    policy.priced = []
    best = policy.best_length

    def counted(batch_size, rates=None, steady=False):
        policy.priced.append((batch_size, rates is None))
        return best(batch_size, rates, steady)

    policy.best_length = counted
    return policy


def test_idle_steps_reuse_their_pricing_while_what_it_read_holds():
    policy = _idle_policy(_FlippableCost(3.0))
    got = [policy.draft_length(1) for _ in range(40)]
    assert not any(got)
    # priced at steps 0, 17 and 34 (each pricing held for reprice_every idle steps)
    assert policy.priced == [(1, True)] * 3
    policy.draft_length(2)  # another batch size: priced at once
    policy.draft_length(2)
    policy.stats.forget(0.5)  # new evidence: priced at once
    policy.draft_length(2)
    assert policy.priced[3:] == [(2, True), (2, True)]
    # The prior's choice, priced from probe_every idle steps on, is held alike.
    policy = _idle_policy(_FlippableCost(3.0), probe_every=4)
    got = [policy.draft_length(1) for _ in range(17)]
    assert policy.priced == [(1, True), (1, False)]  # the prior at the 4th step, once
    assert not any(got)  # a probe at 3 plain steps waits 200 idle steps (1% budget)


def test_an_idle_engine_drafts_once_its_pricing_is_renewed():
    # Drafting starts paying (steps got cheaper) at the 6th idle step: an engine reusing
    # its pricing sees it when that pricing is renewed, one that prices every step at once.
    for reprice_every, first in ((16, 17), (0, 5)):
        cost = _FlippableCost(3.0)
        policy = _idle_policy(cost, reprice_every=reprice_every)
        got = []
        for step in range(30):
            if step == 5:
                cost.value = 1.05
            got.append(policy.draft_length(1))
        assert got.index(next(k for k in got if k)) == first, reprice_every


def test_lookup_length_carries_the_last_entry():
    assert [lookup_length([0, 4, 4, 2], b) for b in (1, 3, 99)] == [4, 2, 2]


def test_user_schedule_is_read_by_vllms_validator():
    from vllm_specstream.patches.vllm_schedule import schedule_lookup

    lookup = schedule_lookup([(1, 2, 4), (5, 8, 2), (9, 9, 1)], 12, 3)
    # 3, 4 carry (1, 2)'s length (capped at k = 3); past the last range its length holds.
    assert lookup[1:] == [3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1]
    for bad, words in [([(2, 4, 1)], "start at 1"), ([(1, 4, 1), (3, 8, 1)], "non-overlapping")]:
        with pytest.raises(ValueError, match=f"num_speculative_tokens_per_batch_size=.*{words}"):
            schedule_lookup(bad, 8, 4)


def test_speculative_config_adaptive_switch():
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(3)
    fixed = speculative_config(3, adaptive=False)["num_speculative_tokens_per_batch_size"]
    assert fixed == [(1, 1 << 16, 3)]
    mine = [(1, 1, 2), (2, 64, 0)]
    cfg = speculative_config(3, adaptive=False, num_speculative_tokens_per_batch_size=mine)
    assert cfg["num_speculative_tokens_per_batch_size"] == mine


def _vllm_config(k=4, schedule=None, model=PROPOSER, method="custom_class", **fields):
    """An engine config whose ``additional_config["specstream"]`` holds ``fields``."""
    spec = SimpleNamespace(
        num_speculative_tokens=k,
        num_speculative_tokens_per_batch_size=schedule,
        model=model,
        method=method,
    )
    return SimpleNamespace(
        speculative_config=spec,
        scheduler_config=SimpleNamespace(max_num_seqs=64),
        additional_config={"specstream": fields},
    )


def test_options_are_read_once_and_name_the_bad_field():
    config = _vllm_config(3, [(1, 4, 2)], stream_dtype="BFloat16", draft_min_prob=0.25)
    options = read_options(config, {})
    assert options.stream_dtype == "bfloat16" and options.draft_min_prob == 0.25
    assert options.schedule == ((1, 4, 2),) and options.num_speculative_tokens == 3
    assert read_options(None, {}).draft_min_prob == 0.0  # speculation off: rule off
    assert read_options(_vllm_config(3), {}).draft_min_prob == 0.0  # unset: rule off
    for name, bad in [("stream_dtype", "fp8"), ("draft_min_prob", 1), ("draft_min_prob", "high")]:
        with pytest.raises(ConfigError, match=rf"\['specstream'\]\['{name}'\]={bad!r}"):
            read_options(_vllm_config(**{name: bad}), {})


def test_one_engine_config_is_read_once():
    """The model and the proposer of one worker share one read of the engine config;
    another engine config reads its own fields."""
    config = _vllm_config(3, draft_min_prob=0.25)
    first = read_options(config, {})
    assert first.draft_min_prob == 0.25 and read_options(config, {}) is first
    other = read_options(_vllm_config(3, draft_min_prob=0.5), {})
    assert other is not first and other.draft_min_prob == 0.5


def test_other_speculative_methods_leave_the_streams_off():
    # vLLM's own methods (and other proposer classes) on a specstream checkpoint: the model
    # runs as in plain decoding, no stream pass, no error.
    for method, model in [
        ("ngram", None),
        ("suffix", None),
        ("medusa", "/heads"),
        ("custom_class", "my.Proposer"),
    ]:
        options = read_options(_vllm_config(4, [(1, 4, 2)], model, method), {})
        assert options.num_speculative_tokens == 0 and options.schedule is None, method
        assert options.placement is None
    assert read_options(_vllm_config(4), {}).num_speculative_tokens == 4


def test_placement_is_the_engine_field():
    assert read_options(_vllm_config(4), {}).placement is None  # the model's default
    for placement in ("window", "accepted"):
        assert read_options(_vllm_config(4, placement=placement), {}).placement == placement
    with pytest.raises(ConfigError, match=r"\['placement'\]='middle'"):
        read_options(_vllm_config(4, placement="middle"), {})


class _Target:
    """Just enough of the model for ``propose``: a stash with one decode row per request."""

    spec_config = None
    no_stash_reason = None
    window_streams = 4

    def __init__(self, num_requests: int):
        n = num_requests
        qsl = torch.arange(n + 1)
        self.forward_step = 1
        self.stash = StreamStash(
            step=1,
            batch=ForwardBatch(qsl, torch.full((n,), 6), torch.zeros(n, 1), torch.full((n,), 5)),
            input_ids=None,
            draft_table=torch.tensor([[11, 12, 13, 14]] * n),
        )

    def set_placement(self, placement):
        self.placement = placement

    def default_placement(self):
        return "accepted"

    def take_stash(self):
        stash, self.stash = self.stash, None
        return stash

    def draft_at(self, stash, rows, indices, num_streams=0):
        return stash.draft_table


def _propose(proposer, num_requests):
    proposer.load_model(_Target(num_requests))
    # Each request: position 5 decoded, 1 token sampled -> 7 tokens, anchor at its own row.
    return proposer.propose([[1]] * num_requests, np.full(num_requests, 7), None)


def test_proposer_follows_the_users_schedule():
    proposer = SpecStreamProposer(_vllm_config(4, [(1, 1, 4), (2, 8, 2), (9, 64, 0)]))
    assert _propose(proposer, 1) == [[11, 12, 13, 14]]
    assert _propose(proposer, 3) == [[11, 12]] * 3
    assert _propose(proposer, 16) == [[]] * 16
    with pytest.raises(ValueError, match="non-overlapping"):
        SpecStreamProposer(_vllm_config(4, [(1, 4, 4), (2, 8, 2)]))


def test_proposer_policy_learns_from_what_was_kept():
    proposer = SpecStreamProposer(_vllm_config(4))
    proposer.policy.cost = TABLE
    assert _propose(proposer, 1) == [[11, 12, 13, 14]]  # the prior: drafting pays alone
    assert proposer.target.window_streams == 4
    drafted = []
    for _ in range(60):  # vLLM rejects every draft: only the bonus token comes back
        proposer.load_model(_Target(1))
        drafted.append(proposer.propose([[1]], np.full(1, 7), None) != [[]])
    assert drafted[:5] == [True] * 5 and not any(drafted[-30:])
    assert proposer.target.window_streams == 0  # the window placement runs no streams


class _WindowTarget(_Target):
    """A window engine's model: the forward ran ``streams`` streams at its window (their
    columns of the draft table), or none (it kept its MSA input: ``draft_at`` runs them)."""

    def __init__(self, n: int, streams: int):
        super().__init__(n)
        table = torch.full((n, 4), -1)
        table[:, :streams] = torch.tensor([11, 12, 13, 14])[:streams]
        self.stash.draft_table = table
        if streams == 0:
            self.stash.msa_input = torch.zeros(n, 8)
        self.ran_at_anchors: list[int] = []

    def default_placement(self):
        return "window"

    def draft_at(self, stash, rows, indices, num_streams=0):
        if stash.msa_input is not None:
            self.ran_at_anchors.append(num_streams)
            stash.draft_table[:, :num_streams] = torch.tensor([11, 12, 13, 14])[:num_streams]
            stash.msa_input = None
        return stash.draft_table


def test_window_engine_drafts_right_after_a_step_without_streams():
    # A step that drafted nothing ran no window streams in the next forward; the step after
    # it drafts all the same: its streams run at the requests' anchors.
    proposer = SpecStreamProposer(_vllm_config(4, [(1, 64, 2)]))
    target = _WindowTarget(2, streams=0)
    proposer.load_model(target)
    assert proposer.propose([[1]] * 2, np.full(2, 7), None) == [[11, 12]] * 2
    assert target.ran_at_anchors == [2]
    target = _WindowTarget(2, streams=2)  # the streams ran in the forward: not again
    proposer.load_model(target)
    assert proposer.propose([[1]] * 2, np.full(2, 7), None) == [[11, 12]] * 2
    assert target.ran_at_anchors == []


def test_steps_are_timed_under_a_chain_only_when_their_drafts_came_as_it_makes_them():
    # Window placement: a step's drafts come from the streams the last forward ran at its
    # window, or, where it ran none, from streams run at the anchors. A step is timed as a
    # chain of k only when its drafts came from k window streams, as an anchored chain only
    # when they came from the anchors (the step verifying them runs no window streams), as
    # a window entry when a window chain's drafts came from the anchors.
    a2 = AnchoredChain(2)
    proposer = SpecStreamProposer(_vllm_config(4))
    target = _WindowTarget(1, 4)
    proposer.load_model(target)
    assert proposer.policy.anchored == tuple(AnchoredChain(k) for k in range(1, 5))
    timed, lengths, windows = [], [], []
    for k in [2, 4, 4, 0, 3, 2, a2, a2, 2, 2]:
        # this step's forward ran the streams the last call asked for (4 at first)
        target.stash = _WindowTarget(1, target.window_streams).stash
        proposer.draft_length = lambda batch_size, k=k: k
        lengths.append(len(proposer.propose([[1]], np.full(1, 7), None)[0]))
        timed.append(proposer.step_timer.last_k)
        windows.append(target.window_streams)
    assert lengths == [2, 2, 4, 0, 3, 2, 2, 2, 2, 2]
    assert windows == [2, 4, 4, 0, 3, 2, 0, 0, 2, 2]
    assert timed == [2, None, 4, 0, WindowEntry(3), 2, None, a2, WindowEntry(2), 2]
    # An accepted-placement engine drafts every chain from the anchors: no anchored twins.
    accepted = SpecStreamProposer(_vllm_config(4))
    accepted.load_model(_Target(1))
    assert accepted.policy.anchored == ()


def test_confident_drafts_cut_at_the_cumulative_probability():
    tokens = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]])
    top_prob = torch.tensor(
        [[0.9, 0.9, 0.9, 0.9], [0.4, 0.99, 0.99, 0.99], [0.99, 0.3, 0.99, 0.99]]
    )
    # Cumulative: .9 .81 .73 .66 | .4 ... | .99 .297 ...: a confident stream after an
    # unconfident one does not come back.
    got = confident_drafts(tokens, top_prob, 0.7)
    assert got.tolist() == [[11, 12, 13, -1], [-1] * 4, [31, -1, -1, -1]]
    assert torch.equal(confident_drafts(tokens, top_prob, 0.0), tokens)
    # The proposer hands out each row up to its first -1 (and at most k).
    table = torch.cat([torch.full((1, 4), -1), got])
    assert drafts_at(4, [0, 1, 2, 3], [1, 2, 3, 0], table, k=2) == [[11, 12], [], [31], []]


def _measured(plain_s: float, k_s: dict[int, float], batch: int = 1, n: int = 8) -> MeasuredCost:
    cost = MeasuredCost(TABLE, min_samples=n)
    for _ in range(n):
        cost.record(batch, 0, plain_s)
        for k, seconds in k_s.items():
            cost.record(batch, k, seconds)
    return cost


def test_measured_step_times_correct_the_table():
    # Batch 1, table 1.2 for k = 2; this engine's steps say 1.5 (0.075 s over 0.05 s).
    cost = _measured(0.05, {2: 0.075})
    assert cost.correction(1) == pytest.approx(1.25)
    assert cost.ratio(1, 2) == pytest.approx(1.5)
    assert cost.ratio(1, 4) == pytest.approx(1.3 * 1.25)  # unmeasured k: scaled alike
    assert cost.ratio(1, 0) == 1.0
    assert cost.correction(8) == 1.0  # another bucket: nothing measured, the table
    assert batch_bucket(1) == 1 and batch_bucket(7) == 4 and batch_bucket(16) == 16
    few = MeasuredCost(TABLE, min_samples=8)
    few.record(1, 2, 0.075)
    assert few.correction(1) == 1.0 and few.needs_plain_steps(1)
    assert not cost.needs_plain_steps(1)


def test_an_untimed_bucket_costs_between_the_timed_buckets_around_it():
    # A step's cost over a plain one grows with the batch in every table: a choice timed
    # at a smaller bucket bounds an untimed bucket's cost from below, at a larger from above.
    low = MeasuredCost(TABLE, min_samples=2)
    high = MeasuredCost(TABLE, min_samples=2)
    for _ in range(2):
        low.record(1, 0, 0.05)
        low.record(1, 2, 0.08)  # batch 1: 1.6
        high.record(8, 0, 0.06)
        high.record(8, 2, 0.078)  # batch 8: 1.3
    assert low.correction(2) == 1.0 and TABLE.ratio(2, 2) < 1.3  # the table: 1.26
    assert low.ratio(2, 2) == pytest.approx(1.6)  # raised to batch 1's
    assert low.ratio(1, 2) == pytest.approx(1.6)  # a timed bucket: its own
    assert low.ratio(16, 2) == pytest.approx(TABLE.ratio(16, 2))  # the table's is above
    assert low.ratio(2, 4) == pytest.approx(TABLE.ratio(2, 4))  # k = 4 timed nowhere
    assert high.ratio(4, 2) == pytest.approx(1.3)  # lowered to batch 8's (table: 1.37)
    assert high.ratio(2, 2) == pytest.approx(TABLE.ratio(2, 2))  # the table's is below


def test_a_batch_tail_is_priced_by_the_batch_1_steps_timed_before_it():
    # DialogSum-like acceptance (0.38 / 0.20 / 0.11 / 0.07): by the table, 2 drafts pay at
    # batch 2 (1.58 tokens for 1.26 plain steps). Once batch 1 has timed every chain at
    # 1.6 plain steps, a batch of 2 (the tail of a batch of 4) drafts nothing.
    stats = _seen([38, 20, 11, 7])
    cost = MeasuredCost(TABLE, min_samples=2)
    policy = DraftPolicy(4, cost, stats)
    assert policy.best_length(2) == 2
    for _ in range(2):
        cost.record(1, 0, 0.05)
        for k in (1, 2, 3, 4):
            cost.record(1, k, 0.08)
    assert policy.best_length(1) == 0 and policy.best_length(2) == 0


#: The AVX2 window table's batch-1 row (measured on a checkpoint of 8 MSA layers): 4 drafts
#: at 2.06 plain steps, where a checkpoint of 15 costs 1.83.
PRICEY_FOUR = StepCostTable("test", (1,), {1: (1.45,), 2: (1.45,), 4: (2.06,)}, "test")


def test_policy_times_the_chain_lengths_that_might_pay_and_drafts_the_best_timed():
    # E2E-like acceptance (3.29 tokens per step with 4 drafts). Timed 2 drafts at the
    # table's 1.45 (1.66x); by the table 3 drafts give 1.64x, 4 give 1.60x, 1 gives 1.23x.
    stats = _seen([78, 62, 48, 41])
    cost = MeasuredCost(PRICEY_FOUR, min_samples=2)
    for _ in range(2):
        cost.record(1, 0, 0.05)
        cost.record(1, 2, 0.0725)
    policy = DraftPolicy(4, cost, stats, timing_probe_every=4, chain_probe_steps=2)
    assert policy.best_length(1) == 2
    # One step in four starts a two-step probe of the likeliest untimed length.
    assert [policy.draft_length(1) for _ in range(10)] == [2, 2, 2, 3, 3, 2, 2, 2, 3, 3]
    for _ in range(2):
        cost.record(1, 3, 0.09)  # dearer than the table said: 1.60x
    assert [policy.draft_length(1) for _ in range(5)] == [2, 2, 2, 4, 4]
    for _ in range(2):
        cost.record(1, 4, 0.0915)  # cheaper: 1.83 plain steps, 1.80x
    assert cost.ratio(1, 4) == pytest.approx(1.83)  # its own time, not the table's
    assert policy.best_length(1) == 4
    # One draft stays untimed: at 1.23x it is out of reach of 1.80x, never probed.
    assert [policy.draft_length(1) for _ in range(12)] == [4] * 12


def test_window_engine_drafts_from_the_anchors_where_window_streams_are_dear():
    # The AVX2 tables, E2E-like acceptance (3.29 tokens with 4 drafts). At batch 1 window
    # streams are the cheaper for 2 drafts; at batch 4, 4 drafts cost 4.24 plain steps with
    # window streams (4 streams at 5 positions), 2.26 at the anchors: without anchored chains
    # no length beats plain decoding by the margin there.
    window = table_for("window", "avx2")
    accepted = table_for("accepted", "avx2")
    stats = _seen([78, 62, 48, 41])
    anchored = tuple(AnchoredChain(k) for k in range(1, 5))
    policy = DraftPolicy(4, MeasuredCost(window, anchored_table=accepted), stats, anchored=anchored)
    assert policy.cost.ratio(1, 2) < policy.cost.ratio(1, AnchoredChain(2))
    assert policy.best_length(4) == AnchoredChain(4)
    assert policy.cost.ratio(4, AnchoredChain(4)) == pytest.approx(2.26)
    assert DraftPolicy(4, MeasuredCost(window), stats).best_length(4) == 0
    assert "k4-anchored:" in policy.summary(4)


def test_window_streams_of_a_forward_that_requests_joined_follow_its_batch_size():
    # A proposer call chooses the window streams of the next forward for its own batch; when
    # requests joined that forward (their prefills), the streams ride along only if the
    # choice at the forward's size would draft from the window: on the AVX2 tables this
    # acceptance drafts 2 from the window at batch 1, from the anchors at 4 (no window
    # streams then), nothing at 16. A forward of no more requests keeps the streams chosen.
    from vllm_specstream.model_executor.specstream import SpecStreamMixin

    window = table_for("window", "avx2")
    accepted = table_for("accepted", "avx2")
    proposer = SpecStreamProposer(_vllm_config(4))
    target = _WindowTarget(1, streams=4)
    proposer.load_model(target)
    proposer.policy.cost = MeasuredCost(window, anchored_table=accepted)
    proposer.policy.stats = _seen([90, 60, 30, 10])
    assert target.window_streams_at == proposer.window_streams_at
    assert proposer.propose([[1]], np.full(1, 7), None) == [[11, 12]]
    assert target.window_streams == 2 and target.window_streams_batch == 1

    def forward_of(n: int) -> int:
        model = SimpleNamespace(**vars(target))  # the model as the proposer left it
        qsl = torch.arange(n + 1)
        batch = ForwardBatch(qsl, torch.full((n,), 6), torch.zeros(n, 1), torch.full((n,), 5))
        SpecStreamMixin._streams_for(model, batch)
        return model.window_streams

    assert forward_of(1) == 2
    assert isinstance(proposer.policy.best_length(4, steady=True), AnchoredChain)
    assert proposer.policy.best_length(16, steady=True) == 0
    assert forward_of(4) == 0 and forward_of(16) == 0
    # A user's schedule: its draft length at the forward's size.
    proposer = SpecStreamProposer(_vllm_config(4, [(1, 2, 4), (3, 64, 0)]))
    proposer.load_model(target)
    assert proposer.window_streams_at(2) == target.window_streams
    assert proposer.window_streams_at(3) == 0


def _dialogsum_window_engine(anchored_s: float) -> DraftPolicy:
    """A window engine's policy with the step times of DialogSum at batch 1 on AVX2 (plain
    56.4 ms, 2 window drafts 90.7 ms) and anchored chains at ``anchored_s``; no entry timed."""
    window = table_for("window", "avx2")
    accepted = table_for("accepted", "avx2")
    cost = MeasuredCost(window, anchored_table=accepted, min_samples=2)
    times = {0: 0.0564, 1: 0.080, 2: 0.0907, 3: 0.100, 4: 0.110}
    times |= {AnchoredChain(k): anchored_s for k in range(1, 5)}
    for _ in range(2):
        for k, seconds in times.items():
            cost.record(1, k, seconds)
    anchored = tuple(AnchoredChain(k) for k in range(1, 5))
    return DraftPolicy(4, cost, _seen([65, 45, 35, 20]), anchored=anchored, probe_every=4)


def test_window_drafts_after_a_forward_without_window_streams_cost_an_entry_step():
    # Inside a run of window drafts, 3 drafts give 2.45 tokens for 1.77 plain steps. Right
    # after a forward that ran no window streams the same choice also runs the streams at
    # the anchors now: an entry step, priced as the anchored pass on top of the window step
    # until timed (2.04 + 1.77 - 1), then as timed. The policy then drafts from the anchors
    # where those pay, or nothing.
    policy = _dialogsum_window_engine(anchored_s=0.115)
    cost = policy.cost
    assert policy.best_length(1) == 3
    policy.window_idle = True
    assert cost.ratio(1, WindowEntry(3)) == pytest.approx(
        cost.ratio(1, AnchoredChain(3)) + cost.ratio(1, 3) - 1
    )
    assert policy.step_cost(1, 3) == pytest.approx(2.81, abs=0.01)
    assert policy.step_cost(1, 3, steady=True) == cost.ratio(1, 3)
    assert policy.best_length(1) == AnchoredChain(4)  # 2.65 tokens for 2.04 steps
    for _ in range(2):
        cost.record(1, WindowEntry(3), 0.0564 * 1.2)  # timed: its own ratio
    assert policy.step_cost(1, 3) == pytest.approx(1.2)
    assert policy.best_length(1) == 3
    assert "k3-entry:" in policy.summary(1)


def test_a_window_entry_is_paid_once_per_run_of_drafting_steps():
    # The entry's extra over a window step (1.04 plain steps until timed: 2.81 - 1.77) is
    # spread over the steps the run is expected to last: the run under way, or the mean of
    # the runs that ended. From the tenth step of a run of anchored drafts (2.65 tokens for
    # 2.04 steps) window drafts (2.45 tokens for 1.77 steps inside a run) pay more:
    # 2.45 / (1.77 + 1.04 / 10) > 2.65 / 2.04 > 2.45 / (1.77 + 1.04 / 9).
    policy = _dialogsum_window_engine(anchored_s=0.115)
    policy.window_idle = True
    assert policy.run_horizon() == 1.0  # a fresh engine pays the entry whole
    choices = [policy.draft_length(1) for _ in range(12)]
    switch = choices.index(3)
    assert switch == 10 and set(choices[:switch]) == {AnchoredChain(4)}
    # The run ends where nothing pays; the mean run follows it.
    policy.stats = _seen([5, 0, 0, 0])
    assert policy.draft_length(1) == 0 and policy.run_steps == 0
    assert policy.run_length == pytest.approx(0.75 * 1 + 0.25 * 12)
    window, entry = policy.cost.ratio(1, 3), policy.cost.ratio(1, WindowEntry(3))
    assert policy.step_cost(1, 3) == pytest.approx(window + (entry - window) / 3.75)
    policy.run_length = 100.0
    assert policy.run_horizon() == policy.max_run_horizon


def test_an_entry_step_that_does_not_pay_keeps_the_engine_idle_but_probing():
    # Anchored passes as dear as on a checkpoint of 15 MSA layers at batch 1 (2.6 plain
    # steps): after an idle forward nothing pays this step, though window drafts would once
    # under way; an idle step now and then still drafts (chosen as under way, so it is
    # not ruled out by its entry), spaced by what that probe step costs.
    policy = _dialogsum_window_engine(anchored_s=0.147)
    policy.window_idle = True
    assert policy.best_length(1) == 0 and policy.best_length(1, steady=True) == 3
    every = policy.probe_interval(1, 3)
    assert every > policy.probe_every  # an entry step: dearer than probe_every allows
    choices = [policy.draft_length(1) for _ in range(every)]
    assert set(choices[:-1]) == {0} and choices[-1] == 3


def test_tensor_parallel_ranks_choose_by_the_tables_alone():
    # Every rank's proposer chooses on its own and all must choose alike: no rank's clock
    # enters the choice (no timed steps, no timing probes, no calibration steps).
    config = _vllm_config(4)
    config.parallel_config = SimpleNamespace(tensor_parallel_size=3)
    proposer = SpecStreamProposer(config)
    proposer.load_model(_WindowTarget(1, 4))
    cost = proposer.policy.cost
    assert not cost.measure
    for _ in range(8):
        cost.record(1, 0, 0.05)
        cost.record(1, 4, 0.06)
    assert cost.times == {} and not cost.timed(1, 4)
    choices = {proposer.policy.draft_length(1) for _ in range(64)}
    assert choices == {proposer.policy.best_length(1)}


def test_policy_stops_drafting_where_measured_steps_say_it_does_not_pay():
    stats = _seen([30, 10, 3, 1])  # 1.30 tokens per step with k = 1
    table_policy = DraftPolicy(4, TABLE, stats)
    assert table_policy.best_length(1) == 1  # the table: 1.30 / 1.1 = 1.18x
    measured = DraftPolicy(4, _measured(0.05, {1: 0.07}), stats)  # measured k = 1: 1.4
    assert measured.best_length(1) == 0


def test_policy_takes_plain_steps_to_measure_against():
    stats = AcceptanceStats(num_positions=4)  # the prior: drafting pays
    cost = MeasuredCost(TABLE, min_samples=2)
    policy = DraftPolicy(4, cost, stats, calibrate_every=4)
    cost.record(1, 4, 0.07)
    lengths = [policy.draft_length(1) for _ in range(8)]
    assert lengths.count(0) == 2 and lengths[3] == 0  # one step in four drafts nothing
    cost.record(1, 0, 0.05)
    cost.record(1, 0, 0.05)
    assert 0 not in [policy.draft_length(1) for _ in range(8)]  # enough plain steps now


def test_step_timer_files_only_decode_steps_of_one_batch():
    cost = MeasuredCost(TABLE, min_samples=1)
    now = [0.0]
    timer = StepTimer(clock=lambda: now[0])
    ids = np.arange(1000).reshape(2, 500)  # token_ids_cpu: row r holds 500r, 500r + 1, ...

    def call(seconds, tokens, k_next, drafted=True):
        now[0] += seconds
        timer.record(cost, [[1]] * len(tokens), np.array(tokens), ids)
        timer.proposed(k_next if drafted else 0, k_next)

    call(0.0, [10, 20], 2)
    call(0.1, [13, 21], 2)  # +3 and +1 tokens with k = 2: a decode step of one batch
    call(0.2, [14, 22], 0)
    call(0.05, [15, 23], 2, drafted=False)  # plain step; then streams ran but no drafts
    call(0.3, [16, 24], 2)  # not filed: the drafts did not match the streams run
    call(0.1, [30, 24], 2)  # not filed: row 0 grew by 14 (a prefill, another request)
    call(0.1, [31], 2)  # not filed: the batch changed
    assert {key: list(v) for key, v in cost.times.items()} == {
        (2, 2): [pytest.approx(0.1), pytest.approx(0.2)],
        (2, 0): [pytest.approx(0.05)],
    }


def test_trees_weighed_are_template_prefixes_of_a_few_widths():
    assert tree_widths(16, 4) == [6, 8, 12, 16]  # the paper's Figure 5 sizes
    assert tree_widths(8, 4) == [6, 8]
    assert tree_widths(6, 4) == [6] and tree_widths(5, 4) == [5]
    assert tree_widths(9, 3) == [5, 6, 9]
    assert tree_choices(8, 4, prune=False) == (TreeChoice(6), TreeChoice(8))
    assert tree_choices(6, 4, prune=True) == (TreeChoice(6), TreeChoice(6, prune=True))
    assert str(TreeChoice(8, prune=True)) == "tree8-pruned" and rows_of(TreeChoice(6)) == 6
    assert rows_of(3) == 3


def test_tree_prior_sums_the_chance_each_node_is_on_the_accepted_path():
    from vllm_specstream.streams.draft_trees import tree_template

    rates = np.array([0.5, 0.25])  # the top-1 accepted with 1/2 at each depth
    t = tree_template(2, 2)  # (0), (0,0), (1), then (0,1), (1,0), (1,1)
    assert t.rank_path(2) == (1,) and t.num_nodes == 6

    def prior(n):
        return template_tokens(t.depths[:n], t.ranks[:n], t.parents[:n], rates)

    assert prior(2) == pytest.approx(tokens_per_step(rates, 2))  # the chain: 1.75
    # (1) catches half of what (0) misses: 0.25; (0,1) 0.5 x 0.25; (1,0) 0.25 x 0.5;
    # (1,1) 0.25 x 0.25.
    assert prior(3) == pytest.approx(1.75 + 0.25)
    assert prior(6) == pytest.approx(1.75 + 0.25 + 0.125 + 0.125 + 0.0625)
    # The top-2, 8-node tree over the full chain at a real-task adapter's acceptance: about
    # the gain the reference decoder measured on them (1.46-1.50).
    t8 = tree_template(4, 2, max_nodes=8)
    low = np.array([0.55, 0.3, 0.15, 0.07])
    gain = (template_tokens(t8.depths, t8.ranks, t8.parents, low) - 1) / low.sum()
    assert 1.4 < gain < 1.55


def test_tree_estimate_starts_at_its_prior_and_follows_tree_rows():
    tree = TreeStats(decay=1.0, prior_weight=4.0)
    assert tree.expected_tokens(2.5) == pytest.approx(2.5)
    tree.record([])  # a step without tree rows changes nothing
    assert tree.expected_tokens(2.5) == pytest.approx(2.5)
    tree.record([3, 3, 3, 3] * 25)  # 100 tree rows keeping 3 drafts each
    assert tree.expected_tokens(2.5) == pytest.approx(1 + (300 + 6) / 104)


T6, T8, T8P = TreeChoice(6), TreeChoice(8), TreeChoice(8, prune=True)


def _tree_policy(trees: dict, chain_s: float = 0.07, table=TABLE, **kw) -> DraftPolicy:
    """k_max 4; trees of 6 and 8 nodes (8 also pruned) of the top-2 template; plain steps
    0.05 s, chains of 4 ``chain_s``, shorter ones timed as the table's shape says; chains
    accept 60/40/20/10 in 100 (2.3 tokens per step with k = 4). ``trees`` maps a tree to
    (its step seconds, 0: untimed; the drafts its rows keep, None: no evidence)."""
    from vllm_specstream.streams.draft_trees import tree_template

    stats = _seen([60, 40, 20, 10])
    cost = MeasuredCost(table, direct=frozenset((T6, T8, T8P)), min_samples=4)
    for _ in range(4):
        cost.record(1, 0, 0.05)
        for k in range(1, 5):
            cost.record(1, k, chain_s * table.ratio(1, k) / table.ratio(1, 4))
        for tree, (seconds, _) in trees.items():
            if seconds:
                cost.record(1, tree, seconds)
    template = tree_template(4, 2, max_nodes=8)
    policy = DraftPolicy(4, cost, stats, template=template, trees=(T6, T8, T8P), **kw)
    for tree, (_, kept) in trees.items():
        if kept is not None:
            policy.tree_stats[tree].record([kept] * 100)
    return policy


def test_policy_weighs_tree_width_and_pruning_by_their_measured_steps():
    # Chains of 4: 2.3 tokens for 1.4 plain steps (1.64x).
    # The 8-node tree: 4 tokens for 2 plain steps (2.0x) beats the 6-node one (3.5 / 1.8)
    # and the pruned one (4 / 2.4).
    wide = _tree_policy({T6: (0.09, 2.5), T8: (0.10, 3), T8P: (0.12, 3)})
    assert wide.cost.ratio(1, T8) == pytest.approx(2.0)  # its own time, not the table's
    assert wide.cost.correction(1) == pytest.approx(1.4 / 1.3)  # chains alone correct it
    assert wide.best_length(1) == T8
    assert "tree8-pruned:" in wide.summary(1) and "k4:" in wide.summary(1)
    # Pruning that keeps most accepted nodes and saves rows: 3.9 / 1.7 (2.29x).
    assert _tree_policy({T6: (0.09, 2.5), T8: (0.10, 3), T8P: (0.085, 2.9)}).best_length(1) == T8P
    # A narrower tree that keeps almost as much: 3.6 / 1.5 (2.4x).
    assert _tree_policy({T6: (0.075, 2.6), T8: (0.10, 3), T8P: (0.12, 3)}).best_length(1) == T6
    # Trees at 3.2 plain steps (as measured on an AVX2 CPU at batch 16): chains win.
    assert _tree_policy({T6: (0.16, 2.6), T8: (0.16, 3), T8P: (0.16, 3)}).best_length(1) == 4
    # Trees that keep no more than the chain do not pay for their extra rows.
    assert _tree_policy({T6: (0.08, 1), T8: (0.10, 1), T8P: (0.09, 1)}).best_length(1) == 4


#: A CPU where each draft row costs 0.2 plain steps at batch 1 (1.2 with one draft, 1.8 with
#: four; 2.2 for six rows and 2.6 for eight, the measured trend going on).
DEAR_ROWS = StepCostTable("test", (1,), {1: (1.2,), 4: (1.8,)}, "test")


def test_step_cost_beyond_the_largest_k_follows_the_measured_trend():
    assert DEAR_ROWS.ratio(1, 6) == pytest.approx(2.2)
    assert DEAR_ROWS.ratio(1, 8) == pytest.approx(2.6)
    # The avx2 table: 16 rows at batch 1 / 16, against the 3.7 / 6.9 plain steps that
    # top-2 trees of 16 nodes cost on E2E there (a proportional share said 8.0 / 14.7).
    avx2 = table_for("accepted", "avx2")
    assert avx2.ratio(1, 16) == pytest.approx(3.73, abs=0.01)
    assert avx2.ratio(16, 16) == pytest.approx(9.71, abs=0.01)
    one = StepCostTable("test", (1,), {2: (1.5,)}, "test")
    assert one.ratio(1, 4) == pytest.approx(3.0)  # a single k: its share per row


def test_policy_probes_the_likeliest_untimed_tree_and_stops_where_none_would_pay():
    # Chains of 2: 2.0 tokens for 1.4 plain steps (1.43x; of 4: 2.3 for 1.8). Untimed, a
    # tree costs the table's chain of as many rows (6 rows 2.2, 8 rows 2.6): the 6-node
    # tree's prior gives it the best estimate of the trees (2.6 tokens: 1.18x), but chains
    # win; one chain step in four drafts it to time it.
    policy = _tree_policy({}, chain_s=0.09, table=DEAR_ROWS, timing_probe_every=4)
    assert policy.best_length(1) == 2
    assert policy.expected_speedup(1, T6) > policy.expected_speedup(1, T8)
    assert [policy.draft_length(1) for _ in range(8)] == [2, 2, 2, T6] * 2
    # Timed dear (3.2 plain steps: 1.45x the table's guess): the untimed 8-node trees now
    # cost that overhead too, far below the chains' speedup: no more probes.
    for _ in range(4):
        policy.cost.record(1, T6, 0.16)
    assert policy.cost.tree_overhead(1) == pytest.approx(3.2 / 2.2)
    assert [policy.draft_length(1) for _ in range(16)] == [2] * 16
    # Timed cheap (1.4 plain steps), the 8-node trees come within reach of the best (1.67x
    # against 1.86x): they are probed.
    cheap = _tree_policy({T6: (0.07, None)}, chain_s=0.09, table=DEAR_ROWS, timing_probe_every=4)
    assert cheap.best_length(1) == T6
    probes = [cheap.draft_length(1) for _ in range(8)]
    assert probes == [T6, T6, T6, T8] * 2 or probes == [T6, T6, T6, T8P] * 2
    # An engine without trees never drafts one.
    chains = _tree_policy({}, timing_probe_every=1)
    chains.trees = ()
    assert set(chains.draft_length(1) for _ in range(8)) == {4}


TOPK = torch.tensor([[11, 21], [12, 22], [13, 23], [14, 24]])


class _TreeTarget(_Target):
    """A tree engine's model: the top-2, 8-node template, the streams' top-2 ``TOPK``."""

    prune_threshold = 0.0

    def __init__(self, n):
        from vllm_specstream.streams.draft_trees import tree_template

        super().__init__(n)
        self.tree = tree_template(4, 2, max_nodes=8)
        self.prune_trees = True
        self.stash.draft_topk = TOPK.expand(n, 4, 2)

    def default_placement(self):
        return "window"  # an eager model's default

    def set_placement(self, placement):
        self.placement = "accepted"  # as the model: trees run the streams at the anchors


@pytest.fixture
def tree_rows(monkeypatch):
    """Two requests: ``a`` greedy, ``b`` asking for logprobs (so it drafts chains)."""
    import weakref

    from vllm import SamplingParams

    from vllm_specstream.model_executor.trees.step import WORKER_TREES

    class Runner:  # the rows' request ids and sampling parameters
        input_batch = SimpleNamespace(req_ids=["a", "b"])
        requests = {
            "a": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0)),
            "b": SimpleNamespace(sampling_params=SamplingParams(temperature=0.0, logprobs=0)),
        }

    runner = Runner()
    monkeypatch.setattr(WORKER_TREES, "_runner", weakref.ref(runner))
    monkeypatch.setattr(WORKER_TREES, "step", None)
    return runner


def _tree_proposer(vllm_config):
    proposer = SpecStreamProposer(vllm_config)
    proposer.load_model(_TreeTarget(2))

    def propose(sampled):
        proposer.target.stash = _TreeTarget(2).stash
        return proposer.propose(sampled, np.full(2, 7), None)

    return proposer, propose


def test_tree_engine_prices_its_chains_with_the_placement_it_runs(tree_rows):
    # An eager tree engine asked for the default (window) placement runs `accepted`: its
    # chains cost what the accepted table says, and no window-only choice is offered.
    from vllm_specstream.speculation.step_cost import table_for

    proposer, _ = _tree_proposer(_vllm_config(8))
    assert proposer.target.placement == "accepted"
    assert proposer.policy.cost.table is table_for("accepted")
    assert table_for("accepted") is not table_for("window")
    assert proposer.policy.cost.anchored_table is None and not proposer.policy.anchored


def test_tree_engine_schedule_gives_node_counts_beyond_the_chain(tree_rows):
    # A fixed schedule in a tree engine: up to num_streams drafts a chain, beyond it the
    # first k nodes of the tree (pruned where the model prunes).
    from vllm_specstream.model_executor.trees.step import WORKER_TREES

    full = [11, 12, 13, 14, 21, 22, 12, 22]
    for k, want in ((3, [11, 12, 13]), (4, [11, 12, 13, 14]), (6, full[:6]), (8, full)):
        proposer, propose = _tree_proposer(_vllm_config(8, [(1, 64, k)]))
        drafts = propose([[1], [1]])
        assert drafts[0] == want and drafts[1] == want[:4]
        filed = WORKER_TREES.book.take()
        assert (list(filed) == ["a"]) == (k > 4)
        assert proposer.target.prune_trees == (k > 4)


def test_tree_engine_proposer_drafts_trees_as_the_policy_chooses(monkeypatch, tree_rows):
    """The proposer of a tree engine: the tree the policy chooses (a prefix of the template,
    pruned or not), chains otherwise; tree rows' path lengths feed that tree's estimate,
    not the chain one."""
    from vllm_specstream.model_executor.trees.step import WORKER_TREES, RowTree, StepTrees

    proposer, propose = _tree_proposer(_vllm_config(8))
    tree = proposer.tree
    assert proposer.policy.k_max == 4 and proposer.policy.trees == (T6, T8)
    assert proposer.policy.cost.direct == {T6, T8}
    # A model that prunes its trees: each width also pruned.
    pruning = SpecStreamProposer(_vllm_config(8))
    target = _TreeTarget(2)
    target.prune_threshold = 0.01
    pruning.load_model(target)
    assert pruning.policy.trees == (T6, TreeChoice(6, True), T8, T8P)

    # The priors: no tree beats the chains at the table's costs; no tree filed.
    proposer.policy.cost = MeasuredCost(TABLE, direct=frozenset((T6, T8)))
    assert propose([[1], [1]]) == [[11, 12, 13, 14]] * 2
    assert WORKER_TREES.book.take() == {}
    # vLLM kept none of those drafts, and 8-node trees are seen to keep 4: they pay.
    proposer.policy.tree_stats[T8].record([4] * 100)
    proposer.policy.tree_stats[T6].record([1] * 100)
    drafts = propose([[1], [1]])
    assert drafts[0] == [11, 12, 13, 14, 21, 22, 12, 22]  # fill_tree: the chain first
    assert drafts[1] == [11, 12, 13, 14]  # logprobs: a chain beside the tree
    assert proposer._tree_rows == {0} and list(WORKER_TREES.book.take()) == ["a"]
    assert proposer.target.prune_trees is False  # an unpruned choice
    # The next call reads what the step kept: the tree row its path, the chain row its
    # drafts; only the chain row's drafts enter the chain estimate, the path the 8-node
    # tree's.
    monkeypatch.setattr(WORKER_TREES, "step", StepTrees((RowTree(0, tree.parents, 6),)))
    tree_stats = proposer.policy.tree_stats[T8]
    rows_before = tree_stats.rows
    stats = proposer.policy.stats
    proposed_before, accepted_before = stats.proposed.copy(), stats.accepted.copy()
    # Now the 6-node tree is seen to keep as much: the narrower tree is drafted (the first
    # six nodes of the template), and pruned where that is the choice.
    proposer.policy.tree_stats[T6].record([4] * 1000)
    drafts = propose([[1, 2, 3, 4], [1, 2]])
    assert tree_stats.rows == pytest.approx(rows_before * 0.98 + 1)
    assert tree_stats.accepted == pytest.approx(400 * 0.98 + 3)
    assert (stats.proposed - proposed_before * 0.98).tolist() == pytest.approx([1, 1, 1, 1])
    assert (stats.accepted - accepted_before * 0.98).tolist() == pytest.approx([1, 0, 0, 0])
    assert drafts[0] == [11, 12, 13, 14, 21, 22]
    assert WORKER_TREES.book.take()["a"].parents == tree.parents[:6]
    monkeypatch.setattr(WORKER_TREES, "step", None)
    monkeypatch.setattr(proposer.policy, "draft_length", lambda *a: TreeChoice(6, True))
    propose([[1], [1]])
    assert proposer.target.prune_trees is True


def test_measured_ratios_are_priced_once_per_recorded_step_and_follow_each_record(monkeypatch):
    # Every choice is priced at every step (twice in a step that drafts nothing): a ratio read
    # again before the next recorded step is not worked out again, and a recorded step makes
    # every ratio new.
    calls = []
    priced = MeasuredCost._ratio
    monkeypatch.setattr(
        MeasuredCost, "_ratio", lambda self, b, k: calls.append((b, k)) or priced(self, b, k)
    )
    cost = MeasuredCost(TABLE, min_samples=1)
    cost.record(1, 0, 0.05)
    cost.record(1, 2, 0.07)
    assert cost.ratio(1, 2) == pytest.approx(1.4)
    assert cost.ratio(1, 2) == pytest.approx(1.4) and calls == [(1, 2)]
    cost.ratio(1, WindowEntry(3))  # untimed: the anchored chain's and the window chain's
    assert calls[1:] == [(1, WindowEntry(3)), (1, AnchoredChain(3)), (1, 3)]
    cost.record(1, 2, 0.09)
    cost.record(1, 2, 0.09)  # median 0.09
    assert cost.ratio(1, 2) == pytest.approx(1.8) and len(calls) == 5
    cost.record(1, 0, 0.09)  # plain's median: 0.07
    assert cost.ratio(1, 2) == pytest.approx(0.09 / 0.07)


def test_step_cost_tables_work_out_each_ratio_once(monkeypatch):
    table = StepCostTable("avx2", (1, 4), {1: (1.5, 2.0), 4: (2.0, 3.0)}, "test")
    calls = []
    priced = StepCostTable._ratio
    monkeypatch.setattr(
        StepCostTable, "_ratio", lambda self, b, k: calls.append((b, k)) or priced(self, b, k)
    )
    # batch 2 is a third of the way from 1 to 4: k = 1 costs 5/3, k = 4 7/3; k = 2 a third
    # of the way between them
    assert table.ratio(2, 2) == table.ratio(2, 2) == pytest.approx(17 / 9)
    assert calls == [(2, 2)]
