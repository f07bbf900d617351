"""Adaptive speculation: how many drafts each request gets this step.

Verifying ``k`` drafts makes every request's forward ``k + 1`` rows long and adds the stream
pass. Whether that pays depends on the CPU (extra rows cost more on AVX2 than with
AVX-512), on the batch size (at batch 1 a step is bound by reading the weights, with many
requests by arithmetic) and on how many drafts the target accepts (the checkpoint, the
task, the prompts). The default policy weighs all three every step:

* **cost**: the measured cost of a step with ``k`` drafts over a plain step at this batch
  size on this CPU class (:mod:`vllm_specstream.step_cost`), corrected by the step times the
  engine itself measures (:class:`MeasuredCost`);
* **acceptance**: :class:`AcceptanceStats`, a running estimate from what vLLM verified of
  the chance that draft position ``j`` is accepted (decayed counts, so it follows the
  traffic, and a prior so that a fresh engine drafts);
* it drafts the ``k`` of highest expected speedup ``E[tokens | k] / cost(batch, k)``, or
  nothing where no ``k`` beats a plain step by ``margin``.

In a tree engine the draft tree is one more choice, ``k = tree_nodes``: its tokens come from
:class:`TreeStats` (what tree steps accepted, a full chain's estimate before), its cost from
the tree steps this engine timed (a few probes measure it where the table's extrapolation
says it does not pay), so trees run only where they beat the best chain on this CPU.

A user's batch-size schedule in vLLM's own format (``num_speculative_tokens_per_batch_size``,
read with vLLM's validator in :mod:`vllm_specstream.vllm_schedule`) replaces the cost model.
The confidence rule (``$SPECSTREAM_DRAFT_MIN_PROB``, off by default) then cuts each
request's draft before the first stream whose cumulative top-1 probability falls below it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from vllm_specstream.step_cost import StepCostTable


@dataclass
class AcceptanceStats:
    """Running estimate of ``P(draft j accepted | j drafted)`` for ``j = 1..num_positions``.

    ``record_proposed`` notes the drafts handed to vLLM; the next step's
    ``record_verified`` reads how many each request kept (its sampled tokens minus the
    bonus token). Only totals per position are kept, so rows moving between steps do not
    matter. Counts decay by ``decay`` at every step that drafted: old traffic fades.
    """

    num_positions: int
    decay: float = 0.98
    """Per step that drafted (a window of ~50 such steps)."""
    prior_rate: float = 0.7
    """Prior ``P(draft j accepted | drafted) = prior_rate ** j``."""
    prior_weight: float = 4.0
    """The prior counts as this many drafts at each position."""
    proposed: np.ndarray = field(init=False)
    accepted: np.ndarray = field(init=False)
    pending: np.ndarray = field(init=False)
    """Drafts at each position handed out last step, awaiting verification."""

    def __post_init__(self) -> None:
        self.proposed = np.zeros(self.num_positions)
        self.accepted = np.zeros(self.num_positions)
        self.pending = np.zeros(self.num_positions)

    def _at_least(self, lengths: Sequence[int]) -> np.ndarray:
        """How many of ``lengths`` are ``>= j``, for ``j = 1..num_positions``."""
        capped = np.minimum(np.asarray(lengths, dtype=np.int64), self.num_positions)
        hist = np.bincount(capped, minlength=self.num_positions + 1)
        return hist[::-1].cumsum()[::-1][1:].astype(float)

    def record_proposed(self, drafts: Sequence[Sequence[int]]) -> None:
        self.pending = self._at_least([len(d) for d in drafts])

    def record_verified(self, sampled_token_ids: Sequence[Sequence[int]]) -> None:
        if not self.pending.any():
            return
        self.forget(self.decay)
        kept = self._at_least([max(len(s) - 1, 0) for s in sampled_token_ids])
        self.proposed += self.pending
        self.accepted += np.minimum(kept, self.pending)
        self.pending = np.zeros(self.num_positions)

    def forget(self, factor: float) -> None:
        """Scale the evidence by ``factor`` (the prior keeps its weight)."""
        self.proposed *= factor
        self.accepted *= factor

    def prior_rates(self) -> np.ndarray:
        return self.prior_rate ** np.arange(1, self.num_positions + 1)

    def accept_rates(self) -> np.ndarray:
        """``P(draft j accepted)`` for ``j = 1..num_positions`` (non-increasing)."""
        prior = self.prior_rates()
        rates = (self.accepted + self.prior_weight * prior) / (self.proposed + self.prior_weight)
        return np.minimum.accumulate(rates)

    def expected_tokens(self, k: int) -> float:
        """Tokens a step with ``k`` drafts yields per request (:func:`tokens_per_step`)."""
        return tokens_per_step(self.accept_rates(), k)


@dataclass
class TreeStats:
    """Running estimate of the drafts a tree step accepts per tree row.

    Before evidence a tree counts as ``prior_gain`` times the accepted drafts of a full
    chain; the accepted path lengths of tree rows then take over (decayed counts).
    """

    decay: float = 0.98
    """Per tree step (a window of ~50 of them)."""
    prior_gain: float = 1.45
    """Accepted drafts of the tree over the full chain's: the reference decoder on the
    three real-task adapters with the top-2, 8-node template (SQL 1.46, E2E 1.50,
    DialogSum 1.49; ``benchmarks/results/*/eval-specstream.json``)."""
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

    def expected_tokens(self, chain_tokens: float) -> float:
        """Tokens a tree step yields per request, when a full chain would yield
        ``chain_tokens`` (bonus token included in both)."""
        prior = self.prior_gain * max(chain_tokens - 1.0, 0.0)
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
    """The step-cost table, corrected by the step times this engine measures.

    The tables time the model's forward alone, on one machine; a real step also samples,
    schedules and rejects, and a machine may be slower or busier than the one measured, so
    a ratio read from the table can be optimistic by more than the policy's margin. Here
    the proposer records the wall time between its calls (one engine step) per batch-size
    bucket and draft length; once a bucket has enough plain (k = 0) and drafting steps, the
    measured ratio over the table's, a median over the draft lengths seen, scales the
    table's ratios of that bucket. Steps whose batch changed (a prefill, a request that
    finished) are not recorded: they are not decode steps of one batch.
    """

    table: StepCostTable
    direct: frozenset[int] = frozenset()
    """Draft lengths whose steps are of another kind than the table's (a tree's node
    count): once timed, their own ratio to a plain step is used, and they stay out of the
    correction of the others."""
    window: int = 32
    """Step times kept per (bucket, draft length): medians follow the recent traffic."""
    min_samples: int = 6
    """Step times needed per (bucket, draft length) before they count."""
    times: dict[tuple[int, int], deque] = field(default_factory=dict, init=False)

    def record(self, batch_size: int, k: int, seconds: float) -> None:
        key = (batch_bucket(batch_size), k)
        self.times.setdefault(key, deque(maxlen=self.window)).append(seconds)

    def _median(self, bucket: int, k: int) -> float | None:
        samples = self.times.get((bucket, k))
        if samples is None or len(samples) < self.min_samples:
            return None
        return float(np.median(samples))

    def correction(self, batch_size: int) -> float:
        """Measured over table ratio at this batch size's bucket (1.0 before enough steps)."""
        bucket = batch_bucket(batch_size)
        plain = self._median(bucket, 0)
        if plain is None:
            return 1.0
        factors = [
            t / plain / self.table.ratio(bucket, k)
            for (b, k) in self.times
            if b == bucket
            and k > 0
            and k not in self.direct
            and (t := self._median(bucket, k)) is not None
        ]
        return float(np.median(factors)) if factors else 1.0

    def measured_ratio(self, batch_size: int, k: int) -> float | None:
        """Median step time with ``k`` drafts over a plain step's at this batch size's
        bucket (None before enough of both)."""
        bucket = batch_bucket(batch_size)
        plain, t = self._median(bucket, 0), self._median(bucket, k)
        return None if plain is None or t is None else t / plain

    def ratio(self, batch_size: int, k: int) -> float:
        if k <= 0:
            return 1.0
        if k in self.direct and (own := self.measured_ratio(batch_size, k)) is not None:
            return own
        return self.table.ratio(batch_size, k) * self.correction(batch_size)

    def needs_plain_steps(self, batch_size: int) -> bool:
        """Whether this bucket has drafting steps to compare but too few plain ones."""
        bucket = batch_bucket(batch_size)
        drafted = any(b == bucket and k > 0 for (b, k) in self.times)
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
    last_k: int = field(default=-1, init=False)
    """Draft length of the step under way (-1: not one clean length)."""
    last_tokens: np.ndarray | None = field(default=None, init=False)
    last_ids: np.ndarray | None = field(default=None, init=False)

    def record(self, cost, sampled_token_ids, num_tokens_no_spec, token_ids_cpu=None) -> None:
        """Called at the start of each proposer call (vLLM's ``propose`` arguments)."""
        now = self.clock()
        n = len(sampled_token_ids)
        tokens = np.asarray(num_tokens_no_spec[:n], dtype=np.int64).copy()
        if isinstance(cost, MeasuredCost) and self._same_batch(tokens, token_ids_cpu):
            cost.record(n, self.last_k, now - self.last_time)
        self.last_time, self.last_tokens = now, tokens
        self.last_ids = self._last_ids(token_ids_cpu, tokens, len(tokens))

    def _same_batch(self, tokens: np.ndarray, token_ids_cpu) -> bool:
        """Whether the step since the last call was a decode step of the same batch."""
        n, last = len(tokens), self.last_tokens
        if self.last_time is None or self.last_k < 0 or n == 0 or last is None or len(last) != n:
            return False
        grew = tokens - last
        if not np.all((grew >= 1) & (grew <= self.last_k + 1)):
            return False
        ids = self._last_ids(token_ids_cpu, last, n)
        return ids is None or np.array_equal(ids, self.last_ids)

    @staticmethod
    def _last_ids(token_ids_cpu, tokens: np.ndarray | None, n: int) -> np.ndarray | None:
        """Each row's token at position ``tokens - 1``: a request's last token then."""
        if token_ids_cpu is None or tokens is None or len(tokens) != n:
            return None
        return np.asarray(token_ids_cpu[np.arange(n), np.maximum(tokens - 1, 0)]).copy()

    def proposed(self, drafted: int, streams: int) -> None:
        """The call handed out drafts of length ``drafted`` (0: none) and asked for
        ``streams`` streams in the next forward: a clean step when they agree."""
        self.last_k = drafted if drafted == streams else -1


class CostModel(Protocol):
    def ratio(self, batch_size: int, k: int) -> float:
        """Cost of a step with ``k`` drafts per request at ``batch_size`` over a plain step."""
        ...


@dataclass
class DraftPolicy:
    """Drafts per request for a step: the ``k <= k_max`` of highest expected speedup.

    Where the acceptance seen so far says drafting does not pay but the prior says it
    would, one step in ``probe_every`` still drafts (a probe) after halving the old
    evidence, so that traffic which has become easier to draft for is noticed; a probe
    costs one step's extra cost (at most a few tenths of a plain step) per ``probe_every``.
    """

    k_max: int
    cost: CostModel
    """A :class:`~vllm_specstream.step_cost.StepCostTable`, or :class:`MeasuredCost` over one."""
    stats: AcceptanceStats
    margin: float = 0.15
    """A step with drafts must beat a plain one by this much: the cost and acceptance
    estimates are each off by several percent on a small VM (engines differ by +-7% from one
    start to the next), a step that drafts nothing still costs ~1% more than plain vLLM's,
    and a request's prefill runs the streams at its last token. On Spider at batch 1 (AVX2)
    a 3% margin ran at 0.85x plain, this one at 0.95x (``benchmarks/README.md``)."""
    probe_every: int = 64
    tree_nodes: int = 0
    """Nodes of the engine's draft tree (0: chains only); drafting the tree is the choice
    ``k = tree_nodes`` (more than ``k_max``)."""
    tree_stats: TreeStats = field(default_factory=TreeStats)
    tree_probe_every: int = 16
    """While a tree step's cost at this batch size is not yet timed, one drafting step in
    this many drafts the tree (it costs at most a few tenths of a step each)."""
    calibrate_every: int = 16
    """While the batch's bucket has drafting step times but too few plain ones to compare
    (:meth:`MeasuredCost.needs_plain_steps`), one drafting step in this many drafts nothing."""
    idle_steps: int = field(default=0, init=False)
    drafting_steps: int = field(default=0, init=False)
    chain_steps: int = field(default=0, init=False)
    decisions: dict[int, int] = field(default_factory=dict, init=False)
    """How many steps got each draft length (for :meth:`summary`)."""

    def summary(self, batch_size: int) -> str:
        """One line: the draft lengths chosen so far, the acceptance estimate, and the cost
        ratios the policy now uses at ``batch_size`` (for debug logs)."""
        rates = " ".join(f"{r:.2f}" for r in self.stats.accept_rates())
        costs = " ".join(f"{self.cost.ratio(batch_size, k):.2f}" for k in self.lengths())
        chosen = " ".join(f"k{k}:{n}" for k, n in sorted(self.decisions.items()))
        line = (
            f"steps by draft length {chosen}; P(accept) {rates}; cost at batch {batch_size} {costs}"
        )
        if self.tree_nodes:
            line += (
                f" (k{self.tree_nodes}: the tree, "
                f"{self.expected_tokens(self.tree_nodes):.2f} tokens per step expected)"
            )
        if isinstance(self.cost, MeasuredCost):
            bucket = batch_bucket(batch_size)
            medians = {k: m for k in [0, *self.lengths()] if (m := self.cost._median(bucket, k))}
            measured = " ".join(f"k{k}:{1e3 * m:.1f}" for k, m in medians.items())
            line += (
                f" (table x {self.cost.correction(batch_size):.2f} from measured steps; "
                f"median step ms {measured or 'none yet'})"
            )
        return line

    def expected_tokens(self, k: int, rates: np.ndarray | None = None) -> float:
        """Tokens per request of a step with ``k`` drafts (``tree_nodes``: the tree)."""
        rates = self.stats.accept_rates() if rates is None else rates
        if self.tree_nodes and k == self.tree_nodes:
            return self.tree_stats.expected_tokens(tokens_per_step(rates, self.k_max))
        return tokens_per_step(rates, k)

    def expected_speedup(self, batch_size: int, k: int, rates: np.ndarray | None = None) -> float:
        return self.expected_tokens(k, rates) / self.cost.ratio(batch_size, k)

    def lengths(self) -> list[int]:
        """The choices that draft: chains of ``1..k_max`` and the tree if there is one."""
        return list(range(1, self.k_max + 1)) + ([self.tree_nodes] if self.tree_nodes else [])

    def best_length(self, batch_size: int, rates: np.ndarray | None = None) -> int:
        """The ``k`` of highest expected speedup under ``rates`` (default: the estimate);
        0 unless it beats a plain step by ``margin``."""
        rates = self.stats.accept_rates() if rates is None else rates
        best_k, best = 0, 1.0 + self.margin
        for k in self.lengths():
            speedup = self.expected_speedup(batch_size, k, rates)
            if speedup > best:
                best_k, best = k, speedup
        return best_k

    def draft_length(self, batch_size: int) -> int:
        k = self._draft_length(batch_size)
        self.decisions[k] = self.decisions.get(k, 0) + 1
        return k

    def _draft_length(self, batch_size: int) -> int:
        k = self.best_length(batch_size)
        if k > 0:
            self.idle_steps = 0
            if isinstance(self.cost, MeasuredCost) and self.cost.needs_plain_steps(batch_size):
                self.drafting_steps += 1
                if self.drafting_steps % self.calibrate_every == 0:
                    return 0  # a calibration step: a plain step's time at this batch size
            if self._tree_untimed(batch_size) and k != self.tree_nodes:
                self.chain_steps += 1
                if self.chain_steps % self.tree_probe_every == 0:
                    return self.tree_nodes  # a tree probe: a tree step's time at this size
            return k
        prior_k = self.best_length(batch_size, self.stats.prior_rates())
        if prior_k == 0:
            return 0  # no acceptance would pay at this batch size: nothing to learn
        self.idle_steps += 1
        if self.idle_steps < self.probe_every:
            return 0
        self.idle_steps = 0
        self.stats.forget(0.5)
        return prior_k

    def _tree_untimed(self, batch_size: int) -> bool:
        """Whether the tree's step cost at this batch size is still the table's guess."""
        return (
            bool(self.tree_nodes)
            and isinstance(self.cost, MeasuredCost)
            and self.tree_nodes in self.cost.direct
            and self.cost.measured_ratio(batch_size, self.tree_nodes) is None
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
