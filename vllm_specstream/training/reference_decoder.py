"""Reference speculative-streaming decoder in PyTorch: the ground truth for the vLLM path.

Greedy only. Each step feeds the decided token plus the current draft (a chain, or a tree of
stream top-k candidates pruned by the early-exit head), verifies it with the main stream,
keeps the longest agreeing prefix, and takes the next draft from the streams at the last
accepted position, all in one forward (the paper's parallel design). Output is token for
token the model's plain greedy decoding; ``tokens_per_step`` counts generated tokens per
target forward pass over the decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_specstream.streams.decode_math import (
    DraftTree,
    draft_tree,
    prune_tree,
    tree_accept_greedy,
    tree_template,
)
from vllm_specstream.training.model import KVCache, SpecStreamModel

Tensor = torch.Tensor


@dataclass
class DecodeResult:
    """Generated tokens and acceptance statistics of one request."""

    tokens: list[int]
    """Generated token ids (the prompt excluded)."""
    steps: int = 0
    """Target forward passes after the prefill."""
    accepted: list[int] = field(default_factory=list)
    """Drafts accepted at each step."""
    verified: list[int] = field(default_factory=list)
    """Draft nodes verified at each step (after pruning)."""

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per decode forward pass (the first token comes from the prefill)."""
        return (len(self.tokens) - 1) / self.steps if self.steps else 1.0


def _keep_in_cache(cache: KVCache, past: int, keep: list[int]) -> KVCache:
    """The first ``past`` cached positions plus the step's positions ``keep`` (accepted path)."""
    idx = torch.cat((torch.arange(past), torch.tensor(keep) + past))
    return [(k[:, :, idx], v[:, :, idx]) for k, v in cache]


def _argmax(model: SpecStreamModel, hidden: Tensor) -> list[int]:
    return model.lm_head(hidden).argmax(-1).tolist()


def _stream_topk(model: SpecStreamModel, stream_hidden: Tensor, k: int, n: int) -> list[list[int]]:
    """Top-k tokens of streams ``1..n`` for one anchor (``stream_hidden``: ``[G, h]``), from
    the draft vocabulary if the checkpoint has one."""
    logits = model.stream_logits(stream_hidden[:n])
    return logits.topk(k, dim=-1).indices.tolist()


def _accept(tree: DraftTree, target: list[int]) -> list[int]:
    """Accepted node indices of ``tree``, root first (the batched rule on one request)."""
    parents, tokens = (torch.tensor(x[1:], dtype=torch.long) for x in (tree.parents, tree.tokens))
    accepted = tree_accept_greedy(parents - 1, tokens, torch.tensor(target))
    return [0, *(accepted.path[: accepted.num_accepted] + 1).tolist()]


@torch.no_grad()
def plain_greedy(
    model: SpecStreamModel, prompt: list[int], max_new_tokens: int, eos_token_id: int | None
) -> list[int]:
    """Plain greedy decoding with the same model, one token per forward (no speculation)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = [_argmax(model, out.main_hidden[0, -1])]
    cache = out.cache
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        cache = out.cache
        tokens.append(_argmax(model, out.main_hidden[0, -1]))
    return tokens


@torch.no_grad()
def speculative_generate(
    model: SpecStreamModel,
    prompt: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    num_speculative_tokens: int | None = None,
    top_k: int = 1,
    prune_threshold: float | None = None,
    max_nodes: int | None = None,
) -> DecodeResult:
    """Greedy speculative streaming; ``top_k == 1`` drafts a chain, ``top_k > 1`` a tree
    (its first ``max_nodes`` nodes, as vLLM drafts ``num_speculative_tokens`` of them).

    ``prune_threshold`` (tree only) drops candidates whose early-exit probability given their
    parent is lower (needs a checkpoint with the pruning adapter); None uses the config's, 0
    prunes nothing.
    """
    n_spec = num_speculative_tokens or model.config.num_streams
    if not 1 <= n_spec <= model.config.num_streams:
        raise ValueError(
            f"num_speculative_tokens must be in [1, {model.config.num_streams}], got {n_spec}"
        )
    if top_k > 1 and prune_threshold is None and model.prune_a is not None:
        prune_threshold = model.config.prune.threshold
    template = tree_template(n_spec, top_k, max_nodes=max_nodes)
    out = model(torch.tensor([prompt]), anchors=torch.tensor([[len(prompt) - 1]]), use_cache=True)
    result = DecodeResult(tokens=[_argmax(model, out.main_hidden[0, -1])])
    cache, past = out.cache, len(prompt)
    candidates = _stream_topk(model, out.stream_hidden[0, 0], top_k, n_spec)
    while len(result.tokens) < max_new_tokens and result.tokens[-1] != eos_token_id:
        tree = draft_tree(template, result.tokens[-1], candidates)
        if top_k > 1 and prune_threshold:  # 0: no pruning
            tree = _prune(model, tree, cache, past, prune_threshold)
        n = len(tree.tokens)
        out = model(
            torch.tensor([tree.tokens]),
            anchors=torch.arange(n)[None],
            cache=cache,
            use_cache=True,
            positions=torch.tensor([[past + d for d in tree.depths]]),
            new_mask=tree.ancestor_mask()[None],
        )
        target = _argmax(model, out.main_hidden[0])
        path = _accept(tree, target)
        result.steps += 1
        result.accepted.append(len(path) - 1)
        result.verified.append(n - 1)
        new_tokens = [tree.tokens[i] for i in path[1:]] + [target[path[-1]]]
        for tok in new_tokens:
            if len(result.tokens) >= max_new_tokens or result.tokens[-1] == eos_token_id:
                break
            result.tokens.append(tok)
        cache = _keep_in_cache(out.cache, past, path)
        past += len(path)
        candidates = _stream_topk(model, out.stream_hidden[0, path[-1]], top_k, n_spec)
    return result


def _prune(
    model: SpecStreamModel, tree: DraftTree, cache: KVCache, past: int, threshold: float
) -> DraftTree:
    """Early-exit pruning (paper 3.2.3): a node stays if the pruning head, applied at its
    parent, gives its token at least ``threshold``. Computed over the whole tree first; the
    early-exit layer sits at or below the first MSA layer, so these values are the ones an
    in-forward pruning would see."""
    out = model(
        torch.tensor([tree.tokens]),
        cache=cache,
        positions=torch.tensor([[past + d for d in tree.depths]]),
        new_mask=tree.ancestor_mask()[None],
    )
    probs = torch.softmax(model.prune_logits(out.prune_input[0]).float(), dim=-1)
    keep = [1.0] + [float(probs[p, tok]) for tok, p in zip(tree.tokens[1:], tree.parents[1:])]
    return prune_tree(tree, keep, threshold)
