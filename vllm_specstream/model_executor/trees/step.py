"""Tree drafts across one engine step: what the proposer drafted, what the runner scheduled,
what the sampler accepted.

vLLM hands a proposer's drafts to the next step as a flat token list per request and never
says which request a batch row is to the model, the attention backend or the sampler. This
module is the one place that keeps the trees between those points, in the worker process:

1. the proposer files each request's tree (:meth:`TreeBook.file`, keyed by request id);
2. when the runner has prepared a step, :func:`build_step` matches the scheduled drafts to
   the filed trees (a prefix the scheduler kept is still a tree; drafts that are not the
   filed ones, e.g. vLLM's placeholder drafts near ``max_model_len``, are verified as a
   chain) and gives the batch rows that are trees;
3. the model forward reads that step (rotary positions by depth, the ancestor mask in
   attention), the sampler accepts a path per tree and records where each request's last
   accepted token sits in the forward (:attr:`StepTrees.anchor_offsets`) for the proposer.

Everything here is plain data and pure functions; the runner hooks are
:mod:`vllm_specstream.patches.tree_runner`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specstream.streams.draft_trees import (
    accepted_path_compaction,
    tree_accept_greedy,
    tree_depths,
)


@dataclass(frozen=True)
class FiledTree:
    """A request's drafts as the proposer returned them."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    """Parent of each node (-1: the root, the request's last accepted token)."""


@dataclass(frozen=True)
class RowTree:
    """A batch row whose scheduled drafts are a (non-chain) tree."""

    row: int
    """The request's row in this step's batch."""
    parents: tuple[int, ...]
    """Parents of the scheduled nodes (a prefix of the filed tree)."""
    root_position: int
    """Position of the root (tokens in the cache before this step)."""


@dataclass
class StepTrees:
    """The trees of one prepared step."""

    rows: tuple[RowTree, ...] = ()
    #: Filled by the sampler: batch row -> offset, from the row's first scheduled token, of
    #: its deepest accepted node in the forward (0: the root). Rows not listed keep vLLM's
    #: chain layout (offset = number of accepted drafts).
    anchor_offsets: dict[int, int] = field(default_factory=dict)
    #: Filled by the forward when early-exit pruning dropped nodes: batch row -> the node
    #: indices kept (only those can be accepted; :mod:`.pruning`).
    kept: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def row_tree(self, row: int) -> RowTree | None:
        return next((t for t in self.rows if t.row == row), None)


def kept_subtree(parents: Sequence[int], kept: Sequence[int]) -> tuple[int, ...]:
    """Parents of the ``kept`` nodes (indices into ``parents``, in order, closed under
    parents) renumbered among themselves (-1: the root)."""
    index = {node: i for i, node in enumerate(kept)}
    out = []
    for node in kept:
        p = parents[node]
        if p >= 0 and p not in index:
            raise ValueError(f"kept node {node} has its parent {p} pruned")
        out.append(-1 if p < 0 else index[p])
    return tuple(out)


def is_chain(parents: Sequence[int]) -> bool:
    """Whether node ``i``'s parent is ``i - 1`` throughout (vLLM's own layout)."""
    return all(p == i - 1 for i, p in enumerate(parents))


class TreeBook:
    """Trees the proposer returned, by request id, until the next step is prepared."""

    def __init__(self) -> None:
        self._filed: dict[str, FiledTree] = {}

    def file(self, req_ids: Sequence[str], drafts: Sequence[Sequence[int]], parents) -> None:
        """Replace the book with this proposal: ``drafts[i]`` of request ``req_ids[i]`` with
        parents ``parents[i]`` (None: a chain, which needs no entry)."""
        self._filed = {
            req_id: FiledTree(tuple(d), tuple(p))
            for req_id, d, p in zip(req_ids, drafts, parents)
            if p is not None and d and not is_chain(p)
        }

    def take(self) -> dict[str, FiledTree]:
        filed, self._filed = self._filed, {}
        return filed


def build_step(
    req_ids: Sequence[str],
    scheduled_drafts: Mapping[str, Sequence[int]],
    num_computed_tokens: np.ndarray,
    filed: Mapping[str, FiledTree],
) -> StepTrees:
    """The rows of a prepared step whose scheduled drafts are a filed tree (or a prefix of
    one) that is not a chain. ``num_computed_tokens[row]``: the row's tokens in the cache."""
    rows = []
    for row, req_id in enumerate(req_ids):
        tree = filed.get(req_id)
        drafts = scheduled_drafts.get(req_id)
        if tree is None or not drafts:
            continue
        n = len(drafts)
        if n > len(tree.tokens) or tuple(drafts) != tree.tokens[:n]:
            continue  # not the drafts the proposer filed: vLLM's chain handling
        parents = tree.parents[:n]
        if not is_chain(parents):
            rows.append(RowTree(row, parents, int(num_computed_tokens[row])))
    return StepTrees(tuple(rows))


def depth_positions(positions: torch.Tensor, query_start: Sequence[int], step: StepTrees):
    """``positions`` with each tree node at ``root position + depth`` (siblings share one);
    a copy, or ``positions`` itself when the step has no trees."""
    if not step.rows:
        return positions
    out = positions.clone()
    for t in step.rows:
        start = query_start[t.row]
        n = len(t.parents)
        out[start + 1 : start + 1 + n] = t.root_position + tree_depths(t.parents).to(out.dtype)
    return out


@dataclass(frozen=True)
class AcceptedPath:
    """Greedy verification of one row's tree."""

    nodes: tuple[int, ...]
    """Accepted node indices, depth 1 first."""
    bonus: int
    """The target's token after the last accepted node."""

    def kv_moves(self, root_position: int) -> list[tuple[int, int]]:
        """``(src, dst)`` positions that put the accepted nodes' keys/values right after
        the root (node ``i`` was written at ``root + 1 + i``; depth ``d`` belongs at
        ``root + d``); copying in list order never overwrites a source still to be read."""
        if not self.nodes:
            return []
        path = torch.tensor(self.nodes, dtype=torch.long)
        moves = accepted_path_compaction(path, root_position, offset=1)
        return [tuple(m) for m in moves.tolist()]


def accept_row(parents: Sequence[int], tokens: torch.Tensor, target_argmax: torch.Tensor):
    """Greedy acceptance of one row (``tokens`` ``[n]``, ``target_argmax`` ``[n + 1]`` for
    ``[root, node 0, ...]``): :func:`~vllm_specstream.streams.draft_trees.tree_accept_greedy`, the
    reference decoder's rule."""
    got = tree_accept_greedy(tuple(parents), tokens, target_argmax, max_depth=len(parents))
    m = int(got.num_accepted)
    return AcceptedPath(tuple(int(x) for x in got.path[:m]), int(got.bonus_token))


class WorkerTrees:
    """The tree state of this worker process (one model runner per worker)."""

    def __init__(self) -> None:
        self.book = TreeBook()
        #: The prepared step (None: no step with trees since the last proposal).
        self.step: StepTrees | None = None
        self._runner = None
        self._model = None
        #: Rows verified as trees, and those whose accepted path left the top-1 chain.
        self.tree_rows = 0
        self.off_chain_rows = 0
        #: Rows verified as trees by their node count (the policy's widths).
        self.tree_rows_by_nodes: dict[int, int] = {}
        #: Tree nodes that reached the pruning layer, and those pruned there.
        self.nodes_at_pruning = 0
        self.nodes_pruned = 0

    def count_rows(self, node_counts: Sequence[int]) -> None:
        """A verified step: the node count of each of its tree rows."""
        self.tree_rows += len(node_counts)
        for n in node_counts:
            self.tree_rows_by_nodes[n] = self.tree_rows_by_nodes.get(n, 0) + 1

    def count_pruned(self, nodes: int, pruned: int) -> None:
        self.nodes_at_pruning += nodes
        self.nodes_pruned += pruned

    def prepare(self, runner, req_ids, scheduled_drafts, num_computed_tokens) -> None:
        """After the runner prepared a step: which rows are trees (the attention backend
        reads them until :meth:`end_forward`)."""
        from vllm_specstream.model_executor.trees.attention import (
            TreeRequest,
            TreeStep,
            set_tree_step,
        )

        self._runner = weakref.ref(runner)
        filed = self.book.take()
        self.step = build_step(req_ids, scheduled_drafts, num_computed_tokens, filed)
        set_tree_step(
            TreeStep(tuple(TreeRequest(t.row, t.parents) for t in self.step.rows))
            if self.step.rows
            else None
        )

    def end_forward(self) -> None:
        from vllm_specstream.model_executor.trees.attention import set_tree_step

        set_tree_step(None)

    def bind_model(self, model) -> None:
        """The model whose caches :meth:`compact_kv` moves (set by the model at load)."""
        self._model = weakref.ref(model)

    def runner(self):
        return self._runner() if self._runner is not None else None

    def compact_kv(self, moves: dict[int, list[tuple[int, int]]]) -> None:
        model = self._model() if self._model is not None else None
        if model is None:
            raise RuntimeError("specstream tree verification: no model bound to move the KV")
        model.move_kv(moves)


#: This worker's tree state.
WORKER_TREES = WorkerTrees()


def tree_problem(params) -> str | None:
    """Why a request with sampling parameters ``params`` drafts chains, not trees (None:
    it can take a tree). Each of these reads a request's drafts as a chain in vLLM."""
    if params is None:
        return "no sampling parameters"
    checks = (
        (params.presence_penalty or params.frequency_penalty, "penalties"),
        (params.repetition_penalty not in (None, 1.0), "penalties"),
        (params.bad_words, "bad words"),
        (params.logprobs is not None, "logprobs"),
        (params.min_tokens, "min_tokens"),
        (params.temperature >= 1e-5 and params.min_p, "min_p"),
        (params.logit_bias, "logit bias"),
        (params.allowed_token_ids, "allowed token ids"),
        (params.structured_outputs is not None, "structured output"),
    )
    return next((why for bad, why in checks if bad), None)


def tree_stats(model=None) -> dict:
    """This worker's tree counters (``LLM.apply_model(tree_stats)`` for inspection)."""
    w = WORKER_TREES
    return {
        "tree_rows": w.tree_rows,
        "off_chain_rows": w.off_chain_rows,
        "tree_rows_by_nodes": dict(w.tree_rows_by_nodes),
        "nodes_at_pruning": w.nodes_at_pruning,
        "nodes_pruned": w.nodes_pruned,
    }
