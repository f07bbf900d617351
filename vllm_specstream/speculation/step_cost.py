"""What a speculative step costs against a plain one, as this engine times it.

A step with ``k`` drafts per request verifies ``k + 1`` rows per request and runs the
stream pass. The proposer times the engine's steps (:class:`StepTimer`); :class:`StepCosts`
keeps the median per batch-size bucket and choice, and prices a choice not timed yet with
a model of the rows it verifies (:class:`RowModel`), fitted to the chains timed so far.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_specstream.speculation.choices import (
    AnchoredChain,
    Choice,
    CopyStep,
    TreeChoice,
    rows_of,
)


def batch_bucket(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2-3, 4-7, ...): its lower bound."""
    return 1 << (max(int(batch_size), 1).bit_length() - 1)


@dataclass(frozen=True)
class RowModel:
    """A step's cost over a plain one: ``1 + stream_pass + row_cost * rows * b / (b +
    half_batch)`` at batch size ``b``. At batch 1 a step reads every weight whatever its
    rows, so a draft row costs little; with many requests it costs its arithmetic. The
    defaults are a middle of what steps cost on AVX2, AVX-512 and AMX CPUs (4 drafts: 1.2-2.0
    plain steps at batch 1, 2.8-4.0 at batch 16; ``docs/policy.md``)."""

    stream_pass: float = 0.2
    row_cost: float = 0.8
    half_batch: float = 8.0

    def rows_term(self, batch_size: float, rows: int) -> float:
        return rows * batch_size / (batch_size + self.half_batch)

    def ratio(self, batch_size: float, rows: int) -> float:
        if rows <= 0:
            return 1.0
        return 1.0 + self.stream_pass + self.row_cost * self.rows_term(batch_size, rows)

    def fitted(self, points: list[tuple[int, int, float]], weight: float = 1.0) -> RowModel:
        """This model fitted to measured ``(batch, rows, ratio)`` points: its two costs by
        least squares, each default counting as ``weight`` points (a ridge toward it), for
        each of :data:`HALF_BATCHES` where the points span batch sizes; the closest fit."""
        if not points:
            return self
        halves = HALF_BATCHES if len({b for b, _, _ in points}) > 1 else (self.half_batch,)
        fits = [self._fit(points, weight, h) for h in halves]
        return min(fits, key=lambda fit: fit[0])[1]

    def _fit(self, points, weight: float, half_batch: float) -> tuple[float, RowModel]:
        x = np.array([rows * b / (b + half_batch) for b, rows, _ in points])
        y = np.array([ratio - 1.0 for _, _, ratio in points])
        a = np.array([[len(x) + weight, x.sum()], [x.sum(), x @ x + weight]])
        rhs = np.array([y.sum() + weight * self.stream_pass, x @ y + weight * self.row_cost])
        stream_pass, row_cost = np.maximum(np.linalg.solve(a, rhs), 0.0)
        residual = float(((y - stream_pass - row_cost * x) ** 2).sum())
        return residual, RowModel(float(stream_pass), float(row_cost), half_batch)


#: Batch sizes at which a draft row costs half its share, tried where timed steps span
#: batch sizes (CPUs differ: with AVX2 the rows' arithmetic tells from batch 4 on).
HALF_BATCHES = (2.0, 4.0, 8.0, 16.0, 32.0)


@dataclass
class StepCosts:
    """Step times per (batch-size bucket, choice); a choice's cost is its median over a
    plain step's in the same bucket, or the :class:`RowModel` fitted to the timed chains
    where it has too few steps (an untimed tree: times the overhead the timed trees showed
    over chains of as many rows; an untimed suffix step: a plain step's cost). Steps whose
    batch changed (a prefill, a request that finished) are not recorded."""

    prior: RowModel = field(default_factory=RowModel)
    measure: bool = True
    """Whether step times are recorded. Not under tensor parallelism: every rank chooses its
    drafts alone and must choose as the others do, and ranks' clocks differ."""
    window: int = 32
    """Step times kept per (bucket, choice): medians follow the recent traffic."""
    min_samples: int = 4
    """Step times needed per (bucket, choice) before they count."""
    times: dict[tuple[int, Choice | CopyStep], deque] = field(default_factory=dict, init=False)
    _cache: dict = field(default_factory=dict, init=False, repr=False)
    """Medians, the fit and ratios since the last recorded step (every choice is priced
    at every step from the same medians)."""

    def record(self, batch_size: int, choice: Choice | CopyStep, seconds: float) -> None:
        if not self.measure:
            return
        key = (batch_bucket(batch_size), choice)
        self.times.setdefault(key, deque(maxlen=self.window)).append(seconds)
        self._cache.clear()

    def _median(self, bucket: int, choice) -> float | None:
        key = ("median", bucket, choice)
        if key not in self._cache:
            samples = self.times.get((bucket, choice))
            enough = samples is not None and len(samples) >= self.min_samples
            self._cache[key] = float(statistics.median(samples)) if enough else None
        return self._cache[key]

    def measured_ratio(self, batch_size: int, choice) -> float | None:
        """Median step time of ``choice`` over a plain step's at this batch size's bucket
        (None before enough of both)."""
        bucket = batch_bucket(batch_size)
        plain, t = self._median(bucket, 0), self._median(bucket, choice)
        return None if plain is None or t is None else t / plain

    def timed(self, batch_size: int, choice) -> bool:
        return self.measured_ratio(batch_size, choice) is not None

    def model(self, anchored: bool = False) -> RowModel:
        """The prior fitted to the timed chains of one kind: the placement's, or (a window
        engine's) those with their streams at the anchors."""
        key = ("model", anchored)
        if key not in self._cache:
            kind = AnchoredChain if anchored else int
            points = [
                (bucket, rows_of(choice), ratio)
                for bucket, choice in self.times
                if isinstance(choice, kind)
                and choice != 0
                and (ratio := self.measured_ratio(bucket, choice)) is not None
            ]
            self._cache[key] = self.prior.fitted(points)
        return self._cache[key]

    def tree_overhead(self) -> float:
        """Median over the timed trees of their cost over the model's for as many rows."""
        ratios = [
            ratio / self.model().ratio(bucket, choice.nodes)
            for bucket, choice in self.times
            if isinstance(choice, TreeChoice)
            and (ratio := self.measured_ratio(bucket, choice)) is not None
        ]
        return float(np.median(ratios)) if ratios else 1.0

    def ratio(self, batch_size: int, choice) -> float:
        """Cost of a step of ``choice`` at ``batch_size`` over a plain step."""
        if choice == 0:
            return 1.0
        key = ("ratio", batch_size, choice)
        if key not in self._cache:
            ratio = self.measured_ratio(batch_size, choice)
            if ratio is None and isinstance(choice, CopyStep):
                ratio = 1.0  # no stream pass; its verify rows count once it is timed
            elif ratio is None:
                model = self.model(anchored=isinstance(choice, AnchoredChain))
                ratio = model.ratio(batch_size, rows_of(choice))
                if isinstance(choice, TreeChoice):
                    ratio *= self.tree_overhead()
                ratio = max(ratio, self._at_least(batch_size, choice))
            self._cache[key] = ratio
        return self._cache[key]

    def _at_least(self, batch_size: int, choice) -> float:
        """What ``choice`` was timed at in the nearest smaller bucket: a step's cost over a
        plain one grows with the batch (at batch 1 extra rows ride on the weight reads, with
        more requests they cost their arithmetic), so a larger bucket costs at least that."""
        bucket = batch_bucket(batch_size)
        below = [b for b, c in self.times if c == choice and b < bucket and self.timed(b, c)]
        return self.measured_ratio(max(below), choice) if below else 0.0

    def needs_plain_steps(self, batch_size: int) -> bool:
        """Whether this bucket has drafting steps to compare but too few plain ones."""
        bucket = batch_bucket(batch_size)
        drafted = any(b == bucket and c != 0 for b, c in self.times)
        return drafted and self._median(bucket, 0) is None

    def summary(self) -> str:
        m = self.model()
        return f"stream_pass {m.stream_pass:.2f}, row_cost {m.row_cost:.2f}"


@dataclass
class StepTimer:
    """Wall time of the engine's decode steps, seen from the proposer's calls.

    The time from one call to the next is one engine step: the forward that verified the
    drafts handed out at the first call, sampling and scheduling. :meth:`record` files it
    under that choice when it was a decode step of the same batch: the same requests in the
    same rows (each row's last token is still there), each grown by 1 to ``k + 1`` tokens.
    """

    clock: Callable[[], float] = time.perf_counter
    last_time: float | None = field(default=None, init=False)
    last_choice: Choice | CopyStep | None = field(default=None, init=False)
    """The choice of the step under way (None: not one clean choice)."""
    last_tokens: list[int] | None = field(default=None, init=False)
    last_ids: list[int] | None = field(default=None, init=False)

    # Lists and few numpy calls: this runs at every step, right after a forward has
    # evicted Python's and numpy's code from the caches.
    def record(
        self, costs: StepCosts, sampled_token_ids, num_tokens_no_spec, token_ids_cpu=None
    ) -> None:
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
        if same:
            costs.record(n, self.last_choice, now - self.last_time)
        self.last_time, self.last_tokens, self.last_ids = now, tokens, ids

    def _grew_alike(self, tokens: list[int]) -> bool:
        last = self.last_tokens
        if self.last_time is None or self.last_choice is None or not tokens or last is None:
            return False
        most = rows_of(self.last_choice) + 1
        return len(last) == len(tokens) and all(1 <= t - s <= most for t, s in zip(tokens, last))

    def proposed(self, choice: Choice | CopyStep | None) -> None:
        """The call's step is timed as ``choice`` (None: not one clean choice)."""
        self.last_choice = choice


def _tokens_before(token_ids_cpu, positions: list[int], n: int) -> list[int]:
    """The token before position ``positions[i]`` of batch row ``i mod n``, for each ``i``."""
    rows = [i % n for i in range(len(positions))]
    return np.asarray(token_ids_cpu[rows, [max(p - 1, 0) for p in positions]]).tolist()
