"""Adaptive speculation: how many drafts each request gets this step.

Verifying ``k`` drafts makes every request's forward ``k + 1`` rows long and adds the stream
pass. Whether that pays depends on the CPU (extra rows cost more on AVX2 than with
AVX-512), on the batch size (at batch 1 a step is bound by reading the weights, with many
requests by arithmetic) and on how many drafts the target accepts (the checkpoint, the
task, the prompts). The default policy weighs all three every step:

* **cost**: the cost of a step with ``k`` drafts over a plain step at this batch size, as
  the engine itself times it once it has drafted ``k`` often enough, before that the table
  measured on this CPU class (:mod:`vllm_specstream.speculation.step_cost`) corrected by the steps timed
  so far (:class:`MeasuredCost`) and bounded by what the same choice was timed at with
  fewer and with more requests; while a draft length that might pay is untimed, a few
  steps now and then draft it to time it;
* **acceptance**: :class:`AcceptanceStats`, a running estimate from what vLLM verified of
  the chance that draft position ``j`` is accepted (decayed counts, so it follows the
  traffic, and a prior so that a fresh engine drafts);
* it drafts the ``k`` of highest expected speedup ``E[tokens | k] / cost(batch, k)``, or
  nothing where no ``k`` beats a plain step by ``margin``.

In a tree engine each draft tree is one more choice (:class:`TreeChoice`): a prefix of the
engine's template (:func:`tree_choices`: a few widths up to its node count), pruned by the
early-exit head inside the verification forward or not where the checkpoint has one. Each
tree's tokens come from its own :class:`TreeStats` (what its steps accepted; before that, a
model of the template over the chains' acceptance: :func:`template_tokens`), its cost from
the steps this engine timed with it; an untimed tree costs the table's chain of as many rows
times the overhead the timed trees showed. While some tree is untimed at a batch size, one
drafting step in ``timing_probe_every`` drafts the likeliest of them to time it (skipping
those that would not come near the best choice once a tree's overhead is known), so trees,
their width and pruning run only where they beat the best chain on this CPU.

In a window engine each chain length is also weighed with its streams run at the requests'
anchors after the step instead of in the window (:class:`AnchoredChain`: the ``accepted``
placement's cost, from its own table until timed), so the engine drafts from the window at
batch 1 and from the anchors where the window's ``k + 1`` times more stream rows cost more.
A window chain chosen right after a forward that ran no window streams costs what that step
does, an anchored pass and a window step (:class:`WindowEntry`, timed on its own), with the
entry's extra over a window step spread over the steps the run is expected to last (the
mean of the drafting runs seen, or the run under way): a short burst of window drafts
starts only where its first step pays, a long run of anchored drafts moves to the window
where window steps pay more.

A user's batch-size schedule in vLLM's own format (``num_speculative_tokens_per_batch_size``,
read with vLLM's validator in :mod:`vllm_specstream.patches.vllm_schedule`) replaces the cost model.
The confidence rule (field ``draft_min_prob``, off by default) then cuts each
request's draft before the first stream whose cumulative top-1 probability falls below it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch

from vllm_specstream.speculation.step_cost import StepCostTable
from vllm_specstream.streams.draft_trees import TreeTemplate


@dataclass
class AcceptanceStats:
    """Running estimate of ``P(draft j accepted | j drafted)`` for ``j = 1..num_positions``.

    vLLM keeps a prefix of each request's drafts, so the estimate is a product of
    conditional acceptances: ``c_j``, the chance that draft ``j`` is kept when draft
    ``j - 1`` was (:meth:`conditional_rates`). ``record_proposed`` notes the drafts handed
    to vLLM; the next step's ``record_verified`` reads how many each request kept (its
    sampled tokens minus the bonus token). Only totals per position are kept, so rows
    moving between steps do not matter: draft ``j``'s trials are the drafts at ``j`` up to
    the number of requests that kept ``j - 1`` (exact when a step's requests draft alike,
    as the policy has them). Counts decay by ``decay`` at every step that drafted: old
    traffic fades.
    """

    num_positions: int
    decay: float = 0.98
    """Per step that drafted (a window of ~50 such steps)."""
    prior_rate: float = 0.7
    """Prior of the first two conditional acceptances; a deeper one's prior is the estimate
    of the one before it (:meth:`conditional_rates`): ``prior_rate ** j`` with no evidence."""
    prior_weight: float = 4.0
    """The prior counts as this many trials at each position."""
    proposed: np.ndarray = field(init=False)
    """Drafts at each position."""
    tried: np.ndarray = field(init=False)
    """Drafts at each position whose draft before was kept (the first: all of them)."""
    accepted: np.ndarray = field(init=False)
    """Drafts kept at each position."""
    pending: np.ndarray = field(init=False)
    """Drafts at each position handed out last step, awaiting verification."""
    version: int = field(default=0, init=False)
    """Bumped whenever the evidence changes (a pricing made under it is stale)."""
    kept_per_row: float = field(default=0.0, init=False)
    """Drafts kept per drafting request at the last verification (0 after a step that
    handed out no drafts)."""

    def __post_init__(self) -> None:
        self.proposed = np.zeros(self.num_positions)
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
        if not self.pending[0]:  # counts are non-increasing in the position: none pending
            self.kept_per_row = 0.0
            return
        self.forget(self.decay)
        kept = np.minimum(
            self._at_least([max(len(s) - 1, 0) for s in sampled_token_ids]), self.pending
        )
        self.kept_per_row = float(kept.sum() / self.pending[0])
        self.proposed += self.pending
        self.tried += np.minimum(self.pending, np.concatenate([[np.inf], kept[:-1]]))
        self.accepted += kept
        self.pending = np.zeros(self.num_positions)

    def forget(self, factor: float) -> None:
        """Scale the evidence by ``factor`` (the prior keeps its weight)."""
        self.proposed *= factor
        self.tried *= factor
        self.accepted *= factor
        self.version += 1

    def prior_rates(self) -> np.ndarray:
        return self.prior_rate ** np.arange(1, self.num_positions + 1)

    def conditional_rates(self) -> np.ndarray:
        """``c_j``: the chance draft ``j`` is kept when draft ``j - 1`` was.

        Each position's trials are weighed with ``prior_weight`` trials at a prior:
        ``prior_rate`` for the first two, for a deeper one the estimate of the one before
        it, so that drafts a policy has not made yet are priced like the ones it has (under
        a fixed ``prior_rate ** j`` an engine that began with two drafts a step never
        learnt that its third and fourth were kept: E2E at batch 1, estimates of 0.23 for
        positions 3 and 4 kept it at two drafts a step where four drafts at every step
        keep 55% of third and 44% of fourth drafts). The first draft's acceptance is not
        a conditional one (it also counts the steps whose streams start off the target's
        path), so it sets no prior: one rejected first draft does not price every deeper
        position low."""
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
        """``P(draft j accepted)`` for ``j = 1..num_positions``: the product of the
        conditional acceptances up to ``j`` (non-increasing)."""
        return np.cumprod(self.conditional_rates())

    def expected_tokens(self, k: int) -> float:
        """Tokens a step with ``k`` drafts yields per request (:func:`tokens_per_step`)."""
        return tokens_per_step(self.accept_rates(), k)


@dataclass(frozen=True)
class TreeChoice:
    """A draft tree for one step: the first ``nodes`` nodes of the engine's template (a
    prefix of it is a tree), pruned by the early-exit head in the verification forward or not."""

    nodes: int
    prune: bool = False

    def __str__(self) -> str:
        return f"tree{self.nodes}" + ("-pruned" if self.prune else "")


@dataclass(frozen=True)
class AnchoredChain:
    """In a window engine, a chain of ``k`` drafts whose streams run at each request's last
    accepted token after the step (the ``accepted`` placement's way) instead of at every
    position of the next forward's window: ``k + 1`` times fewer stream rows for one more
    pass over the top layers, cheaper where a step is bound by arithmetic (from batch 4 on
    AVX2 CPUs), dearer where it is bound by reading the weights (batch 1)."""

    k: int

    def __str__(self) -> str:
        return f"k{self.k}-anchored"


@dataclass(frozen=True)
class WindowEntry:
    """In a window engine, a chain of ``k`` window drafts chosen right after a forward that
    ran no window streams (a step that drafted nothing, or anchored drafts): its drafts
    come from streams run now at the anchors and the next forward runs ``k`` window
    streams, so that one step pays an anchored pass and a window step. A cost key, not a
    choice: such steps are priced and timed on their own, since a policy that priced them as
    window steps entered bursts of drafting that did not pay (DialogSum at batch 1, AVX2:
    2.55 plain steps for 1.75 tokens, where a window step of the burst cost 1.6)."""

    k: int

    def __str__(self) -> str:
        return f"k{self.k}-entry"


@dataclass(frozen=True)
class SuffixStep:
    """A step whose requests all verify suffix-tree drafts of up to ``k`` tokens and whose
    forward runs no streams (:mod:`vllm_specstream.speculation.suffix_drafts`). A cost key, not a choice:
    such steps are timed on their own so that a suffix draft is priced at what its step
    costs (the verify rows, the trees' bookkeeping): until timed, a plain step's cost beside
    a stream step's, and a score of 1 where it would replace a plain step
    (:meth:`~vllm_specstream.model_executor.proposer.SpecStreamProposer._suffix_choice`)."""

    k: int

    def __str__(self) -> str:
        return f"suffix{self.k}"


#: A step's drafts per request: 0 (none), a chain of that many (its streams in the window
#: or at the anchors), or a tree.
Choice = int | AnchoredChain | TreeChoice


def rows_of(choice: Choice) -> int:
    """Draft rows per request a step of ``choice`` verifies."""
    if isinstance(choice, TreeChoice):
        return choice.nodes
    if isinstance(choice, (AnchoredChain, WindowEntry, SuffixStep)):
        return choice.k
    return int(choice)


def tree_widths(num_nodes: int, chain: int) -> list[int]:
    """Tree sizes the policy weighs in an engine of ``num_nodes`` tree nodes and chains of
    ``chain``: ``chain + 2``, then multiples of ``chain`` below ``num_nodes``, and
    ``num_nodes`` (6, 8, 12, 16 for chains of 4 and 16 nodes: the paper's Figure 5 sizes)."""
    sizes = {num_nodes}
    sizes.update(m for m in (chain + 2, *range(2 * chain, num_nodes, chain)) if m < num_nodes)
    return sorted(m for m in sizes if m > chain)


def tree_choices(num_nodes: int, chain: int, prune: bool) -> tuple[TreeChoice, ...]:
    """The trees of an engine: each width of :func:`tree_widths`, also pruned if ``prune``."""
    return tuple(
        TreeChoice(m, p)
        for m in tree_widths(num_nodes, chain)
        for p in ((False, True) if prune else (False,))
    )


#: Of the target's tokens the rank-``r`` stream candidate misses, the rank-``r + 1`` one
#: is taken to catch this share (:func:`template_tokens`): with it, the top-2, 8-node tree
#: accepts 1.36-1.49x the drafts of the full chain at the chain acceptance of the
#: real-task adapters, as the reference decoder measured on them (1.46-1.50).
RANK_CATCH = 0.5


def template_tokens(depths, ranks, parents, rates: np.ndarray) -> float:
    """Tokens a step yields per request with a tree of these nodes (bonus token included),
    when chain draft ``j`` is accepted with probability ``rates[j - 1]``: greedy acceptance
    takes one child per node, so the expected path length is the sum over the nodes of
    :func:`on_path_probs`."""
    return 1.0 + float(sum(on_path_probs(depths, ranks, parents, rates)))


def on_path_probs(depths, ranks, parents, rates: np.ndarray) -> list[float]:
    """Chance that each node is on the accepted path: the product, over its path, of the
    top-1's conditional acceptance at that depth, or for a rank-``r`` candidate ``(1 - that)
    * RANK_CATCH ** r``. A node's value depends only on its ancestors, so a prefix of the
    nodes gets the prefix of these values."""
    rates = np.asarray(rates, dtype=float)
    prev = np.concatenate([[1.0], rates[:-1]])
    cond = np.divide(rates, prev, out=np.zeros_like(rates), where=prev > 0)
    on_path: list[float] = []
    for depth, rank, parent in zip(depths, ranks, parents):
        q = cond[depth - 1] if depth <= len(cond) else 0.0
        p = q if rank == 0 else (1.0 - q) * RANK_CATCH**rank
        on_path.append(p * (on_path[parent] if parent >= 0 else 1.0))
    return on_path


@dataclass
class TreeStats:
    """Running estimate of the drafts one tree choice's steps accept per tree row.

    Before evidence a tree counts as its prior (:func:`template_tokens`); the accepted path
    lengths of its tree rows then take over (decayed counts).
    """

    decay: float = 0.98
    """Per step of this tree (a window of ~50 of them)."""
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
        """Tokens a step of this tree yields per request, when the prior says
        ``prior_tokens`` (bonus token included in both)."""
        prior = max(prior_tokens - 1.0, 0.0)
        return 1.0 + (self.accepted + self.prior_weight * prior) / (self.rows + self.prior_weight)


def tokens_per_step(rates: np.ndarray, k: int) -> float:
    """Tokens a step with ``k`` drafts yields per request, the bonus token included, when
    draft ``j`` is accepted with probability ``rates[j - 1]``."""
    return 1.0 + float(rates[:k].sum())


def batch_bucket(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2-3, 4-7, ...): its lower bound."""
    return 1 << (max(int(batch_size), 1).bit_length() - 1)


@dataclass
class MeasuredCost:
    """Step costs as this engine times them, the step-cost table where it has not.

    The tables time the model's forward alone, on one machine and checkpoint; a real step
    also samples, schedules and rejects, a machine may be slower or busier than the one
    measured, and a checkpoint's stream pass costs with its ``num_msa_layers`` (a table
    measured with 8 prices 4 drafts at 2.06 plain steps at batch 1 on AVX2, the 15-layer
    E2E checkpoint's steps cost 1.83 there), so a ratio read from the table can be off by
    more than the policy's margin. Here the proposer records the wall time between its
    calls (one engine step) per batch-size bucket and draft length; once a bucket has enough
    plain (k = 0) steps and steps of a choice, that choice costs its own measured ratio; an
    untimed chain costs the table's ratio times the median, over the timed chains, of
    measured over table, within what it was timed at in smaller and larger buckets
    (:meth:`_within_timed_neighbours`). Steps whose batch changed (a prefill, a request that
    finished) are not recorded: they are not decode steps of one batch.
    """

    table: StepCostTable
    anchored_table: StepCostTable | None = None
    """The ``accepted`` placement's table, for :class:`AnchoredChain` choices (a window
    engine's ``table`` is the window placement's)."""
    direct: frozenset = frozenset()
    """Choices whose steps are of another kind than the table's (the trees): they stay out
    of the correction of the chains; an untimed one costs the table's chain of as many rows
    times the median overhead the timed ones showed over that (:meth:`tree_overhead`)."""
    measure: bool = True
    """Whether step times are recorded. Not under tensor parallelism: every rank chooses
    its drafts alone and must choose as the others do (each runs the streams' sharded
    layers), and ranks' clocks differ; the tables and the acceptance (the same tokens on
    every rank) are the same everywhere."""
    window: int = 32
    """Step times kept per (bucket, draft length): medians follow the recent traffic."""
    min_samples: int = 6
    """Step times needed per (bucket, draft length) before they count."""
    times: dict[tuple[int, Choice], deque] = field(default_factory=dict, init=False)
    _medians: dict = field(default_factory=dict, init=False, repr=False)
    """Medians, corrections and ratios computed since the last recorded step: a step's
    choice prices every choice (twice in a step that drafts nothing), each reading the same
    medians (emptied by :meth:`record`)."""

    def record(self, batch_size: int, k: Choice, seconds: float) -> None:
        if not self.measure:
            return
        key = (batch_bucket(batch_size), k)
        self.times.setdefault(key, deque(maxlen=self.window)).append(seconds)
        self._medians.clear()

    def _median(self, bucket: int, k: Choice) -> float | None:
        key = (bucket, k)
        if key not in self._medians:
            samples = self.times.get(key)
            enough = samples is not None and len(samples) >= self.min_samples
            self._medians[key] = float(statistics.median(samples)) if enough else None
        return self._medians[key]

    def correction(self, batch_size: int) -> float:
        """Measured over table ratio at this batch size's bucket (1.0 before enough steps)."""
        bucket = batch_bucket(batch_size)
        key = ("correction", bucket)
        if key not in self._medians:
            self._medians[key] = self._correction(bucket)
        return self._medians[key]

    def _correction(self, bucket: int) -> float:
        plain = self._median(bucket, 0)
        if plain is None:
            return 1.0
        factors = [
            t / plain / self.table.ratio(bucket, k)
            for (b, k) in self.times
            if b == bucket
            and isinstance(k, int)
            and k > 0
            and k not in self.direct
            and (t := self._median(bucket, k)) is not None
        ]
        return float(statistics.median(factors)) if factors else 1.0

    def measured_ratio(self, batch_size: int, k: Choice) -> float | None:
        """Median step time with ``k`` drafts over a plain step's at this batch size's
        bucket (None before enough of both)."""
        bucket = batch_bucket(batch_size)
        plain, t = self._median(bucket, 0), self._median(bucket, k)
        return None if plain is None or t is None else t / plain

    def ratio(self, batch_size: int, k: Choice) -> float:
        if k == 0:
            return 1.0
        key = ("ratio", batch_size, k)
        if key not in self._medians:
            self._medians[key] = self._ratio(batch_size, k)
        return self._medians[key]

    def _ratio(self, batch_size: int, k: Choice) -> float:
        own = self.measured_ratio(batch_size, k)
        if own is not None:
            return own
        if isinstance(k, SuffixStep):
            estimate = 1.0  # no stream pass; its verify rows are timed once it has steps
        elif isinstance(k, WindowEntry):
            # untimed: the anchored pass (an anchored chain's extra over a plain step) on
            # top of the window step
            estimate = (
                self.ratio(batch_size, AnchoredChain(k.k)) + self.ratio(batch_size, k.k) - 1.0
            )
        elif k in self.direct:
            estimate = self._chain_like(batch_size, k) * self.tree_overhead(batch_size)
        else:
            estimate = self._chain_like(batch_size, k)
        return self._within_timed_neighbours(batch_size, k, estimate)

    def _within_timed_neighbours(self, batch_size: int, k: Choice, estimate: float) -> float:
        """``estimate`` of an untimed choice, raised to its measured ratio at any smaller
        batch-size bucket and lowered to it at any larger one: a step's cost over a plain
        one grows with the batch in every table (at batch 1 extra rows ride on the weight
        reads a plain step makes anyway, with more requests they cost their arithmetic). A
        bucket a few steps visit (a batch's tail, when finished requests leave 2-3
        running) is then priced no cheaper than the batch-1 steps already timed: DialogSum
        on an AVX-512 Zen 5, drafting steps at batch 2 cost 1.7-2.1 plain steps, the table
        prices 2 drafts there at 1.32, batch 1's timed 2-draft steps cost 1.36."""
        bucket = batch_bucket(batch_size)
        below, above = [], []
        for b, choice in self.times:
            if choice == k and b != bucket and (own := self.measured_ratio(b, k)) is not None:
                (below if b < bucket else above).append(own)
        if above:
            estimate = min(estimate, min(above))
        return max(estimate, max(below, default=estimate))

    def timed(self, batch_size: int, k: Choice) -> bool:
        """Whether this batch size's bucket has enough steps of ``k`` to count."""
        return self._median(batch_bucket(batch_size), k) is not None

    def _chain_like(self, batch_size: int, k: Choice) -> float:
        """The table's ratio for a chain of as many rows (an anchored chain: the
        ``accepted`` table's), corrected by the measured steps."""
        table = self.table
        if isinstance(k, AnchoredChain) and self.anchored_table is not None:
            table = self.anchored_table
        return table.ratio(batch_size, rows_of(k)) * self.correction(batch_size)

    def tree_overhead(self, batch_size: int) -> float:
        """Median, over the direct choices timed at this batch size's bucket, of their
        measured ratio over a chain of as many rows (1.0 before any is timed)."""
        factors = [
            own / self._chain_like(batch_size, k)
            for k in self.direct
            if (own := self.measured_ratio(batch_size, k)) is not None
        ]
        return float(np.median(factors)) if factors else 1.0

    def needs_plain_steps(self, batch_size: int) -> bool:
        """Whether this bucket has drafting steps to compare but too few plain ones."""
        bucket = batch_bucket(batch_size)
        drafted = any(b == bucket and k != 0 for (b, k) in self.times)
        return drafted and self._median(bucket, 0) is None


@dataclass
class StepTimer:
    """Wall time of the engine's decode steps, seen from the proposer's calls.

    The time from one call to the next is one engine step: the forward that verified the
    drafts handed out at the first call (with the window placement, also running that many
    streams), sampling and scheduling. :meth:`record` files it under that draft length when
    it was a decode step of the same batch: the same requests in the same rows (each row's
    last token is still there), each grown by 1 to ``k + 1`` tokens. Steps with a prefill,
    a request that finished or joined, or drafts that did not match the streams run, are
    left out.
    """

    clock: Callable[[], float] = time.perf_counter
    last_time: float | None = field(default=None, init=False)
    last_k: Choice | None = field(default=None, init=False)
    """Drafts of the step under way (None: not one clean choice)."""
    last_tokens: list[int] | None = field(default=None, init=False)
    last_ids: list[int] | None = field(default=None, init=False)

    # Lists and few numpy calls: this runs at every step, right after a forward has
    # evicted Python's and numpy's code from the caches (a numpy call then costs several
    # microseconds: 100 us for this method at batch 4 on AVX-512 with arrays).
    def record(self, cost, sampled_token_ids, num_tokens_no_spec, token_ids_cpu=None) -> None:
        """Called at the start of each proposer call (vLLM's ``propose`` arguments)."""
        now = self.clock()
        n = len(sampled_token_ids)
        tokens = np.asarray(num_tokens_no_spec[:n]).tolist()
        same = self._grew_alike(tokens)
        if token_ids_cpu is None:
            ids = None
        elif same:
            # each row's last token then, read again now, and its last token now: one gather
            both = _tokens_before(token_ids_cpu, [*self.last_tokens, *tokens], n)
            same, ids = both[:n] == self.last_ids, both[n:]
        else:
            ids = _tokens_before(token_ids_cpu, tokens, n)
        if same and isinstance(cost, MeasuredCost):
            cost.record(n, self.last_k, now - self.last_time)
        self.last_time, self.last_tokens, self.last_ids = now, tokens, ids

    def _grew_alike(self, tokens: list[int]) -> bool:
        """Whether each row grew by 1 to ``k + 1`` tokens since the last call, ``k`` the
        drafts it handed out (a decode step of the same batch if the rows' earlier tokens
        are also the same)."""
        last = self.last_tokens
        if self.last_time is None or self.last_k is None or not tokens or last is None:
            return False
        most = rows_of(self.last_k) + 1
        return len(last) == len(tokens) and all(1 <= t - s <= most for t, s in zip(tokens, last))

    def proposed(self, drafted: Choice, streams: Choice) -> None:
        """The call handed out drafts ``drafted`` (0: none) and asked for the streams of
        ``streams`` in the next forward: a clean step when they agree."""
        self.last_k = drafted if drafted == streams else None


def _tokens_before(token_ids_cpu, positions: list[int], n: int) -> list[int]:
    """The token before position ``positions[i]`` of batch row ``i mod n``, for each ``i``."""
    rows = [i % n for i in range(len(positions))]
    return np.asarray(token_ids_cpu[rows, [max(p - 1, 0) for p in positions]]).tolist()


class CostModel(Protocol):
    def ratio(self, batch_size: int, k: Choice) -> float:
        """Cost of a step with ``k`` drafts per request at ``batch_size`` over a plain step."""
        ...


class IdlePricing(NamedTuple):
    """An idle step's pricing, reused by the idle steps after it while ``key`` holds."""

    key: tuple
    """What it read besides the step times (:meth:`DraftPolicy._idle_key`)."""
    reuses_left: int
    """How many more idle steps may reuse it."""
    prior: tuple[Choice, int] | None = None
    """The prior's choice with its probe interval, once priced."""


@dataclass
class DraftPolicy:
    """Drafts per request for a step: the choice of highest expected speedup (a chain of
    ``k <= k_max`` or one of ``trees``).

    Where the acceptance seen so far says drafting does not pay but the prior says it
    would, an idle step now and then still drafts (a probe) after halving the old evidence,
    so that traffic which has become easier to draft for is noticed. Probes are spaced by
    their price (:meth:`probe_interval`): what a probe costs, its step's extra over a plain
    step or the loss of the run of drafting steps the last one started, is at most
    ``explore_budget`` of the idle steps it follows, where a drafting step is dear (batch 4
    on AVX2: 2.3 plain steps, one probe in 130 idle steps) and where it is cheap enough that
    the halved evidence keeps drafting after the probe (batch 1 on AVX-512: runs of ~11
    steps at ~1.07 plain steps, one in ~100 idle steps).
    """

    k_max: int
    cost: CostModel
    """A :class:`~vllm_specstream.speculation.step_cost.StepCostTable`, or :class:`MeasuredCost` over one."""
    stats: AcceptanceStats
    margin: float = 0.15
    """A step with drafts must beat a plain one by this much: the cost and acceptance
    estimates are each off by several percent on a small VM (engines differ by +-7% from one
    start to the next), a step that drafts nothing still costs ~1% more than plain vLLM's,
    and a request's prefill runs the streams at its last token. On Spider at batch 1 (AVX2)
    a 3% margin ran at 0.85x plain, this one at 0.95x (``docs/benchmarks.md``)."""
    probe_every: int = 64
    """Idle steps between probes at the least."""
    explore_budget: float = 0.01
    """Share of the idle steps' time that probes may cost (their extra over plain steps)."""
    template: TreeTemplate | None = None
    """The engine's draft tree (None: chains only); each of ``trees`` is a prefix of it."""
    trees: tuple[TreeChoice, ...] = ()
    """The trees weighed each step (:func:`tree_choices`)."""
    anchored: tuple[AnchoredChain, ...] = ()
    """A window engine's chains with their streams at the anchors, weighed each step."""
    timing_probe_every: int = 16
    """While some choice's cost at this batch size is not yet timed (a tree, or a chain
    length within ``probe_reach``), one drafting step in this many starts a probe of the
    likeliest (it costs at most a few tenths of a step per probe step)."""
    chain_probe_steps: int = 3
    """Steps a probe of a chain length lasts: with the window placement a step's drafts
    come from the streams the previous forward ran, so a chain longer than the last step's
    gets all its drafts, and a step of it times as itself, from its second step on."""
    probe_reach: float = 0.7
    """An untimed chain length is probed only if its estimated speedup is at least this
    share of the best choice's; so is an untimed tree once some tree is timed at this batch
    size (its overhead known)."""
    calibrate_every: int = 4
    """While the batch's bucket has drafting step times but too few plain ones to compare
    (:meth:`MeasuredCost.needs_plain_steps`), one drafting step in this many drafts nothing.
    Until then the table prices the steps, and a checkpoint's steps can cost far more than
    it says (the streams-only E2E checkpoint at batch 1 on AVX-512: 1.8 plain steps where
    the table says 1.07): one in 16 kept such an engine drafting rejected drafts for its
    first ~96 steps, one in 4 for ~24."""
    window_idle: bool = False
    """Whether the last forward of a window engine ran no window streams (the proposer sets
    it each step): a window chain chosen now costs a :class:`WindowEntry` step."""
    run_length: float = 1.0
    """Expected length in steps of a run of drafting steps: a decayed mean of the runs that
    ended (1 before any did). A window entry is paid once per run, so its extra over a
    window step is spread over the run (:meth:`run_horizon`); priced whole at every step,
    an engine that drafted from the anchors never went back to the window (Spider at batch
    1, AVX2: 1.09x plain per drafting step from the anchors where window steps gave 1.40x)."""
    run_weight: float = 0.25
    """Weight of the last run that ended in :attr:`run_length`."""
    max_run_horizon: float = 16.0
    """At most this many steps share an entry's extra cost."""
    reprice_every: int = 16
    """Idle steps in a row that reuse the last idle step's pricing while the batch size, the
    acceptance evidence and the run length are unchanged: then only the plain steps' times
    move (a median over 32), and pricing every choice was most of what an idle step's
    proposer call cost (~0.15 ms of ~0.35 at batch 4 on AVX-512)."""
    tree_stats: dict[TreeChoice, TreeStats] = field(default_factory=dict, init=False)
    idle_steps: int = field(default=0, init=False)
    run_steps: int = field(default=0, init=False)
    """Drafting steps of the run under way (0: the last step drafted nothing)."""
    drafting_steps: int = field(default=0, init=False)
    chain_steps: int = field(default=0, init=False)
    probing: tuple[Choice, int] | None = field(default=None, init=False)
    """The probe under way and how many more steps it lasts."""
    decisions: dict[Choice, int] = field(default_factory=dict, init=False)
    """How many steps got each choice (for :meth:`summary`)."""
    probe_loss: dict[int, float] = field(default_factory=dict, init=False)
    """Per batch-size bucket: what the last probe's run cost beyond the tokens it yielded,
    in plain steps (0 where its drafts paid). A probe halves the evidence, and where
    drafting steps are cheap (batch 1 on AVX-512: 1.1-1.25 plain steps) the halved
    estimate keeps drafting rejected drafts for ~10 steps after it: the run, not the probe
    alone, is what exploring costs."""
    _probe_bucket: int | None = field(default=None, init=False)
    """The bucket of the probe whose run is under way (None: none is)."""
    _probe_loss: float = field(default=0.0, init=False)
    _probe_step_cost: float | None = field(default=None, init=False)
    """The cost of the run's last step, settled once its drafts are verified."""
    _idle_pricing: IdlePricing | None = field(default=None, init=False)
    """The last idle step's pricing (None: the last step drafted)."""
    _tree_priors: tuple[bytes, np.ndarray] | None = field(default=None, init=False)
    """The template's prior tokens per prefix length under the last rates seen (every tree
    of a step is priced under the same rates: one pass over the template per step)."""

    def __post_init__(self) -> None:
        if self.trees and self.template is None:
            raise ValueError("a policy with trees needs their template")
        self.tree_stats = {t: TreeStats() for t in self.trees}

    def summary(self, batch_size: int) -> str:
        """One line: the choices made so far, the acceptance estimate, and the cost ratios
        the policy now uses at ``batch_size`` (for debug logs)."""
        rates = " ".join(f"{r:.2f}" for r in self.stats.accept_rates())
        costs = " ".join(
            f"{choice_label(k)}:{self.step_cost(batch_size, k):.2f}" for k in self.lengths()
        )
        chosen = " ".join(f"{choice_label(k)}:{n}" for k, n in self.decisions.items())
        line = f"steps by choice {chosen}; P(accept) {rates}; cost at batch {batch_size} {costs}"
        if self.trees:
            tokens = " ".join(f"{t}:{self.expected_tokens(t):.2f}" for t in self.trees)
            line += f"; tokens per tree step expected {tokens}"
        if isinstance(self.cost, MeasuredCost):
            bucket = batch_bucket(batch_size)
            entries = [WindowEntry(k) for k in range(1, self.k_max + 1)] if self.anchored else []
            keys = [0, *self.lengths(), *entries, SuffixStep(self.k_max)]
            medians = {k: m for k in keys if (m := self.cost._median(bucket, k))}
            measured = " ".join(f"{choice_label(k)}:{1e3 * m:.1f}" for k, m in medians.items())
            line += (
                f" (table x {self.cost.correction(batch_size):.2f} from measured steps; "
                f"median step ms {measured or 'none yet'})"
            )
        return line

    def expected_tokens(self, k: Choice, rates: np.ndarray | None = None) -> float:
        """Tokens per request of a step of choice ``k``."""
        rates = self.stats.accept_rates() if rates is None else rates
        if isinstance(k, TreeChoice):
            return self.tree_stats[k].expected_tokens(self._tree_prior(k.nodes, rates))
        return tokens_per_step(rates, rows_of(k))  # a chain's drafts, wherever its streams ran

    def _tree_prior(self, nodes: int, rates: np.ndarray) -> float:
        """:func:`template_tokens` of the template's first ``nodes`` nodes under ``rates``."""
        key = np.asarray(rates, dtype=float).tobytes()
        if self._tree_priors is None or self._tree_priors[0] != key:
            t = self.template
            cumulative = np.cumsum(on_path_probs(t.depths, t.ranks, t.parents, rates))
            self._tree_priors = (key, cumulative)
        return 1.0 + float(self._tree_priors[1][nodes - 1])

    def step_cost(self, batch_size: int, k: Choice, steady: bool = False) -> float:
        """Cost of this step with choice ``k`` over a plain step: a window chain right after
        a forward without window streams costs its :class:`WindowEntry` step (``steady``:
        as a step inside a run of window drafts)."""
        entry = (
            self.window_idle
            and not steady
            and isinstance(self.cost, MeasuredCost)
            and isinstance(k, int)
            and k > 0
        )
        window = self.cost.ratio(batch_size, k)
        if not entry:
            return window
        extra = self.cost.ratio(batch_size, WindowEntry(k)) - window
        return window + extra / self.run_horizon()

    def run_horizon(self) -> float:
        """Steps expected to share a window entry now: the mean run, or the run under way
        if longer (a run that has lasted ``n`` steps is taken to last about ``n`` more),
        between 1 and :attr:`max_run_horizon`."""
        return min(max(self.run_length, self.run_steps, 1.0), self.max_run_horizon)

    def _end_run(self) -> None:
        if self.run_steps:
            w = self.run_weight
            self.run_length = (1.0 - w) * self.run_length + w * self.run_steps
            self.run_steps = 0

    def expected_speedup(
        self, batch_size: int, k: Choice, rates: np.ndarray | None = None, steady: bool = False
    ) -> float:
        return self.expected_tokens(k, rates) / self.step_cost(batch_size, k, steady)

    def lengths(self) -> list[Choice]:
        """The choices that draft: chains of ``1..k_max`` (also anchored where weighed) and
        the trees."""
        return [*range(1, self.k_max + 1), *self.anchored, *self.trees]

    def best_length(
        self, batch_size: int, rates: np.ndarray | None = None, steady: bool = False
    ) -> Choice:
        """The choice of highest expected speedup under ``rates`` (default: the estimate);
        0 unless it beats a plain step by ``margin``."""
        rates = self.stats.accept_rates() if rates is None else rates
        best_k, best = 0, 1.0 + self.margin
        for k in self.lengths():
            speedup = self.expected_speedup(batch_size, k, rates, steady)
            if speedup > best:
                best_k, best = k, speedup
        return best_k

    def draft_length(self, batch_size: int) -> Choice:
        if self._probe_step_cost is not None:
            # The last step of a probe's run, settled now that its drafts were verified:
            # its cost less the tokens it yielded per request, in plain steps.
            self._probe_loss += self._probe_step_cost - (1.0 + self.stats.kept_per_row)
            self._probe_step_cost = None
        k = self._draft_length(batch_size)
        if self._probe_bucket is not None:
            if k != 0:
                self._probe_step_cost = self.step_cost(batch_size, k)
            elif self.run_steps == 0:  # the run the probe started is over
                self.probe_loss[self._probe_bucket] = max(self._probe_loss, 0.0)
                self._probe_bucket = None
        self.decisions[k] = self.decisions.get(k, 0) + 1
        return k

    def _idle_key(self, batch_size: int) -> tuple:
        """What an idle step's pricing reads besides the step times."""
        return (batch_size, self.window_idle, self.stats.version, self.run_length)

    def _draft_length(self, batch_size: int) -> Choice:
        key = self._idle_key(batch_size)
        held = self._idle_pricing
        reused = held is not None and held.key == key and held.reuses_left > 0
        k = 0 if reused else self.best_length(batch_size)
        if k != 0:
            self._idle_pricing = None
            self.idle_steps = 0
            self.run_steps += 1
            if isinstance(self.cost, MeasuredCost) and self.cost.needs_plain_steps(batch_size):
                self.drafting_steps += 1
                if self.drafting_steps % self.calibrate_every == 0:
                    return 0  # a calibration step: a plain step's time at this batch size
            if self.probing is not None:
                probe, left = self.probing
                self.probing = (probe, left - 1) if left > 1 else None
                return probe
            probe = self._choice_to_time(batch_size, k)
            if probe is not None and probe != k:
                self.chain_steps += 1
                if self.chain_steps % self.timing_probe_every == 0:
                    # a probe: that choice's step time at this size
                    steps = 1 if isinstance(probe, TreeChoice) else self.chain_probe_steps
                    self.probing = (probe, steps - 1) if steps > 1 else None
                    return probe
            return k
        self.probing = None
        prior = held.prior if reused else None
        left = held.reuses_left - 1 if reused else self.reprice_every
        self._idle_pricing = IdlePricing(key, left, prior)
        self._end_run()
        self.idle_steps += 1
        if self.idle_steps < self.probe_every:
            return 0  # no probe this soon (the prior's choice is priced only from here on)
        if prior is None:
            # Whether drafting could pay once under way (an entry step is paid once per
            # run), and the idle steps a probe of it waits for.
            prior_k = self.best_length(batch_size, self.stats.prior_rates(), steady=True)
            prior = (prior_k, self.probe_interval(batch_size, prior_k) if prior_k else 0)
            self._idle_pricing = self._idle_pricing._replace(prior=prior)
        prior_k, interval = prior
        if prior_k == 0:
            self.idle_steps = 0  # no acceptance would pay at this batch size: nothing to learn
            return 0
        if self.idle_steps < interval:
            return 0
        self.idle_steps = 0
        self.stats.forget(0.5)
        self._probe_bucket, self._probe_loss = batch_bucket(batch_size), 0.0
        return prior_k

    def probe_interval(self, batch_size: int, probe: Choice) -> int:
        """Idle steps before a probe of ``probe``: ``probe_every``, or more where the probe
        would cost more than ``explore_budget`` of them: its step's extra over a plain one,
        or what the last probe's run at this batch size's bucket lost, if more."""
        extra = self.step_cost(batch_size, probe) - 1.0
        extra = max(extra, self.probe_loss.get(batch_bucket(batch_size), 0.0))
        return max(self.probe_every, math.ceil(extra / self.explore_budget))

    def _choice_to_time(self, batch_size: int, best: Choice) -> Choice | None:
        """The untimed choice to probe at this batch size (None: none is worth it): of the
        untimed chain lengths within ``probe_reach`` of the best choice's estimated speedup
        and the untimed trees (before any tree is timed here, all of them: an untimed tree's
        estimate has no overhead measured yet; after, those within reach too), the one of
        highest estimated speedup."""
        cost = self.cost
        if not isinstance(cost, MeasuredCost) or not cost.measure:
            return None
        reach = self.probe_reach * self.expected_speedup(batch_size, best)
        untimed_trees = [
            t for t in self.trees if t in cost.direct and cost.measured_ratio(batch_size, t) is None
        ]
        any_tree_timed = len(untimed_trees) < len(self.trees)
        speedup = {
            c: self.expected_speedup(batch_size, c)
            for c in (*range(1, self.k_max + 1), *self.anchored, *untimed_trees)
            if c != best and not (not isinstance(c, TreeChoice) and cost.timed(batch_size, c))
        }
        candidates = [
            c
            for c, s in speedup.items()
            if s >= reach or (isinstance(c, TreeChoice) and not any_tree_timed)
        ]
        return max(candidates, key=speedup.__getitem__, default=None)


def choice_label(k: Choice) -> str:
    """A choice as logs and benchmarks name it: ``k2`` for a chain, else its ``str``."""
    return (
        str(k) if isinstance(k, (TreeChoice, AnchoredChain, WindowEntry, SuffixStep)) else f"k{k}"
    )


def lookup_length(lookup: Sequence[int], batch_size: int) -> int:
    """Drafts at ``batch_size`` from a dense schedule (index = batch size; the last entry
    holds beyond it)."""
    return lookup[min(batch_size, len(lookup) - 1)]


def confident_drafts(tokens: torch.Tensor, top_prob: torch.Tensor, min_prob: float) -> torch.Tensor:
    """``tokens`` (``[N, G]`` stream top-1 tokens per anchor) with -1 from the first stream
    whose cumulative top-1 probability (``top_prob``, ``[N, G]``) is below ``min_prob``."""
    keep = torch.cumprod(top_prob, dim=-1) >= min_prob
    return torch.where(keep, tokens, torch.full_like(tokens, -1))
