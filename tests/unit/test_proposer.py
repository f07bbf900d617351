"""The proposer's index logic: which row of the last forward holds each request's drafts."""

import numpy as np
import pytest
import torch

from vllm_specstream import PLACEMENT_PROPOSERS, PROPOSER, speculative_config
from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.stream_forward import accepted_anchors, window_anchors
from vllm_specstream.proposer import anchor_rows, last_accepted_index, select_drafts


def test_last_accepted_index_decode_prefill_and_prefix_hit():
    # Decode step: window [root, d1, d2, d3] at positions 10..13, 2 drafts accepted:
    # the request now holds 10 + 1 + 2 + 1 (sampled) = 14 tokens -> last accepted is d2 (pos 12).
    assert last_accepted_index(query_start=5, first_position=10, num_tokens_no_spec=14) == 7
    # Prefill of a 6-token prompt (positions 0..5), first token sampled: 7 tokens -> pos 5.
    assert last_accepted_index(query_start=0, first_position=0, num_tokens_no_spec=7) == 5
    # Last chunk of a chunked prefill / prefix-cache hit: scheduled positions 96..99 of a
    # 100-token prompt; 101 tokens after sampling -> the last scheduled token.
    assert last_accepted_index(query_start=3, first_position=96, num_tokens_no_spec=101) == 6


def test_select_drafts_rows():
    table = torch.full((9, 3), -1)
    table[1] = torch.tensor([11, 12, 13])  # request 0: prefill rows 0..1, anchor at 1
    table[4] = torch.tensor([21, 22, 23])  # request 1: decode window rows 2..5, 2 accepted
    qsl = [0, 2, 6, 9]
    first_positions = [0, 40, 7]
    sampled = [[7], [1, 2, 3], []]  # request 2 is a partial prefill chunk: nothing sampled
    num_tokens = np.array([3, 40 + 1 + 2 + 1, 0])
    drafts = select_drafts(sampled, num_tokens, qsl, first_positions, table, k=2)
    assert drafts == [[11, 12], [21, 22], []]


def test_select_drafts_without_anchor_or_out_of_window():
    table = torch.full((4, 2), -1)
    drafts = select_drafts([[5], [6]], np.array([2, 50]), [0, 2, 4], [0, 10], table, k=2)
    assert drafts == [[], []]


def _batch() -> ForwardBatch:
    # Request 0: 6-token prefill; request 1: 4-token decode window; request 2: 1 token.
    return ForwardBatch(
        query_start_loc=torch.tensor([0, 6, 10, 11]),
        seq_lens=torch.tensor([6, 20, 3]),
        block_table=torch.zeros(3, 1, dtype=torch.int32),
        positions=torch.arange(11),
    )


def test_window_anchors():
    anchors = window_anchors(_batch(), max_anchors=4)
    assert anchors.tolist() == [[2, 3, 4, 5], [6, 7, 8, 9], [10, -1, -1, -1]]


def test_anchor_rows_feed_accepted_anchors():
    """Placement "accepted": one anchor per request that sampled, at its last accepted token."""
    sampled = [[7], [1, 2], []]  # request 2 sampled nothing (partial prefill chunk)
    qsl, first_positions = [0, 6, 10, 11], [0, 16, 2]
    num_tokens = np.array([7, 16 + 1 + 1 + 1, 0])  # request 1: root + 1 draft accepted
    rows, indices = anchor_rows(sampled, num_tokens, qsl, first_positions)
    assert (rows, indices) == ([0, 1], [5, 7])
    assert accepted_anchors(_batch(), rows, indices).tolist() == [[5], [7], [-1]]
    assert accepted_anchors(_batch(), [], []).tolist() == [[-1], [-1], [-1]]


def test_speculative_config_placements():
    assert speculative_config(3)["model"] == PROPOSER
    assert speculative_config(3, placement="window")["model"] == PLACEMENT_PROPOSERS["window"]
    with pytest.raises(ValueError, match="placement='middle'"):
        speculative_config(3, placement="middle")
    from vllm_specstream.proposer import SpecStreamProposer

    assert SpecStreamProposer.placement in PLACEMENT_PROPOSERS
