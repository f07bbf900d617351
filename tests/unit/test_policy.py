"""The adaptive speculation policy: batch-size schedule, its validation, and the proposer."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specstream import speculative_config
from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.stash import StreamStash
from vllm_specstream.policy import (
    DEFAULT_SCHEDULE,
    ENV_DRAFT_MIN_PROB,
    clamp_schedule,
    confident_drafts,
    draft_length,
    draft_min_prob_from_env,
    validate_schedule,
)
from vllm_specstream.proposer import SpecStreamProposer, drafts_at


def test_draft_length_reads_ranges_gaps_and_tail_like_vllm():
    schedule = [(1, 2, 4), (5, 8, 2), (9, 9, 1)]
    got = [draft_length(schedule, b, k=3) for b in range(1, 12)]
    # b=3,4 carry (1, 2)'s length (clamped to k=3); past the last range its length holds.
    assert got == [3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1]
    assert draft_length(None, 64, k=4) == 4


def test_default_schedule_turns_drafting_off_under_load():
    assert draft_length(DEFAULT_SCHEDULE, 1, 4) == 4
    assert draft_length(DEFAULT_SCHEDULE, 16, 4) == 2
    assert draft_length(DEFAULT_SCHEDULE, 32, 4) == 0
    assert clamp_schedule(DEFAULT_SCHEDULE, 1)[0][2] == 1


@pytest.mark.parametrize(
    "bad, message",
    [
        ([(2, 4, 1)], "must start at batch size 1"),
        ([(1, 4, 1), (3, 8, 1)], "overlap"),
        ([(1, 4)], "is not \\(first, last, k\\)"),
        ([(1, 0, 2)], "first <= last"),
        ([], "must start at batch size 1"),
    ],
)
def test_validate_schedule_rejects(bad, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(bad, "num_speculative_tokens_per_batch_size")


def test_speculative_config_adaptive_switch():
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(3)
    fixed = speculative_config(3, adaptive=False)["num_speculative_tokens_per_batch_size"]
    assert all(draft_length(fixed, b, 3) == 3 for b in (1, 16, 256))
    mine = [(1, 1, 2), (2, 64, 0)]
    cfg = speculative_config(3, adaptive=False, num_speculative_tokens_per_batch_size=mine)
    assert cfg["num_speculative_tokens_per_batch_size"] == mine


class _Target:
    """Just enough of the model for ``propose``: a stash with one decode row per request."""

    spec_config = None
    no_stash_reason = None

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

    def take_stash(self):
        stash, self.stash = self.stash, None
        return stash

    def draft_at(self, stash, rows, indices):
        return stash.draft_table


def _propose(schedule, num_requests, k=4):
    spec = SimpleNamespace(num_speculative_tokens=k, num_speculative_tokens_per_batch_size=schedule)
    proposer = SpecStreamProposer(SimpleNamespace(speculative_config=spec))
    proposer.load_model(_Target(num_requests))
    # Each request: position 5 decoded, 1 token sampled -> 7 tokens, anchor at its own row.
    return proposer.propose([[1]] * num_requests, np.full(num_requests, 7), None)


def test_proposer_follows_the_schedule():
    assert _propose(None, 1) == [[11, 12, 13, 14]]  # default: full length alone
    assert _propose(None, 16) == [[11, 12]] * 16  # default: shorter under load
    assert _propose(None, 32) == [[]] * 32  # default: off under heavy load
    assert _propose([(1, 1, 4), (2, 8, 2)], 3) == [[11, 12]] * 3
    with pytest.raises(ValueError, match="overlap"):
        _propose([(1, 4, 4), (2, 8, 2)], 1)


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


def test_draft_min_prob_env(monkeypatch):
    monkeypatch.delenv(ENV_DRAFT_MIN_PROB, raising=False)
    assert draft_min_prob_from_env() == 0.0
    monkeypatch.setenv(ENV_DRAFT_MIN_PROB, "0.25")
    assert draft_min_prob_from_env() == 0.25
    for bad in ("1", "-0.1", "high"):
        monkeypatch.setenv(ENV_DRAFT_MIN_PROB, bad)
        with pytest.raises(ValueError, match=f"{ENV_DRAFT_MIN_PROB}='{bad}'"):
            draft_min_prob_from_env()
