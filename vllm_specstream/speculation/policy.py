"""Adaptive speculation: what each request drafts this step (``docs/policy.md``).

Each step the policy weighs every choice (a chain of ``1..k_max`` drafts; in a window engine
also each chain with its streams at the anchors; in a tree engine also each draft tree) by its expected speedup, the tokens a step of it yields per request
(:mod:`vllm_specstream.speculation.acceptance`, from what vLLM verified) over what such a
step costs against a plain one at this batch size (:mod:`vllm_specstream.speculation.step_cost`,
as this engine timed it). It drafts the best choice where that beats a plain step by
``margin``, else nothing. Two small explorations keep the estimates honest:

* while drafting, one step in ``explore_every`` times a choice not timed yet at this batch
  size whose estimate comes near the best (``reach``);
* while not drafting, a step now and then drafts what would pay under the prior acceptance
  (after halving the old evidence), spaced so that these probes cost at most
  ``explore_budget`` of the idle steps' time: traffic that became easier is noticed.

A user's fixed schedule (``num_speculative_tokens_per_batch_size``) replaces the policy
(:func:`lookup_length`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_specstream.speculation.acceptance import (
    AcceptanceStats,
    TreeStats,
    template_tokens,
    tokens_per_step,
)
from vllm_specstream.speculation.choices import (
    AnchoredChain,
    Choice,
    TreeChoice,
    choice_label,
    rows_of,
)
from vllm_specstream.speculation.step_cost import StepCosts, batch_bucket
from vllm_specstream.streams.draft_trees import TreeTemplate


@dataclass
class DraftPolicy:
    """Drafts per request for a step: the choice of highest expected speedup."""

    k_max: int
    """The longest chain (``num_speculative_tokens``; in a tree engine at most its streams)."""
    costs: StepCosts = field(default_factory=StepCosts)
    template: TreeTemplate | None = None
    """The engine's draft tree (None: chains only); each of ``trees`` is a prefix of it."""
    trees: tuple[TreeChoice, ...] = ()
    anchored: bool = False
    """Whether chains are also weighed with their streams at the anchors (a window engine)."""
    margin: float = 0.15
    """A step with drafts must beat a plain one by this much: step costs and acceptance are
    each off by several percent on a small machine (engines differ by +-7% between starts),
    and a request's prefill also runs the streams."""
    explore_every: int = 16
    """One drafting step in this many times an untimed choice within ``reach``."""
    probe_steps: int = 3
    """Steps such a timing lasts (a window engine's first one drafts from the anchors)."""
    reach: float = 0.7
    """An untimed choice is timed only if its estimated speedup is this share of the best's."""
    probe_every: int = 64
    """Idle steps between acceptance probes at the least."""
    explore_budget: float = 0.01
    """Share of the idle steps' time that acceptance probes may cost."""
    calibrate_every: int = 4
    """While this bucket has drafting steps timed but too few plain ones to compare, one
    drafting step in this many drafts nothing (a plain step to time)."""
    stats: AcceptanceStats = field(init=False)
    tree_stats: dict[TreeChoice, TreeStats] = field(default_factory=dict, init=False)
    idle_steps: int = field(default=0, init=False)
    drafting_steps: int = field(default=0, init=False)
    probing: tuple[Choice, int] | None = field(default=None, init=False)
    """A timing under way: its choice and how many more steps it lasts."""
    decisions: dict[Choice, int] = field(default_factory=dict, init=False)
    """Steps per choice (for :meth:`summary`)."""

    def __post_init__(self) -> None:
        self.stats = AcceptanceStats(self.k_max)
        if self.trees and self.template is None:
            raise ValueError("a policy with trees needs their template")
        self.tree_stats = {t: TreeStats() for t in self.trees}

    def choices(self) -> list[Choice]:
        chains = range(1, self.k_max + 1)
        return [*chains, *(AnchoredChain(k) for k in chains if self.anchored), *self.trees]

    def speedup(self, batch_size: int, choice: Choice) -> float:
        """Expected tokens per plain step's time of a step of ``choice``."""
        if choice == 0:
            return 1.0
        return self._speedups(batch_size, self.stats.accept_rates())[choice]

    def _speedups(self, batch_size: int, rates: np.ndarray) -> dict[Choice, float]:
        """Each choice's expected tokens per request over its cost (a tree's tokens: its own
        steps' paths, before them its template under the chains' acceptance)."""
        speedups = {
            c: tokens_per_step(rates, rows_of(c)) / self.costs.ratio(batch_size, c)
            for c in self.choices()
            if not isinstance(c, TreeChoice)
        }
        if self.trees:
            priors = template_tokens(self.template, rates)
            for tree in self.trees:
                tokens = self.tree_stats[tree].expected_tokens(priors[tree.nodes - 1])
                speedups[tree] = tokens / self.costs.ratio(batch_size, tree)
        return speedups

    def best(self, batch_size: int, rates: np.ndarray | None = None) -> Choice:
        """The choice of highest expected speedup under ``rates`` (default: the estimate),
        0 unless it beats a plain step by ``margin``."""
        rates = self.stats.accept_rates() if rates is None else rates
        return self._best_of(self._speedups(batch_size, rates))

    def _best_of(self, speedups: dict[Choice, float]) -> Choice:
        choice = max(speedups, key=speedups.__getitem__)
        return choice if speedups[choice] > 1.0 + self.margin else 0

    def draft_length(self, batch_size: int) -> Choice:
        """This step's choice at ``batch_size`` (what the proposer asks each step)."""
        speedups = self._speedups(batch_size, self.stats.accept_rates())
        best = self._best_of(speedups)
        drafting = best != 0
        choice = self._drafting(batch_size, best, speedups) if drafting else self._idle(batch_size)
        self.decisions[choice] = self.decisions.get(choice, 0) + 1
        return choice

    def _drafting(self, batch_size: int, best: Choice, speedups: dict[Choice, float]) -> Choice:
        self.idle_steps = 0
        self.drafting_steps += 1
        if self.probing is not None:
            choice, left = self.probing
            self.probing = (choice, left - 1) if left > 1 else None
            return choice
        if (
            self.costs.needs_plain_steps(batch_size)
            and self.drafting_steps % self.calibrate_every == 0
        ):
            return 0
        if self.drafting_steps % self.explore_every == 0:
            untimed = self._untimed(batch_size, best, speedups)
            if untimed is not None:
                self.probing = (untimed, self.probe_steps - 1) if self.probe_steps > 1 else None
                return untimed
        return best

    def _untimed(
        self, batch_size: int, best: Choice, speedups: dict[Choice, float]
    ) -> Choice | None:
        """The untimed choice of highest estimated speedup within ``reach`` of the best."""
        if not self.costs.measure:
            return None
        floor = self.reach * speedups[best]
        candidates = [
            c for c, s in speedups.items()
            if c != best and s >= floor and not self.costs.timed(batch_size, c)
        ]  # fmt: skip
        return max(candidates, key=speedups.__getitem__, default=None)

    def _idle(self, batch_size: int) -> Choice:
        self.probing = None
        self.idle_steps += 1
        if self.idle_steps < self.probe_every:
            return 0
        probe = self.best(batch_size, self.stats.prior_rates())
        if probe == 0:  # not even the prior's acceptance would pay here: nothing to learn
            self.idle_steps = 0
            return 0
        extra = self.costs.ratio(batch_size, probe) - 1.0
        if self.idle_steps < max(self.probe_every, math.ceil(extra / self.explore_budget)):
            return 0
        self.idle_steps = 0
        self.stats.forget(0.5)
        return probe

    def summary(self, batch_size: int) -> str:
        """One line for debug logs: the choices made, the acceptance and the costs now."""
        rates = " ".join(f"{r:.2f}" for r in self.stats.accept_rates())
        costs = " ".join(
            f"{choice_label(c)}:{self.costs.ratio(batch_size, c):.2f}" for c in self.choices()
        )
        chosen = " ".join(f"{choice_label(c)}:{n}" for c, n in self.decisions.items())
        return (
            f"steps by choice {chosen}; P(accept) {rates}; cost at batch {batch_size} "
            f"(bucket {batch_bucket(batch_size)}) {costs}; row model {self.costs.summary()}"
        )


def lookup_length(lookup: Sequence[int], batch_size: int) -> int:
    """Drafts at ``batch_size`` from a dense schedule (index = batch size; the last entry
    holds beyond it)."""
    return lookup[min(batch_size, len(lookup) - 1)]
