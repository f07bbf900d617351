"""Suffix drafts beside the streams: the option, the trees' bookkeeping (as vLLM's ``suffix``
method keeps them) and the proposer's choice per request."""

from types import SimpleNamespace

import numpy as np
import pytest
from test_proposer import _Target as ProposerTarget

from vllm_specstream.checkpoint.config import ConfigError, suffix_min_score_from
from vllm_specstream.speculation.choices import CopyStep
from vllm_specstream.speculation.settings import resolve_settings
from vllm_specstream.speculation.suffix_drafts import (
    SuffixDraft,
    SuffixDrafts,
    SuffixSettings,
    suffix_rows,
)


def test_option_values():
    assert suffix_min_score_from("") is None and suffix_min_score_from("off") is None
    assert np.isnan(suffix_min_score_from("on")) and np.isnan(suffix_min_score_from(" ON "))
    assert suffix_min_score_from("0") == 0.0 and suffix_min_score_from("1.5") == 1.5
    for bad in ("-1", "maybe", "nan"):
        with pytest.raises(ConfigError, match=f"suffix_drafts='{bad}'"):
            suffix_min_score_from(bad)


def _engine_config(checkpoint=None, k=4, **fields):
    """An engine config: the checkpoint's ``suffix_drafts`` default ``checkpoint`` (None:
    none) and the engine's ``additional_config["specstream"]`` ``fields``."""
    spec = SimpleNamespace(
        method="custom_class",
        model=None,
        num_speculative_tokens=k,
        num_speculative_tokens_per_batch_size=None,
    )
    section = {"num_streams": 4} | ({} if checkpoint is None else {"suffix_drafts": checkpoint})
    hf_config = SimpleNamespace(specstream=section)
    return SimpleNamespace(
        speculative_config=spec,
        model_config=SimpleNamespace(hf_config=hf_config),
        additional_config={"specstream": fields},
    )


def test_the_field_is_read_only_when_speculating_and_refused_beside_trees():
    assert resolve_settings(_engine_config(suffix_drafts=0.5), {}).suffix_drafts == 0.5
    off = _engine_config(k=0, suffix_drafts=0.5)  # speculation off
    assert resolve_settings(off, {}).suffix_drafts is None
    with pytest.raises(ConfigError, match="leave out tree_top_k or suffix_drafts"):
        resolve_settings(_engine_config(suffix_drafts="on", tree_top_k=2), {})
    with pytest.raises(ConfigError, match=r"\['suffix_drafts'\]='maybe'"):
        resolve_settings(_engine_config(suffix_drafts="maybe"), {})


@pytest.mark.parametrize("importable", [True, False])
def test_checkpoint_default_is_followed_unless_the_user_says_otherwise(monkeypatch, importable):
    import vllm_specstream.speculation.settings as options

    monkeypatch.setattr(options, "suffix_decoding_importable", lambda: importable)
    opts = resolve_settings(_engine_config("on"), {})
    if importable:
        assert np.isnan(opts.suffix_drafts) and opts.suffix_from_checkpoint
        assert opts.suffix_skipped is None
    else:  # a default is never an error: the streams alone, and why
        assert opts.suffix_drafts is None and not opts.suffix_from_checkpoint
        assert "arctic-inference's suffix decoding is not importable" in opts.suffix_skipped
        assert '{"suffix_drafts": "off"}' in opts.suffix_skipped  # how to silence it
    # The field wins either way (and an explicit 'on' without arctic-inference is the
    # front-end's error to raise: tests/unit/test_preflight.py).
    user = resolve_settings(_engine_config("on", suffix_drafts="off"), {})
    assert user.suffix_drafts is None and user.suffix_skipped is None
    user = resolve_settings(_engine_config("on", suffix_drafts=0.5), {})
    assert user.suffix_drafts == 0.5 and not user.suffix_from_checkpoint
    # Draft trees asked for: the default yields to them, it is not refused.
    trees = resolve_settings(_engine_config("on", tree_top_k=2), {})
    assert trees.suffix_drafts is None and trees.tree_top_k == (2,)
    assert "field tree_top_k asks for draft trees" in trees.suffix_skipped
    # A threshold, 'off', no default, no speculation.
    assert resolve_settings(_engine_config("0.25"), {}).suffix_drafts == (
        0.25 if importable else None
    )
    for quiet in (_engine_config("off"), _engine_config(None), _engine_config("on", k=0)):
        opts = resolve_settings(quiet, {})
        assert opts.suffix_drafts is None and opts.suffix_skipped is None


def test_suffix_trees_are_found_in_the_projects_build_without_pythonpath(tmp_path, monkeypatch):
    import sys

    import vllm_specstream.speculation.suffix_drafts as suffix_drafts

    monkeypatch.setattr(sys, "path", [p for p in sys.path if "suffix-decoding" not in p])
    for name in [m for m in sys.modules if m.startswith("arctic_inference")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(suffix_drafts, "SUFFIX_DECODING_DIR", tmp_path)
    with pytest.raises(ConfigError, match=f"nor built in {tmp_path}; `make suffix-decoding`"):
        suffix_drafts.suffix_cache_class()
    assert str(tmp_path) not in sys.path
    package = tmp_path / "arctic_inference" / "suffix_decoding"
    package.mkdir(parents=True)
    (tmp_path / "arctic_inference" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("class SuffixDecodingCache:\n    built = True\n")
    try:
        assert suffix_drafts.suffix_cache_class().built
        assert sys.path[-1] == str(tmp_path)
    finally:  # the stand-in leaves; monkeypatch puts back what was imported before
        for name in [m for m in sys.modules if m.startswith("arctic_inference")]:
            del sys.modules[name]


def test_settings_follow_vllms_suffix_fields():
    spec = SimpleNamespace(suffix_decoding_max_tree_depth=16, suffix_decoding_min_token_prob=0.3)
    s = SuffixSettings.of(spec)
    assert (s.max_tree_depth, s.min_token_prob) == (16, 0.3)
    assert (s.max_cached_requests, s.max_spec_factor) == (10000, 1.0)  # vLLM's defaults


def test_suffix_rows_take_scoring_drafts_only():
    drafts = {0: SuffixDraft([1, 2], 1.6), 1: SuffixDraft([3], 0.4), 2: SuffixDraft([], 0.0)}
    assert suffix_rows(drafts, 0.5) == {0: [1, 2]}
    assert suffix_rows(drafts, 0.0) == {0: [1, 2], 1: [3]}


class FakeCache:
    """arctic-inference's ``SuffixDecodingCache`` as the trees' bookkeeping calls it."""

    def __init__(self, draft=((), 0.0)):
        self.active: dict[str, list[int]] = {}
        self.cached: set[str] = set()
        self.calls: list[tuple] = []
        self.next_draft = draft

    @property
    def active_requests(self):
        return self.active.keys()

    @property
    def cached_requests(self):
        return self.cached

    def start_request(self, req_id, prompt):
        self.calls.append(("start", req_id, list(prompt)))
        self.active[req_id] = list(prompt)

    def add_active_response(self, req_id, tokens):
        self.active[req_id] += tokens

    def stop_request(self, req_id):
        self.calls.append(("stop", req_id))
        self.cached.add(req_id)
        del self.active[req_id]

    def evict_cached_response(self, req_id):
        self.calls.append(("evict", req_id))
        self.cached.discard(req_id)

    def speculate(self, req_id, context, max_spec_tokens, **kw):
        self.calls.append(("speculate", req_id, list(context), max_spec_tokens))
        tokens, score = self.next_draft
        return SimpleNamespace(token_ids=list(tokens)[:max_spec_tokens], score=score)


def test_trees_start_from_the_prompt_grow_and_stop():
    cache = FakeCache()
    trees = SuffixDrafts(SuffixSettings(max_tree_depth=3), max_model_len=64, cache=cache)
    tokens = np.zeros((2, 16), dtype=np.int32)
    tokens[0, :4] = [5, 6, 7, 8]  # prompt of 3, then its first sampled token
    tokens[1, :3] = [9, 9, 1]
    trees.update(["a", "b"], [3, 2], tokens, [[8], []])  # "b" is a partial prefill chunk
    assert cache.calls == [("start", "a", [5, 6, 7])] and cache.active == {"a": [5, 6, 7, 8]}
    trees.update(["b"], [2], tokens[1:], [[1]])  # "a" left the batch; "b" sampled
    assert ("stop", "a") in cache.calls and set(cache.active) == {"b"}
    # A request that comes back (preempted, resumed) starts again from its prompt.
    trees.update(["a"], [3], tokens, [[8]])
    assert cache.calls[-3:] == [("evict", "a"), ("start", "a", [5, 6, 7]), ("stop", "b")]
    # Drafts match the last max_tree_depth tokens; none past the model's length.
    cache.next_draft = ([1, 2, 3, 4], 2.5)
    assert trees.draft("a", tokens[0], 4, 3) == SuffixDraft([1, 2, 3], 2.5)
    assert cache.calls[-1] == ("speculate", "a", [6, 7, 8], 3)
    assert trees.draft("a", tokens[0], 63, 3) == SuffixDraft([], 0.0)


def _arctic_importable() -> bool:
    from vllm_specstream.bench.bench import has_suffix_decoding

    return has_suffix_decoding()


@pytest.mark.skipif(
    not _arctic_importable(),
    reason="arctic-inference's suffix trees are not built here (make suffix-decoding)",
)
def test_real_suffix_trees_draft_what_the_prompt_repeats():
    # Found in make suffix-decoding's build without PYTHONPATH (suffix_cache_class).
    trees = SuffixDrafts(SuffixSettings(), max_model_len=128)
    prompt = [11, 12, 13, 14, 15, 16, 11, 12]
    tokens = np.zeros((1, 32), dtype=np.int32)
    tokens[0, : len(prompt) + 1] = [*prompt, 13]
    trees.update(["r"], [len(prompt)], tokens, [[13]])
    draft = trees.draft("r", tokens[0], len(prompt) + 1, 3)
    assert draft.tokens == [14, 15, 16] and draft.score > 0


class _Target(ProposerTarget):
    """Two decode requests whose streams drafted at their anchors (rows 1 and 3); records
    the rows the stream pass ran for."""

    def __init__(self):
        super().__init__()
        self.forward()
        self.streams_for: list[list[int]] = []

    def draft_at(self, stash, rows, indices, num_streams=0):
        self.streams_for.append(list(rows))
        return super().draft_at(stash, rows, indices, num_streams)


def _proposer(monkeypatch, cache, min_score=0.5, lookup=None):
    """A proposer with suffix drafts from ``cache`` (prompt lookup off unless ``lookup``
    gives its field)."""
    lookup = {"prompt_lookup": "off"} if lookup is None else lookup
    from vllm_specstream.model_executor import proposer as proposer_module
    from vllm_specstream.model_executor.proposer import SpecStreamProposer

    monkeypatch.setattr(
        proposer_module, "SuffixDrafts", lambda settings, n: SuffixDrafts(settings, n, cache)
    )
    spec = SimpleNamespace(num_speculative_tokens=3, num_speculative_tokens_per_batch_size=None)
    p = SpecStreamProposer(
        SimpleNamespace(
            speculative_config=spec,
            model_config=SimpleNamespace(max_model_len=64),
            additional_config={"specstream": {"suffix_drafts": min_score} | lookup},
        )
    )
    p.load_model(_Target())

    class Runner:  # the model runner as the proposer reads it
        input_batch = SimpleNamespace(req_ids=["a", "b"], num_prompt_tokens=[8, 8])

    runner = Runner()
    p.bind_runner(runner)
    p._test_runner = runner  # the proposer holds a weak reference
    return p


def _tokens() -> np.ndarray:
    tokens = np.zeros((2, 32), dtype=np.int32)
    tokens[0, 10:13] = [100, 101, 5]
    tokens[1, 10:13] = [200, 201, 6]
    return tokens


SAMPLED = [[101, 5], [201, 6]]


def test_scoring_suffix_drafts_replace_the_streams_and_skip_their_pass(monkeypatch):
    class PerRequest(FakeCache):
        def speculate(self, req_id, context, max_spec_tokens, **kw):
            tokens, score = {"a": ([7, 8, 9, 10], 2.0), "b": ([4], 0.2)}[req_id]
            return SimpleNamespace(token_ids=tokens[:max_spec_tokens], score=score)

    p = _proposer(monkeypatch, PerRequest())
    drafts = p.propose(SAMPLED, np.array([13, 13]), _tokens())
    # "a" copies (score 2.0 >= 0.5, as long as the streams' drafts); "b" keeps the streams'.
    assert drafts == [[7, 8, 9], [21, 22, 23]]
    assert p.target.streams_for == [[1]]  # the stream pass ran for "b" only
    assert p.copies.copied == {"a": 0} and p.copies.suffix_drafted == 1
    # The streams' acceptance estimate counts "b"'s drafts only, and the step is not timed
    # as a stream choice.
    assert p.policy.stats.pending.tolist() == [1, 1, 1]
    assert p.step_timer.last_choice is None


def test_every_request_copying_runs_no_window_streams_next(monkeypatch):
    p = _proposer(monkeypatch, FakeCache(draft=([7, 8, 9], 3.0)))
    assert p.propose(SAMPLED, np.array([13, 13]), _tokens()) == [[7, 8, 9], [7, 8, 9]]
    assert p.target.streams_for == [] and p.target.window_streams == 0
    # The next step verifies suffix drafts only and runs no streams: timed on its own.
    assert p.step_timer.last_choice == CopyStep(3)
    # The next step's verified suffix drafts are left out of the streams' estimate.
    before = p.policy.stats.tried.copy()
    p.target.forward_step += 1
    p.propose([[9, 1], [9, 2]], np.array([15, 15]), _tokens())
    assert (p.policy.stats.tried == before).all()


def test_on_weighs_tokens_per_step_cost_against_the_streams(monkeypatch):
    cache = FakeCache(draft=([7, 8, 9], 0.5))
    p = _proposer(monkeypatch, cache, min_score="on")
    asked = []

    def streams_yield(batch_size, k):
        asked.append(batch_size)
        return 1.6  # the streams: 1.6 tokens per plain step's cost

    monkeypatch.setattr(p, "streams_yield", streams_yield)
    monkeypatch.setattr(p, "draft_length", lambda batch_size: 3)
    # 1 + 0.5 tokens at a plain step's cost: less than the streams' 1.6
    assert p.propose(SAMPLED, np.array([13, 13]), _tokens()) == [[11, 12, 13], [21, 22, 23]]
    assert asked == [2]
    cache.next_draft = ([7, 8, 9], 0.7)
    p.target = _Target()
    p.target.placement = "accepted"
    assert p.propose(SAMPLED, np.array([14, 14]), _tokens()) == [[7, 8, 9], [7, 8, 9]]


def test_without_the_runner_the_streams_draft_alone_and_it_is_said(monkeypatch):
    from vllm_specstream.model_executor import copied_drafts

    warnings = []
    monkeypatch.setattr(copied_drafts.logger, "warning", lambda *a: warnings.append(a[0] % a[1:]))
    p = _proposer(monkeypatch, FakeCache(draft=([7, 8, 9], 3.0)))
    p.copies._runner = None
    assert p.propose(SAMPLED, np.array([13, 13]), _tokens()) == [[11, 12, 13], [21, 22, 23]]
    assert p.copies.suffix is None and len(warnings) == 1 and "proposer-runner" in warnings[0]


def test_where_the_streams_do_not_pay_suffix_drafts_are_weighed_against_a_plain_step(
    monkeypatch,
):
    """No stream drafts at this step: a suffix step yields ``1 + score`` tokens at its timed
    cost, a plain step one token at its own: drafts scoring at least 1 until suffix steps
    are timed, then those scoring at least that cost less one."""
    cache = FakeCache(draft=([7, 8, 9, 10], 0.2))
    p = _proposer(monkeypatch, cache, min_score="on")
    monkeypatch.setattr(p, "draft_length", lambda batch_size: 0)
    # Untimed, the verify rows are not free: a draft expecting 0.2 tokens kept is not taken.
    assert p.propose(SAMPLED, np.array([13, 13]), _tokens()) == [[], []]
    cache.next_draft = ([7, 8, 9, 10], 1.2)
    p.target = _Target()
    # Up to num_speculative_tokens (3), no stream pass, timed as a suffix step.
    assert p.propose(SAMPLED, np.array([14, 14]), _tokens()) == [[7, 8, 9], [7, 8, 9]]
    assert p.target.streams_for == [] and p.target.window_streams == 0
    assert p.step_timer.last_choice == CopyStep(3)
    for _ in range(8):  # suffix-only steps timed, plain ones not yet: still unpriced
        p.policy.costs.record(2, CopyStep(3), 0.013)
    cache.next_draft = ([7, 8, 9, 10], 0.4)
    p.target = _Target()
    assert p.propose(SAMPLED, np.array([15, 15]), _tokens()) == [[], []]
    cache.next_draft = ([7, 8, 9, 10], 0.2)
    for _ in range(8):  # plain steps of 10 ms, suffix-only steps of 13 ms at batch 2
        p.policy.costs.record(2, 0, 0.010)
        p.policy.costs.record(2, CopyStep(3), 0.013)
    # 1.2 tokens at 1.3 plain steps: less than a plain step's one token at its cost
    p.target = _Target()
    assert p.propose(SAMPLED, np.array([16, 16]), _tokens()) == [[], []]
    cache.next_draft = ([7, 8, 9, 10], 0.4)
    p.target = _Target()
    assert p.propose(SAMPLED, np.array([17, 17]), _tokens()) == [[7, 8, 9], [7, 8, 9]]


def test_with_a_schedule_and_no_stream_drafts_suffix_drafts_scoring_one_are_taken(
    monkeypatch,
):
    """The user's schedule prices no step: where it drafts nothing, a suffix draft is
    taken where at least one of its tokens is expected to be kept."""
    cache = FakeCache(draft=([7, 8, 9, 10], 0.9))
    p = _proposer(monkeypatch, cache, min_score="on")
    p.policy = None
    monkeypatch.setattr(p, "draft_length", lambda batch_size: 0)
    assert p.propose(SAMPLED, np.array([13, 13]), _tokens()) == [[], []]
    cache.next_draft = ([7, 8, 9, 10], 1.2)
    p.target = _Target()
    assert p.propose(SAMPLED, np.array([14, 14]), _tokens()) == [[7, 8, 9], [7, 8, 9]]


def test_on_prices_a_suffix_step_at_its_timed_cost(monkeypatch):
    """The threshold is the streams' yield times what a suffix-only step is timed at, less
    one: before any such step a plain step's cost, after them their median over plain's."""
    cache = FakeCache(draft=([7, 8, 9], 0.8))
    p = _proposer(monkeypatch, cache, min_score="on")
    monkeypatch.setattr(p, "streams_yield", lambda batch_size, k: 1.6)
    monkeypatch.setattr(p, "draft_length", lambda batch_size: 3)
    assert p.copy_step_cost(2) == 1.0
    # 1.8 tokens at a plain step's cost beat the streams' 1.6: copied
    assert p.propose(SAMPLED, np.array([13, 13]), _tokens()) == [[7, 8, 9], [7, 8, 9]]
    for _ in range(8):  # plain steps of 10 ms, suffix-only steps of 13 ms at batch 2
        p.policy.costs.record(2, 0, 0.010)
        p.policy.costs.record(2, CopyStep(3), 0.013)
    assert p.copy_step_cost(2) == pytest.approx(1.3)
    # 1.8 tokens at 1.3 plain steps no longer do (1.6 x 1.3 - 1 = 1.08 > 0.8): the streams draft
    p.target = _Target()
    assert p.propose(SAMPLED, np.array([13, 13]), _tokens()) == [[11, 12, 13], [21, 22, 23]]
    cache.next_draft = ([7, 8, 9], 1.1)
    p.target = _Target()
    assert p.propose(SAMPLED, np.array([13, 13]), _tokens()) == [[7, 8, 9], [7, 8, 9]]


def test_with_a_schedule_and_stream_drafts_suffix_drafts_scoring_one_replace_them(
    monkeypatch,
):
    """The user's schedule with stream drafts prices no step either: a suffix draft
    replaces the streams' where it scores at least 1, without asking for the streams'
    yield (there is no policy to price it)."""
    cache = FakeCache(draft=([7, 8, 9, 10], 0.9))
    p = _proposer(monkeypatch, cache, min_score="on")
    p.policy = None

    def streams_yield(batch_size, k):
        raise AssertionError("no policy prices the streams under the user's schedule")

    monkeypatch.setattr(p, "streams_yield", streams_yield)
    monkeypatch.setattr(p, "draft_length", lambda batch_size: 3)
    assert p.propose(SAMPLED, np.array([13, 13]), _tokens()) == [[11, 12, 13], [21, 22, 23]]
    cache.next_draft = ([7, 8, 9, 10], 1.2)
    p.target = _Target()
    assert p.propose(SAMPLED, np.array([14, 14]), _tokens()) == [[7, 8, 9], [7, 8, 9]]
