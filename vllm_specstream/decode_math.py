"""Decode math of speculative streaming as small pure functions: drafts, trees, acceptance.

Trees are data (Medusa-style): a :class:`DraftTree` holds each node's token, parent and
depth; masks and positions are derived from it once. Node 0 is the root, the token that is
already decided (sampled by the previous verification); nodes 1.. are draft candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """A token tree rooted at the decided token; nodes in breadth-first order."""

    tokens: tuple[int, ...]
    """Token of each node; ``tokens[0]`` is the root."""
    parents: tuple[int, ...]
    """Parent node of each node (-1 for the root)."""

    @property
    def depths(self) -> list[int]:
        depths = [0] * len(self.tokens)
        for i, p in enumerate(self.parents):
            if p >= 0:
                depths[i] = depths[p] + 1
        return depths

    def ancestor_mask(self) -> Tensor:
        """``[n, n]`` bool: node ``i`` sees node ``j`` iff ``j`` is ``i`` or an ancestor."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = self.parents[j]
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def build_tree(root: int, stream_topk: list[list[int]]) -> DraftTree:
    """Paper eq. 4: stream ``j``'s top-k tokens are the children of every node of depth ``j-1``.

    ``stream_topk[j-1]`` lists stream ``j``'s candidates, best first. With ``k`` candidates per
    stream and ``G`` streams the tree has ``1 + sum_g k^g`` nodes.
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
    early-exit head) is below ``threshold``, with its subtree. The root always stays."""
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
    the target's choice at its parent. Returns the accepted node indices, root first."""
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
