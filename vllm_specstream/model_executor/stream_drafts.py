"""The streams' drafts of a step: read from the model's stash at each request's anchor.

The drafts were computed inside the target's own forward (:mod:`.stream_pass`); here each
request's row is the one of its last accepted token (the deepest accepted node of its tree
in a tree engine) and its stream tokens are clipped to the step's draft length. A stash
from another step is refused (:mod:`.stash`): no row may draft another step's tokens.
"""

from __future__ import annotations

import numpy as np

from vllm_specstream.logger import init_logger
from vllm_specstream.model_executor.stash import anchor_token_problem, stash_problem
from vllm_specstream.model_executor.trees.step import WORKER_TREES, tree_problem
from vllm_specstream.speculation.choices import TreeChoice, rows_of
from vllm_specstream.streams.draft_trees import fill_tree

logger = init_logger(__name__)


def last_accepted_index(query_start: int, first_position: int, num_tokens_no_spec: int) -> int:
    """Flat index, in the last forward, of a request's last accepted token.

    After rejection sampling and bookkeeping, the request holds ``num_tokens_no_spec``
    tokens and the newest one (just sampled) is not in the cache yet; so the last accepted
    token sits at position ``num_tokens_no_spec - 2``, i.e. ``that - first_position`` tokens
    after the first scheduled token of the request.
    """
    return query_start + (num_tokens_no_spec - 2 - first_position)


def anchor_rows(
    sampled_token_ids: list[list[int]],
    num_tokens_no_spec: np.ndarray,
    query_start_loc: list[int],
    first_positions: list[int],
) -> tuple[list[int], list[int]]:
    """Rows that sampled something and the flat index, in the last forward, of each one's
    last accepted token (rows that sampled nothing, e.g. a partial prefill chunk, and
    indices outside the row's scheduled tokens are left out)."""
    rows: list[int] = []
    indices: list[int] = []
    for i, sampled in enumerate(sampled_token_ids):
        if not sampled or i + 1 >= len(query_start_loc):
            continue
        idx = last_accepted_index(
            query_start_loc[i], first_positions[i], int(num_tokens_no_spec[i])
        )
        if query_start_loc[i] <= idx < query_start_loc[i + 1]:
            rows.append(i)
            indices.append(idx)
    return rows, indices


def select_drafts(
    sampled_token_ids: list[list[int]],
    num_tokens_no_spec: np.ndarray,
    query_start_loc: list[int],
    first_positions: list[int],
    draft_table,
    k: int,
) -> list[list[int]]:
    """Per request row: the stream drafts at its last accepted token (``[]`` for rows that
    sampled nothing, e.g. a partial prefill chunk, or whose anchor has no drafts)."""
    rows, indices = anchor_rows(
        sampled_token_ids, num_tokens_no_spec, query_start_loc, first_positions
    )
    return drafts_at(len(sampled_token_ids), rows, indices, draft_table, k)


def drafts_at(
    num_rows: int, rows: list[int], indices: list[int], draft_table, k: int
) -> list[list[int]]:
    """``draft_table[indices[i]][:k]`` up to its first -1 (no draft from that stream on) for
    row ``rows[i]``, ``[]`` for the other rows."""
    drafts: list[list[int]] = [[] for _ in range(num_rows)]
    for i, idx in zip(rows, indices):
        row = [int(t) for t in draft_table[idx][:k]]
        drafts[i] = row[: next((j for j, t in enumerate(row) if t < 0), len(row))]
    return drafts


def tree_anchor_indices(rows: list[int], indices: list[int], query_start_loc: list[int], step):
    """``indices`` with each tree row's anchor at its deepest accepted node (the sampler's
    ``anchor_offsets``: off the chain layout :func:`anchor_rows` assumes)."""
    if step is None or not step.anchor_offsets:
        return indices
    offsets = step.anchor_offsets
    return [query_start_loc[r] + offsets[r] if r in offsets else i for r, i in zip(rows, indices)]


class StashDrafts:
    """Each step's stream drafts from the model's stash (``target``: its
    :class:`~vllm_specstream.model_executor.stream_pass.StreamPass`; ``tree``: the engine's
    draft-tree template, None: chains; ``adaptive``: the policy chooses trees, else the
    user's schedule)."""

    def __init__(self, target, tree, adaptive: bool):
        self.target = target
        self.tree = tree
        self.adaptive = adaptive
        #: Stashes refused as not this step's (each one: a step without drafts).
        self.refused_stashes = 0
        #: Why requests drafted chains in a tree engine, each said once.
        self.chain_reasons: set[str] = set()
        #: Batch rows that got a tree in this call (the chain estimate leaves them out).
        self.tree_rows: set[int] = set()
        #: The tree those rows got (its estimate takes their accepted paths next call).
        self.filed_tree: TreeChoice | None = None

    def drafts(self, stash, k, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, skip=()):
        """This step's drafts from ``stash`` (none for the rows in ``skip``: they draft a
        copy), and why there are none when there are none."""
        no_drafts = [[] for _ in sampled_token_ids]
        if stash is None:
            return no_drafts, self.target.no_stash_reason
        problem = stash_problem(stash, self.target.forward_step, len(sampled_token_ids))
        rows: list[int] = []
        indices: list[int] = []
        if problem is None:
            batch = stash.batch
            qsl = batch.query_start_loc.tolist()
            first_positions = batch.positions[batch.query_start_loc[:-1]].tolist()
            rows, indices = anchor_rows(sampled_token_ids, num_tokens_no_spec, qsl, first_positions)
            if self.tree is not None:
                indices = tree_anchor_indices(rows, indices, qsl, WORKER_TREES.step)
            problem = anchor_token_problem(
                stash.input_ids, token_ids_cpu, num_tokens_no_spec, rows, indices
            )
        if problem is not None:
            self.refused_stashes += 1
            if self.refused_stashes == 1:
                logger.warning(
                    "specstream refused the model's stream stash: not this step's (%s); "
                    "this step drafts nothing (further refusals are counted, not logged)",
                    problem,
                )
            return no_drafts, (
                f"the model's stream stash was not this step's ({problem}; "
                f"{self.refused_stashes} refused)"
            )
        if not rows:
            return no_drafts, "no request's last accepted token was in the last forward"
        if skip:
            kept = [(r, i) for r, i in zip(rows, indices) if r not in skip]
            if not kept:
                return no_drafts, "every request drafted a copy"
            rows, indices = [r for r, _ in kept], [i for _, i in kept]
        if self.tree is not None:
            return self._tree_drafts(stash, k, rows, indices, len(sampled_token_ids))
        k = rows_of(k)
        # Placement "accepted", or a window forward that ran no streams (the step before
        # drafted nothing or anchored drafts): the streams run now, at the anchors; window
        # streams still waiting for the LM head go through it at the anchors only.
        table = self.target.draft_at(stash, rows, indices, k)
        drafts = drafts_at(len(sampled_token_ids), rows, indices, table, k)
        why_none = "the streams left no draft at any request's anchor"
        min_prob = getattr(self.target, "draft_min_prob", 0.0)
        if min_prob > 0:
            why_none += f" (the confidence rule cut them all: draft_min_prob={min_prob:g})"
        return drafts, why_none

    def _tree_drafts(self, stash, k, rows, indices, num_rows):
        """Drafts of a tree engine: a request's last accepted token is the deepest accepted
        node of its tree, wherever the tree put it; eligible requests get a tree when the
        policy chose one (``k``, a :class:`TreeChoice`; with a fixed schedule, ``k`` beyond
        ``num_streams``: the first ``k`` nodes of the tree, pruned where the model prunes),
        the others a chain.
        The trees are filed for the next step's verification, and the model told whether to
        prune them."""
        self.target.draft_at(stash, rows, indices, 0)
        chains = drafts_at(
            num_rows, rows, indices, stash.draft_table, min(rows_of(k), self.tree.num_streams)
        )
        runner = WORKER_TREES.runner()
        req_ids = list(runner.input_batch.req_ids[:num_rows]) if runner is not None else []
        parents: list[tuple[int, ...] | None] = [None] * num_rows
        if self.adaptive:
            choice = k if isinstance(k, TreeChoice) else None
        else:
            nodes = min(k, self.tree.num_nodes)
            choice = TreeChoice(nodes, prune=True) if k > self.tree.num_streams else None
        eligible = choice is not None and len(req_ids) == num_rows
        for r, idx in zip(rows, indices) if eligible else ():
            why = tree_problem(runner.requests[req_ids[r]].sampling_params)
            if why is not None:
                if why not in self.chain_reasons:
                    self.chain_reasons.add(why)
                    logger.info("specstream drafts chains for requests with %s", why)
                continue
            chains[r] = fill_tree(self.tree, stash.draft_topk[idx])[: choice.nodes].tolist()
            parents[r] = self.tree.parents[: choice.nodes]
            self.tree_rows.add(r)
        WORKER_TREES.book.file(req_ids, chains, parents)
        self.filed_tree = choice if self.tree_rows else None
        self.target.prune_trees = choice is not None and choice.prune
        return chains, "the streams left no draft at any request's anchor"

    def record_tree_paths(self, sampled_token_ids, tree_stats) -> list[list[int]]:
        """Files the path lengths of the last step's tree rows with the policy's estimate of
        the tree they got (``tree_stats``); returns ``sampled_token_ids`` with those rows
        empty (for the chain estimate)."""
        step = WORKER_TREES.step if self.tree is not None else None
        rows = {t.row for t in step.rows if t.row < len(sampled_token_ids)} if step else set()
        if not rows:
            return sampled_token_ids
        stats = tree_stats.get(self.filed_tree)
        if stats is not None:
            stats.record([max(len(sampled_token_ids[r]) - 1, 0) for r in rows])
        return [[] if r in rows else s for r, s in enumerate(sampled_token_ids)]
