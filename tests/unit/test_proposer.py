"""The proposer's index logic (which row of the last forward holds each request's drafts),
its check that the model's stash is this step's, and the warning when drafts stop."""

import numpy as np
import pytest
import torch

from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.stash import StreamStash, take_stream_rows
from vllm_specstream.model_executor.stream_drafts import (
    anchor_rows,
    last_accepted_index,
    select_drafts,
)
from vllm_specstream.model_executor.stream_forward import (
    accepted_anchors,
    last_window_anchors,
    window_anchors,
)


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


def test_window_anchors_keep_only_the_last_token_of_a_prefill():
    """A 6-token prefill chunk drafts from its last token only; decode windows keep every
    position (any of them may be the last accepted one)."""
    anchors = last_window_anchors(_batch(), max_anchors=4)
    assert anchors.tolist() == [[5, -1, -1, -1], [6, 7, 8, 9], [10, -1, -1, -1]]


def test_a_batch_of_prefills_runs_one_anchor_per_request():
    """No decode window in the batch: one anchor column, not ``max_anchors`` of padding."""
    batch = ForwardBatch(
        query_start_loc=torch.tensor([0, 6, 13, 15]),  # prefills of 6 and 7, a 2-token one
        seq_lens=torch.tensor([6, 7, 2]),
        block_table=torch.zeros(3, 1, dtype=torch.int32),
        positions=torch.arange(15),
    )
    assert last_window_anchors(batch, max_anchors=5).tolist() == [[5, -1], [12, -1], [13, 14]]
    batch.query_start_loc = torch.tensor([0, 6, 13, 20])
    assert last_window_anchors(batch, max_anchors=5).tolist() == [[5], [12], [19]]


def test_anchor_rows_feed_accepted_anchors():
    """Placement "accepted": one anchor per request that sampled, at its last accepted token."""
    sampled = [[7], [1, 2], []]  # request 2 sampled nothing (partial prefill chunk)
    qsl, first_positions = [0, 6, 10, 11], [0, 16, 2]
    num_tokens = np.array([7, 16 + 1 + 1 + 1, 0])  # request 1: root + 1 draft accepted
    rows, indices = anchor_rows(sampled, num_tokens, qsl, first_positions)
    assert (rows, indices) == ([0, 1], [5, 7])
    assert accepted_anchors(_batch(), rows, indices).tolist() == [[5], [7], [-1]]
    assert accepted_anchors(_batch(), [], []).tolist() == [[-1], [-1], [-1]]


class _Target:
    """The model's streams as the proposer sees them (``model.streams``): one forward of two
    decode requests, each with a window [root, d1] at positions 10..11 (tokens 100, 101 and
    200, 201), d1 accepted."""

    draft_min_prob = 0.0
    placement = "accepted"

    def __init__(self):
        self.forward_step = 0
        self.stash = None
        self.no_stash_reason = None
        self.window_streams = 3

    @property
    def streams(self):  # the model's, as the proposer's load_model takes them
        return self

    def prepare(self):
        pass

    def forward(self, input_ids=(100, 101, 200, 201)):
        self.forward_step += 1
        table = torch.full((4, 3), -1)
        table[1] = torch.tensor([11, 12, 13])
        table[3] = torch.tensor([21, 22, 23])
        batch = ForwardBatch(
            query_start_loc=torch.tensor([0, 2, 4]),
            seq_lens=torch.tensor([12, 12]),
            block_table=torch.zeros(2, 1, dtype=torch.int32),
            positions=torch.tensor([10, 11, 10, 11]),
        )
        self.stash = StreamStash(self.forward_step, batch, torch.tensor(input_ids), table)

    def take_stash(self):
        stash, self.stash = self.stash, None
        return stash

    def draft_at(self, stash, rows, indices, num_streams=0):
        return stash.draft_table


#: After bookkeeping: 10 tokens before the window, d1 accepted, one sampled -> 13 tokens,
#: the last accepted token (d1) at position 11.
SAMPLED = [[101, 5], [201, 6]]
NUM_TOKENS = np.array([13, 13])


def _token_ids(d1_first=101, d1_second=201) -> np.ndarray:
    tokens = np.zeros((2, 32), dtype=np.int32)
    tokens[0, 10:13] = [100, d1_first, 5]
    tokens[1, 10:13] = [200, d1_second, 6]
    return tokens


def _proposer(target=None, **fields):
    """A proposer of an engine whose ``additional_config["specstream"]`` holds ``fields``
    (prompt lookup off unless they say otherwise: no runner hands it request ids)."""
    fields = {"prompt_lookup": "off"} | fields
    from types import SimpleNamespace

    from vllm_specstream.model_executor.proposer import SpecStreamProposer

    spec = SimpleNamespace(num_speculative_tokens=3, num_speculative_tokens_per_batch_size=None)
    config = SimpleNamespace(
        speculative_config=spec,
        model_config=SimpleNamespace(max_model_len=64),
        additional_config={"specstream": fields},
    )
    proposer = SpecStreamProposer(config)
    proposer.load_model(target or _Target())
    return proposer


def test_the_placement_is_decided_once_by_the_field_the_trees_and_the_decoder():
    from vllm_specstream.model_executor.stream_pass import choose_placement

    assert choose_placement(None, eager=True, trees=False)[0] == "window"
    assert choose_placement(None, eager=False, trees=False)[0] == "accepted"
    for eager in (True, False):
        for placement in ("window", "accepted"):
            assert choose_placement(placement, eager, trees=False) == (
                placement,
                "field placement",
            )
        # window rows inside a tree would read keys/values of rejected siblings
        assert choose_placement("window", eager, trees=True)[0] == "accepted"


def test_this_steps_stash_drafts_and_is_cleared():
    proposer = _proposer()
    proposer.target.forward()
    assert proposer.propose(SAMPLED, NUM_TOKENS, _token_ids()) == [[11, 12, 13], [21, 22, 23]]
    assert proposer.target.stash is None and proposer.reader.refused_stashes == 0
    # Proposing again without a forward: the used stash is gone, nothing is drafted.
    assert proposer.propose(SAMPLED, NUM_TOKENS, _token_ids()) == [[], []]


def test_a_stale_stash_is_refused_and_counted(monkeypatch):
    import vllm_specstream.model_executor.stream_drafts as stream_drafts

    warnings = []
    monkeypatch.setattr(stream_drafts.logger, "warning", lambda *a: warnings.append(a[0] % a[1:]))
    proposer = _proposer()
    target = proposer.target
    target.forward()
    target.forward_step += 1  # a later forward that left no stash of its own
    assert proposer.propose(SAMPLED, NUM_TOKENS, _token_ids()) == [[], []]
    assert proposer.reader.refused_stashes == 1 and target.stash is None
    # A stash of this step, but of other tokens at the anchors: another batch's rows.
    target.forward()
    assert proposer.propose(SAMPLED, NUM_TOKENS, _token_ids(d1_second=999)) == [[], []]
    # One with fewer requests than this step has.
    target.forward()
    assert proposer.propose([*SAMPLED, [7]], np.array([13, 13, 5]), None) == [[], [], []]
    assert proposer.reader.refused_stashes == 3
    assert len(warnings) == 1 and "made by forward 1, the last forward was 2" in warnings[0]


def _no_draft_warnings(monkeypatch) -> list[str]:
    from vllm_specstream.speculation import draft_watch

    warnings: list[str] = []
    monkeypatch.setattr(draft_watch.logger, "warning", lambda *a: warnings.append(a[0] % a[1:]))
    return warnings


def test_no_drafts_for_n_steps_warns_once_and_says_why(monkeypatch):
    from vllm_specstream.speculation.draft_watch import NO_DRAFT_STEPS

    warnings = _no_draft_warnings(monkeypatch)
    proposer = _proposer()
    target = proposer.target
    layer = "model.layers.3.self_attn.attn"
    for step in range(3 * NO_DRAFT_STEPS):
        # Every forward misses its batch, as after a rename of vLLM's attention layers.
        target.forward_step += 1
        target.no_stash_reason = f"the stream pass found no forward batch for layer {layer}"
        assert proposer.propose(SAMPLED, NUM_TOKENS, _token_ids()) == [[], []]
        assert len(warnings) == (step + 1 >= NO_DRAFT_STEPS)
    assert warnings[0].startswith(f"no stream drafts for {NO_DRAFT_STEPS} steps: ")
    assert f"no forward batch for layer {layer}" in warnings[0]


def test_no_draft_watch_counts_only_consecutive_expected_steps(monkeypatch):
    from vllm_specstream.speculation.draft_watch import NoDraftWatch

    warnings = _no_draft_warnings(monkeypatch)
    watch = NoDraftWatch(steps=3)
    for _ in range(2):
        watch.step(expected=True, drafted=False, reason="r")
    watch.step(expected=False, drafted=False)  # e.g. only partial prefills: not counted
    watch.step(expected=True, drafted=True)  # drafts again: the count starts over
    for _ in range(2):
        watch.step(expected=True, drafted=False, reason="r")
    assert warnings == []
    for _ in range(5):
        watch.step(expected=True, drafted=False, reason="the reason")
    assert warnings == [
        "no stream drafts for 3 steps: the reason; outputs stay correct, but speculation "
        "gives no speedup (this warning is not repeated)"
    ]


def test_steps_without_drafting_do_not_warn(monkeypatch):
    """Steps where the policy drafts nothing (k = 0) or no request sampled are not
    'expected' steps."""
    from vllm_specstream.speculation.draft_watch import NO_DRAFT_STEPS

    warnings = _no_draft_warnings(monkeypatch)
    proposer = _proposer()
    proposer.lookup = [0, 0]  # a user's schedule of no drafts at any batch size
    for _ in range(NO_DRAFT_STEPS + 1):
        proposer.propose(SAMPLED, NUM_TOKENS, _token_ids())
    proposer.lookup = None
    for _ in range(NO_DRAFT_STEPS + 1):
        proposer.propose([[], []], NUM_TOKENS, _token_ids())
    assert warnings == []


def test_no_forward_batch_reason_names_the_missing_layer(monkeypatch):
    """What the no-draft warning says when vLLM's attention layers are named otherwise."""
    from types import SimpleNamespace

    fc = pytest.importorskip("vllm.forward_context")
    from vllm_specstream.model_executor.forward_batch import (
        current_forward_batch,
        no_forward_batch_reason,
    )

    context = SimpleNamespace(attn_metadata={"language_model.layers.0.self_attn.attn": object()})
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: context)
    layer = "model.layers.3.self_attn.attn"
    assert current_forward_batch(layer, torch.arange(3)) is None
    assert no_forward_batch_reason(layer) == (
        "vLLM's attention metadata has no such layer (it has 1, e.g. "
        "['language_model.layers.0.self_attn.attn'])"
    )
    context.attn_metadata = None
    assert no_forward_batch_reason(layer) == "vLLM passed no attention metadata"


def test_pending_stream_rows_are_taken_at_the_anchors_read_and_only_once():
    """A window's stream states wait in the stash; the proposer takes the anchors it reads
    (the others stay pending, e.g. for an inspection), and nothing is projected twice."""
    batch = ForwardBatch(
        query_start_loc=torch.tensor([0, 3, 6]),
        seq_lens=torch.tensor([9, 9]),
        block_table=torch.zeros(2, 1, dtype=torch.int32),
        positions=torch.tensor([6, 7, 8, 6, 7, 8]),
    )
    stash = StreamStash(1, batch, None, torch.full((6, 2), -1))
    anchors = torch.tensor([[0, 1, 2], [3, 4, -1]])  # request 2's last column: padding
    states = torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).view(2, 3, 2, 4)
    stash.stream_states = (anchors, states)
    taken, got = take_stream_rows(stash, [1, 4])
    assert taken.tolist() == [[-1, 1, -1], [-1, 4, -1]] and got is states
    assert stash.stream_states[0].tolist() == [[0, -1, 2], [3, -1, -1]]
    assert take_stream_rows(stash, [1, 4]) is None  # already taken
    rest, _ = take_stream_rows(stash, None)
    assert rest.tolist() == [[0, -1, 2], [3, -1, -1]]
    assert stash.stream_states is None and take_stream_rows(stash, None) is None
