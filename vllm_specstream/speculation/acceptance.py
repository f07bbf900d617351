"""How many drafts the target keeps: running estimates the policy prices steps with.

:class:`AcceptanceStats` follows a chain's acceptance per draft position, :class:`TreeStats`
a draft tree's accepted path length; before evidence a tree is priced by its template
(:func:`template_tokens`) under the chains' acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def tokens_per_step(rates: np.ndarray, k: int) -> float:
    """Tokens a step with ``k`` drafts yields per request, the bonus token included, when
    draft ``j`` is accepted with probability ``rates[j - 1]``."""
    return 1.0 + float(rates[:k].sum())


@dataclass
class AcceptanceStats:
    """Running estimate of ``P(draft j accepted)`` for ``j = 1..num_positions``.

    vLLM keeps a prefix of each request's drafts, so the estimate is a product of
    conditional acceptances ``c_j`` (draft ``j`` kept when draft ``j - 1`` was).
    :meth:`record_proposed` notes the drafts handed out, the next step's
    :meth:`record_verified` how many each request kept (its sampled tokens less the bonus
    token). Only totals per position are kept, so rows moving between steps do not matter.
    Counts decay at every step that drafted: old traffic fades.
    """

    num_positions: int
    decay: float = 0.98
    """Per step that drafted (a window of ~50 such steps)."""
    prior_rate: float = 0.7
    """Prior of the first two conditional acceptances (``prior_rate ** j`` with no evidence)."""
    prior_weight: float = 4.0
    """The prior counts as this many trials at each position."""
    tried: np.ndarray = field(init=False)
    """Drafts at each position whose draft before was kept (the first: all of them)."""
    accepted: np.ndarray = field(init=False)
    pending: np.ndarray = field(init=False)
    """Drafts at each position handed out last step, awaiting verification."""

    def __post_init__(self) -> None:
        self.tried = np.zeros(self.num_positions)
        self.accepted = np.zeros(self.num_positions)
        self.pending = np.zeros(self.num_positions)

    def _at_least(self, lengths: Sequence[int]) -> np.ndarray:
        """How many of ``lengths`` are ``>= j``, for ``j = 1..num_positions``."""
        capped = np.minimum(np.asarray(lengths, dtype=np.int64), self.num_positions)
        hist = np.bincount(capped, minlength=self.num_positions + 1)
        return hist[::-1].cumsum()[::-1][1:].astype(float)

    def record_proposed(self, drafts: Sequence[Sequence[int]]) -> None:
        if not any(len(d) for d in drafts):  # most steps of an idle engine: no numpy
            if self.pending[0]:
                self.pending = np.zeros(self.num_positions)
            return
        self.pending = self._at_least([len(d) for d in drafts])

    def record_verified(self, sampled_token_ids: Sequence[Sequence[int]]) -> None:
        if not self.pending[0]:  # counts never increase with the position: none pending
            return
        self.forget(self.decay)
        kept = np.minimum(
            self._at_least([max(len(s) - 1, 0) for s in sampled_token_ids]), self.pending
        )
        # Draft j was tried where draft j - 1 was kept.
        self.tried += np.minimum(self.pending, np.concatenate([[np.inf], kept[:-1]]))
        self.accepted += kept
        self.pending = np.zeros(self.num_positions)

    def forget(self, factor: float) -> None:
        """Scale the evidence by ``factor`` (the prior keeps its weight)."""
        self.tried *= factor
        self.accepted *= factor

    def prior_rates(self) -> np.ndarray:
        return self.prior_rate ** np.arange(1, self.num_positions + 1)

    def conditional_rates(self) -> np.ndarray:
        """``c_j``, each weighed with ``prior_weight`` trials at a prior: ``prior_rate`` for
        the first two, for a deeper one the estimate of the one before it, so that positions
        not drafted yet are priced like the ones that were (under ``prior_rate ** j`` an
        engine drafting two never learns that its third and fourth drafts would be kept).
        The first draft also counts steps whose streams start off the target's path, so it
        sets no prior."""
        rates = np.empty(self.num_positions)
        prior = self.prior_rate
        for j in range(self.num_positions):
            rates[j] = (self.accepted[j] + self.prior_weight * prior) / (
                self.tried[j] + self.prior_weight
            )
            if j >= 1:
                prior = rates[j]
        return np.clip(rates, 0.0, 1.0)

    def accept_rates(self) -> np.ndarray:
        """``P(draft j accepted)``: the product of the conditional acceptances up to ``j``."""
        return np.cumprod(self.conditional_rates())


#: Of the target's tokens the rank-``r`` stream candidate misses, the rank-``r + 1`` one is
#: taken to catch this share: with it the top-2, 8-node tree accepts 1.36-1.49x the drafts
#: of the full chain at the real-task adapters' chain acceptance, as the reference decoder
#: measured them (1.46-1.50).
RANK_CATCH = 0.5


def on_path_probs(depths, ranks, parents, rates: np.ndarray) -> list[float]:
    """Chance that each tree node is on the accepted path: the product, over its path, of
    the top-1's conditional acceptance at that depth, or for a rank-``r`` candidate ``(1 -
    that) * RANK_CATCH ** r``. A prefix of the nodes gets the prefix of these values."""
    rates = np.asarray(rates, dtype=float)
    prev = np.concatenate([[1.0], rates[:-1]])
    cond = np.divide(rates, prev, out=np.zeros_like(rates), where=prev > 0)
    on_path: list[float] = []
    for depth, rank, parent in zip(depths, ranks, parents):
        q = cond[depth - 1] if depth <= len(cond) else 0.0
        p = q if rank == 0 else (1.0 - q) * RANK_CATCH**rank
        on_path.append(p * (on_path[parent] if parent >= 0 else 1.0))
    return on_path


def template_tokens(template, rates: np.ndarray) -> np.ndarray:
    """Tokens a step yields per request with the first ``n`` nodes of ``template``, at
    index ``n - 1`` (bonus token included): greedy acceptance takes one child per node, so
    the expected path length is the sum of the nodes' :func:`on_path_probs`."""
    t = template
    return 1.0 + np.cumsum(on_path_probs(t.depths, t.ranks, t.parents, rates))


@dataclass
class TreeStats:
    """Running estimate of the drafts one tree's steps accept per tree row: its prior
    (:func:`template_tokens`) until its rows' accepted path lengths take over."""

    decay: float = 0.98
    prior_weight: float = 4.0
    """The prior counts as this many tree rows."""
    rows: float = field(default=0.0, init=False)
    accepted: float = field(default=0.0, init=False)

    def record(self, accepted_drafts: Sequence[int]) -> None:
        """One tree step: the drafts each tree row kept (its path length)."""
        if len(accepted_drafts) == 0:
            return
        self.rows = self.rows * self.decay + len(accepted_drafts)
        self.accepted = self.accepted * self.decay + float(sum(accepted_drafts))

    def expected_tokens(self, prior_tokens: float) -> float:
        """Tokens per request of a step of this tree when its prior says ``prior_tokens``."""
        prior = max(prior_tokens - 1.0, 0.0)
        return 1.0 + (self.accepted + self.prior_weight * prior) / (self.rows + self.prior_weight)
