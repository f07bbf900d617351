"""The reference decoder is token-identical to plain greedy decoding, chain and tree."""

import pytest
import torch
from tiny import tiny_llama

from vllm_specstream.checkpoint.config import PruneConfig, SpecStreamConfig
from vllm_specstream.streams.decode_math import (
    build_tree,
    chain_accept_length,
    prune_tree,
    tree_accept,
)
from vllm_specstream.training.model import SpecStreamModel
from vllm_specstream.training.reference_decoder import plain_greedy, speculative_generate


def test_chain_accept_length():
    assert chain_accept_length([5, 6, 7], [5, 6, 9, 1]) == 2
    assert chain_accept_length([5, 6, 7], [4, 6, 7, 1]) == 0
    assert chain_accept_length([5, 6, 7], [5, 6, 7, 1]) == 3


def test_tree_shape_mask_and_accept():
    tree = build_tree(9, [[1, 2], [3, 4]])
    assert len(tree.tokens) == 1 + 2 + 4
    assert tree.depths == [0, 1, 1, 2, 2, 2, 2]
    mask = tree.ancestor_mask()
    assert mask[5].tolist() == [True, False, True, False, False, True, False]  # 5 -> 2 -> 0
    # target after root picks 2, after node 2 picks 3: path 0 -> 2 -> 5
    target = [2, 0, 3, 0, 0, 0, 0]
    assert tree_accept(tree, target) == [0, 2, 5]
    assert tree.path_to(5) == [0, 2, 5]


def test_prune_drops_subtrees():
    tree = build_tree(9, [[1, 2], [3, 4]])
    keep = [1.0, 0.5, 0.001, 0.5, 0.001, 0.9, 0.9]  # node 2 pruned -> 5, 6 go too
    pruned = prune_tree(tree, keep, 0.01)
    assert pruned.tokens == (9, 1, 3) and pruned.parents == (-1, 0, 1)


def make(seed, prune=False):
    lm = tiny_llama(seed=seed, vocab=64)
    cfg = SpecStreamConfig(
        num_streams=3, num_msa_layers=2, prune=PruneConfig(enabled=prune, threshold=0.02)
    )
    torch.manual_seed(seed)
    model = SpecStreamModel(lm, cfg, stream_init_std=0.5).eval()
    if prune:
        with torch.no_grad():
            model.prune_b.normal_(0, 0.1)
    return model


def make_oracle(model):
    """Streams copy the main stream: drafts are often right, so acceptance paths get exercised."""
    with torch.no_grad():
        model.stream_embeddings.zero_()
    return model


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("top_k,prune", [(1, False), (2, False), (3, True)])
def test_speculative_equals_plain_greedy(seed, top_k, prune):
    model = make(seed, prune)
    if seed == 2:
        make_oracle(model)
    prompt = torch.randint(3, 64, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    want = plain_greedy(model, prompt, 30, eos_token_id=None)
    got = speculative_generate(model, prompt, 30, eos_token_id=None, top_k=top_k)
    assert got.tokens == want
    assert got.steps >= 1 and 1.0 <= got.tokens_per_step <= 4.0
    # Every step verified its whole tree (3 streams of top-k), less what pruning dropped,
    # and accepted no more than it verified.
    full = sum(top_k**d for d in range(1, 4))
    assert len(got.verified) == got.steps and max(got.verified) <= full
    assert all(a <= v for a, v in zip(got.accepted, got.verified))
    if not prune:
        assert set(got.verified) == {full}


def test_oracle_streams_get_accepted_and_hf_agrees():
    model = make_oracle(make(3))
    prompt = [5, 9, 11, 7]
    want = plain_greedy(model, prompt, 24, eos_token_id=None)
    hf = model.lm.generate(
        torch.tensor([prompt]),
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert hf[0, len(prompt) :].tolist() == want
    got = speculative_generate(model, prompt, 24, eos_token_id=None, top_k=1)
    assert got.tokens == want


def test_eos_and_max_tokens_respected():
    model = make(4)
    prompt = [5, 9, 11]
    plain = plain_greedy(model, prompt, 20, eos_token_id=None)
    eos = plain[5]
    got = speculative_generate(model, prompt, 20, eos_token_id=eos)
    assert got.tokens == plain[: plain.index(eos) + 1]
    assert len(speculative_generate(model, prompt, 7, eos_token_id=None).tokens) == 7
