"""Tree drafts between proposer, runner, model and sampler (pure parts, no engine)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.model_executor.stream_drafts import tree_anchor_indices
from vllm_specstream.model_executor.trees.step import (
    TreeBook,
    accept_row,
    build_step,
    depth_positions,
    is_chain,
    tree_problem,
)
from vllm_specstream.speculation.settings import (
    EngineSettings,
    draft_tree_of,
    resolve_settings,
    tree_top_k_from,
)
from vllm_specstream.streams.draft_trees import tree_template

TREE = (-1, 0, -1, 1, 0, 2)  # two root children (0, 2); 0 has children 1 and 4


def test_book_files_trees_and_build_step_matches_them_to_rows():
    book = TreeBook()
    book.file(
        ["a", "b", "c", "d"],
        [[5, 6, 7, 8, 9, 10], [1, 2, 3], [], [4, 4, 4, 4, 4, 4]],
        [TREE, (-1, 0, 1), None, TREE],
    )
    filed = book.take()
    assert set(filed) == {"a", "d"}  # chains and empty drafts need no entry
    assert book.take() == {}  # one step only
    # Batch order differs from the proposal's; "a" scheduled in full, "d" cut to a prefix
    # of 4 (a tree still), "b" a chain, "x" never filed.
    scheduled = {"d": [4, 4, 4, 4], "a": [5, 6, 7, 8, 9, 10], "b": [1, 2, 3], "x": [3]}
    step = build_step(["x", "d", "b", "a"], scheduled, np.array([7, 20, 30, 40]), filed)
    assert [(t.row, t.parents, t.root_position) for t in step.rows] == [
        (1, TREE[:4], 20),
        (3, TREE, 40),
    ]
    # drafts that are not the filed ones (vLLM's placeholders near max_model_len): a chain
    step = build_step(["a"], {"a": [0, 0, 0]}, np.array([5]), filed)
    assert step.rows == ()
    # a prefix that is a chain is verified as vLLM does
    step = build_step(["a"], {"a": [5, 6]}, np.array([5]), filed)
    assert step.rows == () and is_chain(TREE[:2])


def test_depth_positions_give_siblings_one_position():
    step = build_step(
        ["a", "b"],
        {"a": [5, 6, 7, 8, 9, 10]},
        np.array([10, 3]),
        {"a": TreeBook_filed((5, 6, 7, 8, 9, 10), TREE)},
    )
    positions = torch.tensor([10, 11, 12, 13, 14, 15, 16, 3, 4, 5])  # a: root + 6 nodes; b
    got = depth_positions(positions, [0, 7, 10], step)
    assert got.tolist() == [10, 11, 12, 11, 13, 12, 12, 3, 4, 5]
    assert positions.tolist()[1:7] == [11, 12, 13, 14, 15, 16]  # the runner's tensor untouched
    assert depth_positions(positions, [0, 7, 10], build_step([], {}, np.array([]), {})) is positions


def TreeBook_filed(tokens, parents):
    book = TreeBook()
    book.file(["r"], [list(tokens)], [parents])
    return book.take()["r"]


@pytest.mark.parametrize(
    "target, nodes, bonus, moves",
    [
        ([7, 1, 1, 10, 2, 2, 3], (2, 5), 3, [(103, 101), (106, 102)]),  # the second branch
        ([5, 9, 1, 1, 2, 2, 3], (0, 4), 2, [(105, 102)]),  # off-chain at depth 2
        ([5, 6, 1, 8, 2, 2, 3], (0, 1), 1, []),  # the chain: nothing moves
        ([4, 6, 1, 8, 2, 2, 3], (), 4, []),  # nothing accepted: the root's choice
    ],
)
def test_accept_row_follows_the_targets_choice(target, nodes, bonus, moves):
    tokens = torch.tensor([5, 6, 7, 8, 9, 10])
    got = accept_row(TREE, tokens, torch.tensor(target))
    assert (got.nodes, got.bonus) == (nodes, bonus)
    assert got.kv_moves(100) == moves


def _params(**kw):
    base = dict(
        temperature=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        bad_words=None,
        logprobs=None,
        min_tokens=0,
        logit_bias=None,
        allowed_token_ids=None,
        structured_outputs=None,
        min_p=0.0,
    )
    return SimpleNamespace(**{**base, **kw})


def test_tree_problem_names_what_reads_drafts_as_a_chain():
    assert tree_problem(_params()) is None
    assert tree_problem(_params(temperature=0.7)) is None  # speculative tree sampling
    assert tree_problem(_params(temperature=0.7, min_p=0.1)) == "min_p"
    assert tree_problem(_params(min_p=0.1)) is None  # greedy: min-p changes nothing
    assert tree_problem(_params(repetition_penalty=1.1)) == "penalties"
    assert tree_problem(_params(logprobs=0)) == "logprobs"
    assert tree_problem(_params(min_tokens=3)) == "min_tokens"
    assert tree_problem(_params(structured_outputs=object())) == "structured output"


def test_tree_anchor_indices_use_the_samplers_offsets():
    step = build_step([], {}, np.array([]), {})
    step.anchor_offsets.update({1: 5, 2: 0})
    # rows 0..2 start at 0, 4, 12; row 0 keeps the chain layout
    assert tree_anchor_indices([0, 1, 2], [2, 6, 14], [0, 4, 12, 20], step) == [2, 9, 12]
    assert tree_anchor_indices([0], [2], [0, 4], None) == [2]


def _engine_config(k=6, **fields):
    spec = SimpleNamespace(method="custom_class", model=None, num_speculative_tokens=k)
    return SimpleNamespace(
        speculative_config=spec,
        model_config=SimpleNamespace(max_model_len=64),
        additional_config={"specstream": fields},
    )


def test_tree_options_and_template_size():
    assert tree_top_k_from(None) is None and tree_top_k_from(0) is None
    assert tree_top_k_from([1, 1]) is None
    assert tree_top_k_from([3, 2, 1, 1]) == (3, 2, 1, 1) and tree_top_k_from(2) == (2,)
    with pytest.raises(ConfigError, match=r"\['tree_top_k'\]='two'"):
        tree_top_k_from("two")
    tree = draft_tree_of(EngineSettings(num_speculative_tokens=8, tree_top_k=(2,)), 4)
    assert tree == tree_template(4, 2, max_nodes=8) and tree.parents[:4] == (-1, 0, 1, 2)
    with pytest.raises(ConfigError, match="exceeds the 4 nodes"):
        draft_tree_of(EngineSettings(num_speculative_tokens=5, tree_top_k=(1, 1, 1, 1)), 4)
    with pytest.raises(ConfigError, match="one per stream"):
        draft_tree_of(EngineSettings(num_speculative_tokens=5, tree_top_k=(2, 2)), 4)
    assert resolve_settings(_engine_config(tree_top_k=2), {}).trees
    assert not resolve_settings(_engine_config(), {}).trees
    assert not resolve_settings(_engine_config(k=0, tree_top_k=2), {}).trees  # no speculation
    # pruning: unset (the checkpoint's threshold), off, a threshold; bad values name the field
    assert resolve_settings(_engine_config(), {}).tree_prune is None
    assert resolve_settings(_engine_config(tree_prune="off"), {}).tree_prune == 0.0
    assert resolve_settings(_engine_config(tree_prune=0.05), {}).tree_prune == 0.05
    for bad in (1.5, -0.1, "some"):
        with pytest.raises(ConfigError, match=r"\['tree_prune'\]"):
            resolve_settings(_engine_config(tree_prune=bad), {})


def test_tree_sampling_reads_the_distribution_vllms_sampler_forms():
    from vllm_specstream.model_executor.trees.sampler import sampling_temperature, target_probs

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    metadata = SimpleNamespace(
        all_greedy=False,
        temperature=torch.tensor([0.0, 1.0, 0.5]),
        top_k=torch.tensor([4, 4, 2]),
        top_p=None,
    )
    assert sampling_temperature(metadata, 0) == 0.0  # greedy row: argmax acceptance
    assert sampling_temperature(SimpleNamespace(all_greedy=True), 2) == 0.0
    assert torch.allclose(target_probs(logits, metadata, 1), logits.softmax(-1))
    # temperature 0.5, then top-2: the two likeliest tokens at logits 4 and 2
    want = torch.tensor([4.0, 2.0]).softmax(-1)
    got = target_probs(logits, metadata, 2)
    assert torch.allclose(got[:, :2], want.expand(3, 2)) and not got[:, 2:].any()
