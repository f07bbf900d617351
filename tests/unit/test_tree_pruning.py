"""Early-exit pruning of draft trees in the verification forward (pure parts, no engine)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_specstream.model_executor.trees.pruning import (
    node_keep_probs,
    prune_batch,
    prune_head_probs,
    scatter_rows,
)
from vllm_specstream.model_executor.trees.sampler import verify_trees
from vllm_specstream.model_executor.trees.step import RowTree, StepTrees, kept_subtree
from vllm_specstream.streams.draft_trees import prune_nodes

TREE = (-1, 0, -1, 1, 0, 2)  # root children 0 and 2; 0 has children 1 and 4; 1 has 3


def test_kept_subtree_renumbers_parents_among_kept_nodes():
    assert kept_subtree(TREE, (0, 1, 3)) == (-1, 0, 1)
    assert kept_subtree(TREE, (0, 2, 4, 5)) == (-1, -1, 0, 1)
    assert kept_subtree(TREE, ()) == ()
    with pytest.raises(ValueError, match="parent 1 pruned"):
        kept_subtree(TREE, (0, 3))


def test_prune_nodes_drops_subtrees_below_the_threshold():
    probs = torch.tensor([0.9, 0.01, 0.5, 0.9, 0.3, 0.9])
    keep = prune_nodes(TREE, probs, 0.1)
    # node 1 is below: it goes with its child 3, whose own probability is high
    assert keep.tolist() == [True, False, True, False, True, True]


def test_prune_batch_keeps_every_row_but_the_pruned_nodes():
    # Batch: a plain decode row (request 0), a tree of 6 nodes (request 1, rows 1-7), a
    # prefill of 3 (request 2), a tree of 3 (request 3, rows 11-14).
    qsl = [0, 1, 8, 11, 15]
    step = StepTrees((RowTree(1, TREE, 40), RowTree(3, (-1, 0, -1), 9)))
    keep = {
        1: torch.tensor([True, False, True, False, True, True]),
        3: torch.tensor([True, True, True]),
    }
    pruned = prune_batch(15, qsl, step, keep)
    assert pruned.removed == [0, 2, 0, 0]
    # request 1's nodes 1 and 3 sit at rows 1 + 1 + 1 = 3 and 1 + 1 + 3 = 5
    assert pruned.keep_rows.tolist() == [0, 1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert pruned.query_start_loc == [0, 1, 6, 9, 13]
    assert pruned.kept == {1: (0, 2, 4, 5), 3: (0, 1, 2)}
    assert prune_batch(15, qsl, step, {1: torch.ones(6, dtype=torch.bool), 3: keep[3]}) is None


def test_node_keep_probs_read_each_nodes_token_at_its_parent():
    # Vocabulary of 10; the "head" is a softmax of the row itself, so row r's distribution is
    # known. Tree row 1 starts at flat row 2: root at 2, nodes 0..5 at rows 3..8.
    vocab = 10
    stream = torch.randn(9, vocab)
    input_ids = torch.tensor([0, 0, 7, 1, 2, 3, 4, 5, 6])
    step = StepTrees((RowTree(1, TREE, 12),))
    calls = []

    def head(rows):
        calls.append(rows.shape[0])
        return rows.softmax(-1)

    probs = node_keep_probs(stream, input_ids, [0, 2, 9], step, head)[1]
    p = stream.softmax(-1)
    parent_rows = [2, 3, 2, 4, 3, 5]  # root, node 0, root, node 1, node 0, node 2
    want = torch.stack([p[r, input_ids[3 + i]] for i, r in enumerate(parent_rows)])
    torch.testing.assert_close(probs, want)
    assert calls == [4]  # one head call, each parent row once


def test_prune_head_probs_is_the_training_formula():
    from torch import nn

    torch.manual_seed(0)
    h, r, vocab = 16, 4, 30
    rows = torch.randn(3, h)
    a, b = torch.randn(r, h), torch.randn(h, r)
    norm = nn.RMSNorm(h, eps=1e-5)
    head = nn.Linear(h, vocab, bias=False)
    want = torch.softmax(head(norm(rows + (rows @ a.T) @ b.T)), -1)
    torch.testing.assert_close(prune_head_probs(rows, a, b, norm, head), want)


def test_scatter_rows_puts_kept_rows_back():
    values = torch.arange(6.0).view(3, 2)
    out = scatter_rows(values, torch.tensor([0, 2, 3]), 5)
    assert out.tolist() == [[0, 1], [0, 0], [2, 3], [4, 5], [0, 0]]


def _metadata(drafts: list[int]):
    n = len(drafts)
    return SimpleNamespace(
        num_draft_tokens=[n],
        cu_num_draft_tokens=torch.tensor([n]),
        cu_num_sampled_tokens=torch.tensor([n + 1]),
        draft_token_ids=torch.tensor(drafts),
    )


def _logits(argmax: list[int], vocab: int = 20) -> torch.Tensor:
    out = torch.zeros(len(argmax), vocab)
    out[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return out


@pytest.mark.parametrize("kept", [None, (0, 2, 4, 5)])
def test_verify_trees_accepts_only_kept_nodes(kept):
    # Drafts per node; the target wants 10 after the root (node 0), then 11 (node 1) after
    # node 0, then 13 (node 3) after node 1. Without pruning the path is 0, 1, 3; with node 1
    # pruned (its row's logits are garbage, here 19), the path stops at node 0 and the bonus
    # is the target's choice there (11).
    drafts = [10, 11, 12, 13, 14, 15]
    argmax = [10, 11, 13, 0, 0, 0, 0]  # rows: root, node 0, ..., node 5
    logits = _logits(argmax)
    step = StepTrees((RowTree(0, TREE, 30),))
    if kept is not None:
        step.kept[0] = kept
        logits[2] = 0.0
        logits[2, 19] = 5.0  # pruned node 1's row: never read
    out = verify_trees(step, _metadata(drafts), logits)
    tokens, moves = out[0]
    if kept is None:
        assert tokens == [10, 11, 13, 0]
        assert step.anchor_offsets[0] == 1 + 3
    else:
        assert tokens == [10, 11]
        assert step.anchor_offsets[0] == 1 + 0
        assert moves == []  # node 0 already sits at depth 1's slot
