"""Decode math of speculative streaming as small pure functions: drafts, trees, acceptance.

Trees are data (Medusa-style). Their shape is a :class:`TreeTemplate` (``draft_trees``: top-1
chain first, every prefix a tree) with batched tensor steps over it, re-exported here so this
module stays the one place to import decode math from. A :class:`DraftTree` is one request's
filled tree with the root included: node 0 is the token already decided (sampled by the
previous verification), nodes 1.. are draft candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_specstream.streams.draft_trees import (
    CompactTree,
    TreeAcceptance,
    TreeTemplate,
    accepted_path_compaction,
    compact_tree,
    fill_tree,
    prune_nodes,
    tree_accept_greedy,
    tree_accept_sampled,
    tree_attention_mask,
    tree_depths,
    tree_positions,
    tree_template,
)

__all__ = [
    "CompactTree",
    "DraftTree",
    "TreeAcceptance",
    "TreeTemplate",
    "accepted_path_compaction",
    "build_tree",
    "chain_accept_length",
    "compact_tree",
    "draft_tree",
    "fill_tree",
    "prune_nodes",
    "prune_tree",
    "tree_accept",
    "tree_accept_greedy",
    "tree_accept_sampled",
    "tree_attention_mask",
    "tree_depths",
    "tree_positions",
    "tree_template",
]

Tensor = torch.Tensor


def chain_accept_length(drafts: list[int], target_argmax: list[int]) -> int:
    """Greedy verification of a chain: how many leading drafts the target agrees with.

    ``target_argmax[i]`` is the target's choice after the root and ``drafts[:i]``; draft ``i``
    is accepted while it equals that choice.
    """
    a = 0
    while a < len(drafts) and drafts[a] == target_argmax[a]:
        a += 1
    return a


@dataclass(frozen=True)
class DraftTree:
    """A token tree rooted at the decided token; every node comes after its parent."""

    tokens: tuple[int, ...]
    """Token of each node; ``tokens[0]`` is the root."""
    parents: tuple[int, ...]
    """Parent node of each node (-1 for the root)."""

    @property
    def depths(self) -> list[int]:
        """Depth of each node, the root's 0."""
        return (tree_depths(self.parents) - 1).tolist()

    def ancestor_mask(self) -> Tensor:
        """``[n, n]`` bool: node ``i`` sees node ``j`` iff ``j`` is ``i`` or an ancestor."""
        return tree_attention_mask(self.parents)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def draft_tree(
    template: TreeTemplate, root: int, stream_topk: Sequence[Sequence[int]]
) -> DraftTree:
    """One request's tree in template order: paper eq. 4 on the template's shape.

    ``stream_topk[j-1]`` lists stream ``j``'s candidates, best first; a node of depth ``j`` and
    rank ``r`` takes ``stream_topk[j-1][r]`` (the list form of :func:`fill_tree`).
    """
    tokens = [stream_topk[d - 1][r] for d, r in zip(template.depths, template.ranks)]
    return DraftTree((root, *tokens), (-1, *(p + 1 for p in template.parents)))


def build_tree(root: int, stream_topk: list[list[int]]) -> DraftTree:
    """Paper eq. 4: stream ``j``'s top-k tokens are the children of every node of depth ``j-1``.

    ``stream_topk[j-1]`` lists stream ``j``'s candidates, best first. With ``k`` candidates per
    stream and ``G`` streams the tree has ``1 + sum_g k^g`` nodes. Breadth-first layout, the
    literal reading of eq. 4; drafting uses :func:`draft_tree`, the same nodes in template order.
    """
    tokens, parents = [root], [-1]
    level = [0]
    for candidates in stream_topk:
        next_level = []
        for parent in level:
            for tok in candidates:
                tokens.append(tok)
                parents.append(parent)
                next_level.append(len(tokens) - 1)
        level = next_level
    return DraftTree(tuple(tokens), tuple(parents))


def prune_tree(tree: DraftTree, keep_prob: list[float], threshold: float) -> DraftTree:
    """Drop every node whose probability given its parent (``keep_prob[i]``, from the
    early-exit head) is below ``threshold``, with its subtree. The root always stays. The
    one-request form of :func:`prune_nodes` followed by :func:`compact_tree`."""
    kept: list[int] = []
    new_index: dict[int, int] = {}
    for i, p in enumerate(tree.parents):
        if i == 0 or (p in new_index and keep_prob[i] >= threshold):
            new_index[i] = len(kept)
            kept.append(i)
    return DraftTree(
        tuple(tree.tokens[i] for i in kept),
        tuple(-1 if i == 0 else new_index[tree.parents[i]] for i in kept),
    )


def tree_accept(tree: DraftTree, target_argmax: list[int]) -> list[int]:
    """Greedy verification of a tree: the longest root path whose every child token equals
    the target's choice at its parent. Returns the accepted node indices, root first. The
    one-request loop that :func:`tree_accept_greedy` computes batched."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    path = [0]
    while True:
        node = path[-1]
        nxt = [c for c in children.get(node, []) if tree.tokens[c] == target_argmax[node]]
        if not nxt:
            return path
        path.append(nxt[0])


def confident_drafts(tokens: torch.Tensor, top_prob: torch.Tensor, min_prob: float) -> torch.Tensor:
    """``tokens`` (``[N, G]`` stream top-1 tokens per anchor) with -1 from the first stream
    whose cumulative top-1 probability (``top_prob``, ``[N, G]``) is below ``min_prob``."""
    keep = torch.cumprod(top_prob, dim=-1) >= min_prob
    return torch.where(keep, tokens, torch.full_like(tokens, -1))
