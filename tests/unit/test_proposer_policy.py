"""The proposer as the policy or the user's schedule drive it: what it drafts, which steps
it times under which choice, draft trees, and the confidence rule's cut drafts."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_proposer import _Target as ForwardTarget
from test_settings import _vllm_config

from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.proposer import SpecStreamProposer
from vllm_specstream.model_executor.stash import StreamStash
from vllm_specstream.model_executor.stream_drafts import drafts_at
from vllm_specstream.speculation.choices import AnchoredChain, TreeChoice
from vllm_specstream.speculation.policy import lookup_length
from vllm_specstream.streams.decode_math import confident_drafts


def test_lookup_length_carries_the_last_entry():
    assert [lookup_length([0, 4, 4, 2], b) for b in (1, 3, 99)] == [4, 2, 2]


class _Target(ForwardTarget):
    """Just enough of the model for ``propose``: a stash with one decode row per request."""

    window_streams = 4

    def __init__(self, num_requests: int):
        n = num_requests
        qsl = torch.arange(n + 1)
        self.forward_step = 1
        self.no_stash_reason = None
        self.stash = StreamStash(
            step=1,
            batch=ForwardBatch(qsl, torch.full((n,), 6), torch.zeros(n, 1), torch.full((n,), 5)),
            input_ids=None,
            draft_table=torch.tensor([[11, 12, 13, 14]] * n),
        )


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

    placement = "window"

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
    # when they came from the anchors (the step verifying them runs no window streams).
    a2 = AnchoredChain(2)
    proposer = SpecStreamProposer(_vllm_config(4))
    target = _WindowTarget(1, 4)
    proposer.load_model(target)
    assert a2 in proposer.policy.choices()
    timed, lengths, windows = [], [], []
    for k in [2, 4, 4, 0, 3, 2, a2, a2, 2, 2]:
        # this step's forward ran the streams the last call asked for (4 at first)
        target.stash = _WindowTarget(1, target.window_streams).stash
        proposer.draft_length = lambda batch_size, k=k: k
        lengths.append(len(proposer.propose([[1]], np.full(1, 7), None)[0]))
        timed.append(proposer.step_timer.last_choice)
        windows.append(target.window_streams)
    assert lengths == [2, 2, 4, 0, 3, 2, 2, 2, 2, 2]
    assert windows == [2, 4, 4, 0, 3, 2, 0, 0, 2, 2]
    assert timed == [2, None, 4, 0, None, 2, None, a2, None, 2]
    # An accepted-placement engine drafts every chain from the anchors: no anchored twins.
    accepted = SpecStreamProposer(_vllm_config(4))
    accepted.load_model(_Target(1))
    assert not any(isinstance(c, AnchoredChain) for c in accepted.policy.choices())


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


def test_tensor_parallel_ranks_choose_without_their_clocks():
    # Every rank's proposer chooses on its own and all must choose alike: no rank's clock
    # enters the choice (no timed steps, no timing probes, no calibration steps).
    config = _vllm_config(4)
    config.parallel_config = SimpleNamespace(tensor_parallel_size=3)
    proposer = SpecStreamProposer(config)
    proposer.load_model(_WindowTarget(1, 4))
    cost = proposer.policy.costs
    assert not cost.measure
    for _ in range(8):
        cost.record(1, 0, 0.05)
        cost.record(1, 4, 0.06)
    assert cost.times == {} and not cost.timed(1, 4)
    choices = {proposer.policy.draft_length(1) for _ in range(64)}
    assert choices == {proposer.policy.best(1)}


T6, T8, T8P = TreeChoice(6), TreeChoice(8), TreeChoice(8, prune=True)
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

    placement = "accepted"  # as the model's: trees run the streams at the anchors


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


def test_tree_engine_runs_its_chains_at_the_anchors(tree_rows):
    # An eager tree engine asked for the default (window) placement runs `accepted`: its
    # chains are at most its streams long.
    proposer, _ = _tree_proposer(_vllm_config(8))
    assert proposer.target.placement == "accepted"
    assert proposer.policy.k_max == 4 and not hasattr(proposer.target, "window_streams_at")


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
    # A model that prunes its trees: each width also pruned.
    pruning = SpecStreamProposer(_vllm_config(8))
    target = _TreeTarget(2)
    target.prune_threshold = 0.01
    pruning.load_model(target)
    assert pruning.policy.trees == (T6, TreeChoice(6, True), T8, T8P)

    # The priors: no tree beats the chains at the row model's costs; no tree filed.
    drafts = propose([[1], [1]])
    assert drafts[0] == drafts[1] and drafts[0] == [11, 12, 13, 14][: len(drafts[0])]
    assert WORKER_TREES.book.take() == {}
    # vLLM kept none of those drafts, and 8-node trees are seen to keep 4: they pay.
    proposer.policy.tree_stats[T8].record([4] * 100)
    proposer.policy.tree_stats[T6].record([1] * 100)
    drafts = propose([[1], [1]])
    assert drafts[0] == [11, 12, 13, 14, 21, 22, 12, 22]  # fill_tree: the chain first
    assert drafts[1] == [11, 12, 13, 14]  # logprobs: a chain beside the tree
    assert proposer.reader.tree_rows == {0} and list(WORKER_TREES.book.take()) == ["a"]
    assert proposer.target.prune_trees is False  # an unpruned choice
    # The next call reads what the step kept: the tree row its path, the chain row its
    # drafts; only the chain row's drafts enter the chain estimate, the path the 8-node
    # tree's.
    monkeypatch.setattr(WORKER_TREES, "step", StepTrees((RowTree(0, tree.parents, 6),)))
    tree_stats = proposer.policy.tree_stats[T8]
    rows_before = tree_stats.rows
    stats = proposer.policy.stats
    tried_before, accepted_before = stats.tried.copy(), stats.accepted.copy()
    # Now the 6-node tree is seen to keep as much: the narrower tree is drafted (the first
    # six nodes of the template), and pruned where that is the choice.
    proposer.policy.tree_stats[T6].record([4] * 1000)
    drafts = propose([[1, 2, 3, 4], [1, 2]])
    assert tree_stats.rows == pytest.approx(rows_before * 0.98 + 1)
    assert tree_stats.accepted == pytest.approx(400 * 0.98 + 3)
    assert (stats.tried - tried_before * 0.98).tolist() == pytest.approx([1, 1, 0, 0])
    assert (stats.accepted - accepted_before * 0.98).tolist() == pytest.approx([1, 0, 0, 0])
    assert drafts[0] == [11, 12, 13, 14, 21, 22]
    assert WORKER_TREES.book.take()["a"].parents == tree.parents[:6]
    monkeypatch.setattr(WORKER_TREES, "step", None)
    monkeypatch.setattr(proposer.policy, "draft_length", lambda *a: TreeChoice(6, True))
    propose([[1], [1]])
    assert proposer.target.prune_trees is True
