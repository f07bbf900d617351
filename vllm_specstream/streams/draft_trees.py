"""Draft trees as data: one static template per (num_streams, top-k), batched steps over it.

A node list excludes the root (the last accepted token, which sits just before the nodes in a
step's input); parent -1 means the root. A template lists the top-1 chain first and then the
other nodes by depth, so every prefix of it is a tree: a scheduler that keeps the first ``m``
nodes, or pruning that drops a node with its subtree, never strands a child without its
parent, and a chain-only budget is the first ``gamma`` nodes. The per-request steps (fill,
prune, compact, positions, mask, accept, KV compaction) are pure tensor functions over the
template so the reference decoder and the vLLM path run the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class TreeTemplate:
    """Shape of a draft tree shared by every request; each request fills in its tokens."""

    num_streams: int
    """gamma: streams per step; stream ``g``'s top-k candidates are the nodes of depth ``g``."""
    top_k: tuple[int, ...]
    """Children per node at each depth ``1..num_streams`` (sparse, Medusa-style, if unequal)."""
    depths: tuple[int, ...]
    """Depth of each node in ``1..num_streams`` (the root has depth 0)."""
    parents: tuple[int, ...]
    """Parent of each node, -1 for the root; always smaller than the node's own index."""
    ranks: tuple[int, ...]
    """Rank of each node's token among its stream's top-k (0 = top-1)."""

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        """Deepest node (``num_streams`` unless a node cap cut the chain)."""
        return max(self.depths)

    def rank_path(self, node: int) -> tuple[int, ...]:
        """Ranks from depth 1 down to ``node``: the node's identity in the full tree."""
        path = []
        while node >= 0:
            path.append(self.ranks[node])
            node = self.parents[node]
        return tuple(path[::-1])


def _per_depth_top_k(num_streams: int, top_k: int | Sequence[int]) -> tuple[int, ...]:
    if num_streams < 1:
        raise ValueError(f"num_streams must be >= 1 (e.g. 4), got {num_streams}")
    ks = (top_k,) * num_streams if isinstance(top_k, int) else tuple(top_k)
    if len(ks) != num_streams or any(k < 1 for k in ks):
        raise ValueError(
            f"top_k must be an int >= 1 or one int >= 1 per stream ({num_streams} of them, "
            f"e.g. {[2] + [1] * (num_streams - 1)}), got {top_k!r}"
        )
    return ks


def _order_key(path: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """Within a depth: a rank-r candidate is taken as about 1/(r+1) as likely as the top-1
    (Zipf-like), so likelier nodes come first and a node cap keeps them; ties lexicographic."""
    return math.prod(r + 1 for r in path), path


def tree_template(
    num_streams: int, top_k: int | Sequence[int], max_nodes: int | None = None
) -> TreeTemplate:
    """Template of the paper's tree (eq. 4): stream ``g``'s top-k are the children of every
    node of depth ``g - 1``, ``sum_g prod(top_k[:g])`` nodes. Order: the top-1 chain (nodes
    ``0..gamma-1``), then the others by depth and :func:`_order_key`. ``max_nodes`` keeps
    that many first nodes (a prefix, so still a tree; below ``num_streams`` it cuts the chain).
    """
    ks = _per_depth_top_k(num_streams, top_k)
    if max_nodes is not None and max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1 or None (no cap), got {max_nodes}")
    full = sum(math.prod(ks[:g]) for g in range(1, num_streams + 1))
    budget = full if max_nodes is None else min(max_nodes, full)
    chain = [(0,) * g for g in range(1, num_streams + 1)]
    rest: list[tuple[int, ...]] = []
    level: list[tuple[int, ...]] = [()]
    for k in ks:
        if num_streams + len(rest) >= budget:
            break  # deeper nodes all sort after the cut
        level = [path + (r,) for path in level for r in range(k)]
        rest += sorted((path for path in level if any(path)), key=_order_key)
    paths = (chain + rest)[:budget]
    index = {path: i for i, path in enumerate(paths)}
    return TreeTemplate(
        num_streams=num_streams,
        top_k=ks,
        depths=tuple(len(p) for p in paths),
        parents=tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths),
        ranks=tuple(p[-1] for p in paths),
    )


def _parents(tree: TreeTemplate | Tensor | Sequence[int], device=None) -> Tensor:
    if isinstance(tree, TreeTemplate):
        tree = tree.parents
    return torch.as_tensor(tree, dtype=torch.long, device=device)


def _ancestors(parents: Tensor) -> Tensor:
    """``[..., n, n]`` bool: row ``i`` marks ``i`` and its ancestors. Repeated squaring of
    "self or parent": a fixed ``log2(n)`` steps with no host sync, for any parent order."""
    n = parents.shape[-1]
    node = torch.arange(n, device=parents.device)
    reach = (
        (parents[..., :, None] == node) | torch.eye(n, dtype=torch.bool, device=node.device)
    ).float()
    for _ in range(max(n - 2, 0).bit_length()):  # paths of up to n - 1 edges
        reach = ((reach @ reach) > 0).float()
    return reach.bool()


def tree_attention_mask(tree: TreeTemplate | Tensor | Sequence[int], device=None) -> Tensor:
    """``[..., n, n]`` bool: node ``i`` attends to itself and its ancestors. Every node also
    sees the root and the prefix; that part of the mask is the caller's (it is all True)."""
    return _ancestors(_parents(tree, device))


def tree_depths(tree: TreeTemplate | Tensor | Sequence[int], device=None) -> Tensor:
    """Depth of each node (children of the root have depth 1), from parents alone so that
    compacted per-request trees work too."""
    if isinstance(tree, TreeTemplate):
        return torch.tensor(tree.depths, dtype=torch.long, device=device)
    return _ancestors(_parents(tree, device)).sum(-1)


def tree_positions(
    tree: TreeTemplate | Tensor | Sequence[int], base_position: int | Tensor
) -> Tensor:
    """Rotary positions ``root position + depth``: siblings share a position, as the tokens
    they stand for would take the same slot in the sequence. ``base_position`` is the root's
    (an int, or ``[B]`` for ``[B, n]``)."""
    base = torch.as_tensor(base_position, dtype=torch.long)
    depths = tree_depths(tree, base.device)
    return base[..., None] + depths if base.dim() else base + depths


def fill_tree(template: TreeTemplate, stream_topk_tokens: Tensor) -> Tensor:
    """Node tokens ``[..., n]`` from the streams' top-k at the anchor ``[..., G, K]`` (best
    first): paper eq. 4, a depth-``g`` node takes stream ``g``'s candidate of its rank whatever
    its parent, since all streams are computed at the one anchor."""
    *_, num_g, num_k = stream_topk_tokens.shape
    if num_g < template.max_depth or num_k < max(template.top_k):
        raise ValueError(
            f"stream_topk_tokens must be [..., >= {template.max_depth}, >= "
            f"{max(template.top_k)}] for this template, got {list(stream_topk_tokens.shape)}"
        )
    depths = torch.tensor(template.depths, device=stream_topk_tokens.device)
    ranks = torch.tensor(template.ranks, device=stream_topk_tokens.device)
    return stream_topk_tokens.flatten(-2)[..., (depths - 1) * num_k + ranks]


def prune_nodes(
    template: TreeTemplate,
    keep_prob: Tensor,
    threshold: float,
    *,
    cumulative: bool = False,
    max_nodes: int | None = None,
) -> Tensor:
    """Early-exit pruning (paper 3.2.3): ``[..., n]`` bool of kept nodes, closed under
    parents. ``keep_prob[..., i]`` is node ``i``'s token probability under the pruning head at
    its parent; a node below ``threshold`` goes with its subtree. ``cumulative`` compares the
    path probability (product from the root) instead. ``max_nodes`` then keeps the first
    kept nodes in template order, which stays a tree because parents come first."""
    anc = tree_attention_mask(template, keep_prob.device)
    if cumulative:
        path_logp = keep_prob.double().clamp(min=1e-300).log() @ anc.T.double()
        keep = path_logp >= math.log(threshold) if threshold > 0 else path_logp > -math.inf
    else:
        low = keep_prob < threshold
        keep = ~(low[..., None, :] & anc).any(-1)
    if max_nodes is not None:
        keep = keep & (keep.cumsum(-1) <= max_nodes)
    return keep


class CompactTree(NamedTuple):
    """Per-request kept nodes moved to the front, in template order (so still a tree)."""

    index: Tensor
    """``[..., n]`` template index of each kept node; -1 past ``num_nodes``."""
    parents: Tensor
    """``[..., n]`` parent as a position in ``index`` (-1: root, or padding)."""
    num_nodes: Tensor
    """``[...]`` kept nodes per request."""


def compact_tree(template: TreeTemplate, keep: Tensor) -> CompactTree:
    """Move each request's kept nodes (a parent-closed set, e.g. from :func:`prune_nodes`) to
    a prefix. Any prefix of the result is a tree, so a token budget may cut it further."""
    n = template.num_nodes
    parents = _parents(template, keep.device).expand(keep.shape)
    new_pos = keep.long().cumsum(-1) - 1
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    num_nodes = keep.sum(-1)
    valid = torch.arange(n, device=keep.device) < num_nodes[..., None]
    new_parents = torch.where(parents >= 0, new_pos.gather(-1, parents.clamp(min=0)), -1)
    return CompactTree(
        index=torch.where(valid, order, -1),
        parents=torch.where(valid, new_parents.gather(-1, order), -1),
        num_nodes=num_nodes,
    )


class TreeAcceptance(NamedTuple):
    """Greedy verification of a tree, per request."""

    path: Tensor
    """``[..., D]`` accepted node at depth ``1..D``; -1 past ``num_accepted``."""
    num_accepted: Tensor
    """``[...]`` accepted drafts."""
    bonus_token: Tensor
    """``[...]`` the target's token after the last accepted node (or after the root)."""


def tree_accept_greedy(
    parents: TreeTemplate | Tensor | Sequence[int],
    tokens: Tensor,
    target_argmax: Tensor,
    max_depth: int | None = None,
) -> TreeAcceptance:
    """Follow, from the root, the child whose token equals the target's choice at its parent.

    ``tokens`` ``[..., n]`` (padding -1 never matches); ``target_argmax`` ``[..., n + 1]`` for
    the step input ``[root, node 0, ..., node n-1]``. Siblings hold distinct top-k tokens, so at
    most one child matches; if two did, the first in node order wins. ``path`` has
    ``max_depth`` columns (at least the deepest node's depth): as given, else the template's,
    else read from the tree (a host sync).
    """
    par = _parents(parents, tokens.device).expand(tokens.shape)
    n = tokens.shape[-1]
    match = tokens == target_argmax.gather(-1, par + 1)
    earlier = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril(-1)
    sibling = (par[..., :, None] == par[..., None, :]) & earlier
    first = match & ~(sibling & match[..., None, :]).any(-1)
    anc = _ancestors(par)
    on_path = ~(anc & ~first[..., None, :]).any(-1)
    depth = anc.sum(-1)
    if max_depth is None:
        template = isinstance(parents, TreeTemplate)
        max_depth = parents.max_depth if template else int(depth.max()) if n else 0
    slot = torch.where(on_path, depth - 1, max_depth)  # off-path nodes land in a spare column
    path = torch.full((*tokens.shape[:-1], max_depth + 1), -1, device=tokens.device)
    node = torch.arange(n, device=tokens.device).expand(tokens.shape)
    path = path.scatter(-1, slot, node)[..., :max_depth]
    # parents precede children, so the deepest accepted node is the largest accepted index
    last = torch.nn.functional.pad(torch.where(on_path, node, -1), (1, 0), value=-1).amax(-1)
    bonus = target_argmax.gather(-1, (last + 1)[..., None]).squeeze(-1)
    return TreeAcceptance(path, on_path.sum(-1), bonus)


def tree_accept_sampled(
    parents: TreeTemplate | Sequence[int],
    tokens: Sequence[int],
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[tuple[int, ...], int]:
    """Speculative sampling over a tree of drafted tokens: ``(accepted nodes, bonus token)``,
    distributed exactly as sampling the target token by token.

    ``target_probs`` ``[n + 1, V]``: the target's distribution at ``[root, node 0, ...]``
    (temperature, top-k and top-p applied). The drafts are tokens, not distributions (each
    stream's top-k), so at a node its children are tried in node order with the residual
    rule of multi-candidate speculative sampling for one-hot drafts: child token ``c`` is
    accepted with probability ``r(c)``, where ``r`` starts as the node's target distribution;
    a rejected child's token gets ``r(c) = 0`` and ``r`` is renormalised. An accepted child
    becomes the current node; where every child is rejected (or the node is a leaf) the
    bonus token is drawn from ``r``. Each output token is then drawn from the target's
    distribution given the tokens before it: P(c_i first accepted) = r_i(c_i) prod (1 -
    r_j(c_j)) = p(c_i), and the bonus draw covers the remaining mass.
    """
    par = parents.parents if isinstance(parents, TreeTemplate) else tuple(int(p) for p in parents)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(par):
        children.setdefault(parent, []).append(node)
    path: list[int] = []
    node = -1
    while True:
        residual = target_probs[node + 1].to(torch.float64).clone()
        for child in children.get(node, ()):
            token = int(tokens[child])
            mass = float(residual.sum())
            u = float(torch.rand((), dtype=torch.float64, generator=generator))
            if mass > 0 and u * mass < float(residual[token]):
                path.append(child)
                node = child
                break
            residual[token] = 0.0
        else:
            bonus = torch.multinomial(residual / residual.sum(), 1, generator=generator)
            return tuple(path), int(bonus)


def accepted_path_compaction(path: Tensor, row_start: int | Tensor = 0, offset: int = 1) -> Tensor:
    """``[M, 2]`` (src, dst) rows that copy the accepted nodes' KV right after the root.

    Node ``i`` of a request sits at row ``row_start + offset + i`` (the root at ``row_start``);
    the node at depth ``d`` must end up at ``row_start + offset + d - 1``. Only real moves are
    listed (a top-1 chain acceptance needs none). Each ``dst`` is below its ``src`` and below
    every later ``src``, so copying in list order or all at once gives the same result.
    """
    paths = path.reshape(-1, path.shape[-1])
    start = torch.as_tensor(row_start, dtype=torch.long, device=path.device).reshape(-1, 1)
    depth_slot = torch.arange(paths.shape[-1], device=path.device)
    move = (paths >= 0) & (paths != depth_slot)
    src = (start + offset + paths).expand(paths.shape)
    dst = (start + offset + depth_slot).expand(paths.shape)
    return torch.stack((src[move], dst[move]), -1)
