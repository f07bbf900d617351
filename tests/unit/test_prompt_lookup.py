"""Prompt-lookup drafts beside the streams: what a lookup drafts, how its acceptance is
learnt per matched n-gram length, the field, and the proposer's choice per request."""

import numpy as np
import pytest
from test_settings import engine
from test_suffix_drafts import SAMPLED, FakeCache, _proposer

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.model_executor.prompt_lookup import PromptLookup
from vllm_specstream.speculation.settings import resolve_settings


def _context(*tokens: int, width: int = 32) -> np.ndarray:
    row = np.zeros((1, width), dtype=np.int32)
    row[0, : len(tokens)] = tokens
    return row


def test_a_lookup_drafts_what_followed_the_longest_repeated_ngram():
    lookup = PromptLookup(k=4, max_model_len=64)
    # The last 3-gram (2, 3, 4) came before 5 (the last 4-gram never did).
    tokens = _context(9, 2, 3, 4, 5, 6, 7, 8, 3, 4, 9, 1, 2, 3, 4)
    draft = lookup.drafts(tokens, [15], [0], k=3)[0]
    assert draft.tokens == [5, 6, 7] and draft.ngram == 3
    assert draft.score == pytest.approx(0.7 + 0.7**2 + 0.7**3)  # the prior, 3 positions
    assert lookup.drafts(_context(1, 2, 3, 4), [4], [0], k=3)[0].tokens == []  # no repeat
    # Never past the model's length.
    near_end = PromptLookup(k=4, max_model_len=16)
    assert len(near_end.drafts(tokens, [15], [0], k=3)[0].tokens) == 1


def _step(lookup, kept: int, taken=True):
    """One step of a request whose 3-gram lookup drafts 3 tokens; ``kept`` of them are."""
    tokens = _context(1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3)
    drafts = lookup.drafts(tokens, [11], [0], k=3)
    lookup.proposed(drafts, [0] if taken else [], 1)
    lookup.verified({0: 3} if taken else {}, [[0] * (kept + 1)])
    return drafts[0]


def test_acceptance_is_learnt_per_ngram_length_and_a_dropped_length_is_tried_again():
    lookup = PromptLookup(k=4, max_model_len=64)
    for _ in range(60):
        _step(lookup, kept=3)
    assert _step(lookup, kept=3).score > 2.8  # 3-gram lookups are kept: worth ~3 tokens
    assert lookup.stats[2].tried.sum() == 0  # another length learnt nothing
    for _ in range(200):
        _step(lookup, kept=0)
    assert _step(lookup, kept=0).score < 0.3  # now they are not
    # No length could reach the step's threshold: no row is matched at all.
    assert lookup.drafts(_context(1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3), [11], [0], 3, 2.0) == {}
    # Matched but no longer taken (scoring below any threshold), the evidence fades: after
    # some hundred steps a lookup of that length scores enough to be tried again.
    steps = 0
    while _step(lookup, kept=0, taken=False).score < 1.0:
        steps += 1
    assert 100 < steps < 1500


def test_the_field_is_on_by_default_for_chains_and_named_when_bad():
    assert resolve_settings(engine(), {}).prompt_lookup
    assert not resolve_settings(engine(prompt_lookup="off"), {}).prompt_lookup
    assert not resolve_settings(engine(tree_top_k=2), {}).prompt_lookup  # trees draft without it
    with pytest.raises(ConfigError, match="leave out tree_top_k or prompt_lookup"):
        resolve_settings(engine(tree_top_k=2, prompt_lookup="on"), {})
    with pytest.raises(ConfigError, match=r"\['prompt_lookup'\]='sometimes'"):
        resolve_settings(engine(prompt_lookup="sometimes"), {})


def _repeating_tokens() -> np.ndarray:
    """Request "a" ends with 0, 100, 101, 5, which its prompt held before 7, 8, 9; "b"'s
    last tokens do not repeat."""
    tokens = np.zeros((2, 32), dtype=np.int32)
    tokens[0, 1:8] = [0, 100, 101, 5, 7, 8, 9]
    tokens[0, 10:13] = [100, 101, 5]
    tokens[1, 10:13] = [200, 201, 6]
    return tokens


def test_a_request_whose_prompt_repeats_takes_the_lookup_and_its_acceptance_follows_it(
    monkeypatch,
):
    p = _proposer(monkeypatch, FakeCache(), min_score="off", lookup={})
    monkeypatch.setattr(p, "streams_yield", lambda batch_size, k: 1.6)
    drafts = p.propose(SAMPLED, np.array([13, 13]), _repeating_tokens())
    # "a" copies (1.5 tokens expected kept beat the streams' 1.6 per step less one), no
    # stream pass for it; "b" keeps the streams' drafts.
    assert drafts == [[7, 8, 9], [21, 22, 23]]
    assert p.target.streams_for == [[1]] and p.copies.lookup_drafted == 1
    assert p.policy.stats.pending.tolist() == [1, 1, 1]  # the streams': "b"'s only
    # Next step the batch's rows moved ("b" first); "a" kept all three lookup drafts.
    p._test_runner.input_batch.req_ids = ["b", "a"]
    p.target.forward()
    lookup_before = p.copies.prompt_lookup.stats[4].accepted.sum()
    p.propose([[5], [7, 8, 9, 1]], np.array([14, 17]), _repeating_tokens()[::-1])
    assert p.copies.prompt_lookup.stats[4].accepted.sum() - lookup_before == 3
    assert p.policy.stats.accepted.sum() == 0  # "b" kept none of the streams' drafts


def test_off_leaves_the_streams_to_draft(monkeypatch):
    p = _proposer(monkeypatch, FakeCache(), min_score="off")  # the field off
    monkeypatch.setattr(p, "streams_yield", lambda batch_size, k: 1.6)
    assert p.copies.prompt_lookup is None
    assert p.propose(SAMPLED, np.array([13, 13]), _repeating_tokens()) == [
        [11, 12, 13],
        [21, 22, 23],
    ]
