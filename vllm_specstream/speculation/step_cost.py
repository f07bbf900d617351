"""What a speculative decode step costs against a plain one, per CPU class (measured).

A step with ``k`` drafts per request verifies ``k + 1`` rows per request and runs the stream
pass; whether that pays depends on the CPU: on AVX2 the GEMMs' cost grows faster with rows
than with AVX-512. The adaptive policy (:mod:`vllm_specstream.speculation.policy`) divides the tokens a
step is expected to yield by these ratios. Tables come from ``benchmarks/step_cost.py``
(median decode-step time, fp32, the same prompts with and without speculation, in one run).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_specstream.machine import cpu_class
from vllm_specstream.speculation.options import PLACEMENTS


@dataclass(frozen=True)
class StepCostTable:
    """Median decode-step time with ``k`` drafts per request over a plain step's, measured
    at a few batch sizes (linear in between and beyond, between measured ``k`` too)."""

    cpu_class: str
    """The CPU class measured (:data:`vllm_specstream.machine.CPU_CLASSES`)."""
    batch_sizes: tuple[int, ...]
    """Batch sizes measured, ascending."""
    ratios: Mapping[int, tuple[float, ...]]
    """Draft length -> cost ratio at each of ``batch_sizes``."""
    source: str
    """Where it was measured (machine, checkpoint, command)."""
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """:meth:`ratio` per ``(batch_size, k)`` (the adaptive policy prices every choice at
    every step)."""

    def __post_init__(self) -> None:
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or not self.batch_sizes:
            raise ValueError(f"batch_sizes must ascend: {self.batch_sizes}")
        for k, row in self.ratios.items():
            if k < 1 or len(row) != len(self.batch_sizes):
                raise ValueError(f"ratios[{k}] needs one ratio per batch size")

    def _at_batch(self, row: tuple[float, ...], batch_size: int) -> float:
        sizes = self.batch_sizes
        if len(sizes) == 1:
            return row[0]
        i = min(max(bisect.bisect_right(sizes, batch_size) - 1, 0), len(sizes) - 2)
        b0, b1 = sizes[i], sizes[i + 1]
        r0, r1 = row[i], row[i + 1]
        t = (max(batch_size, sizes[0]) - b0) / (b1 - b0)
        # Past the largest size the trend goes on (never below the last ratio).
        return max(r0 + t * (r1 - r0), row[-1] if batch_size > sizes[-1] else 0.0)

    def ratio(self, batch_size: int, k: int) -> float:
        """Cost of a step with ``k`` drafts per request at ``batch_size`` over a plain step."""
        key = (batch_size, k)
        if key not in self._memo:
            self._memo[key] = self._ratio(batch_size, k)
        return self._memo[key]

    def _ratio(self, batch_size: int, k: int) -> float:
        if k <= 0:
            return 1.0
        known = sorted(self.ratios)
        lo = max((x for x in known if x <= k), default=0)
        hi = min((x for x in known if x >= k), default=known[-1])
        r_lo = 1.0 if lo == 0 else self._at_batch(self.ratios[lo], batch_size)
        r_hi = self._at_batch(self.ratios[hi], batch_size)
        if hi == lo:
            return r_hi if k <= hi else r_hi + (k - hi) * self._row_cost(batch_size)
        return r_lo + (k - lo) / (hi - lo) * (r_hi - r_lo)

    def _row_cost(self, batch_size: int) -> float:
        """Cost of one more draft row per request beyond the largest ``k`` measured: the
        measured ratios' mean slope from the smallest ``k`` to the largest (a single ``k``:
        its ratio's share per row). At batch 1 a step reads every weight whatever its rows,
        so extra rows cost far less than a proportional share: top-2 trees of 16 nodes on
        E2E cost 3.7 plain steps at batch 1 and 6.9 at batch 16 on the AVX2 CPU of the
        ``accepted`` table (``docs/benchmarks.md``, "Draft trees and pruning"; tokens per step over
        speedup), this slope says 3.7 and 9.7, a proportional share 8.0 and 14.7."""
        known = sorted(self.ratios)
        lo, hi = known[0], known[-1]
        r_hi = self._at_batch(self.ratios[hi], batch_size)
        if hi == lo:
            return r_hi / hi
        return (r_hi - self._at_batch(self.ratios[lo], batch_size)) / (hi - lo)


_AVX2_SOURCE = (
    "AMD EPYC (AVX2 only), 2 cores, nothing else running, fp32, SmolLM2-135M demo SQL "
    "checkpoint (8 MSA layers), Spider validation prompts: benchmarks/step_cost.py as of "
    "5dd4864 (one engine per process, a cell's fastest round) --batch-sizes 1,4,16,32 "
    "--max-tokens 24 --placement {placement}"
)

_AVX512_BF16_SOURCE = (
    "AMD EPYC Zen 4 (AVX-512 with AVX512-BF16), 2 cores, nothing else running, fp32, "
    "SmolLM2-135M demo SQL checkpoint merged (8 MSA layers), Spider validation prompts: "
    "benchmarks/step_cost.py (interleaved, engines on core 0, 8 timed groups, control "
    "0.95-1.00) --ks 1,2,3,4 --batch-sizes 1,4,16,32 --max-tokens 24 --placement {placement}"
)

_AVX512_EMULATED_SOURCE = (
    "emulated: the Zen 4 CPU of the avx512_bf16 tables with oneDNN limited to AVX-512 without "
    "bf16 or VNNI (ONEDNN_MAX_CPU_ISA=AVX512_CORE, so the stream pass runs in fp32 as on such "
    "a CPU; vLLM's fp32 attention kernels are the same on both classes), otherwise as "
    "measured there --placement {placement}"
)

_AMX_SOURCE = (
    "Intel Xeon with AMX-BF16 (family 6 model 167 as the VM reports it), 2 cores, nothing "
    "else running, fp32, SmolLM2-135M demo SQL checkpoint merged (8 MSA layers), Spider "
    "validation prompts: benchmarks/step_cost.py (interleaved, engines on both cores, 8 timed "
    "groups; each ratio divided by the control's at its batch size: the second plain engine, "
    "built before the speculating ones and after plain, ran 0.91-0.98 of plain) --ks 1,2,3,4 "
    "--batch-sizes 1,4,16,32 --max-tokens 24 --control --placement {placement}"
)

#: Batch sizes every table below was measured at.
_BATCH_SIZES = (1, 4, 16, 32)

#: (CPU class, placement) -> (draft length -> cost ratio per batch size, source), from
#: ``benchmarks/step_cost.py`` runs (``docs/benchmarks.md``), made non-decreasing in k (more
#: drafts never cost less):
#: the AVX2 ones keep each cell's fastest round and raise a cell below the one before it;
#: the interleaved AVX-512 and AMX ones lower a cell above a longer draft's (a step with more
#: drafts does all a shorter one does, so its median bounds the shorter one's).
_MEASURED: dict[tuple[str, str], tuple[dict[int, tuple[float, ...]], str]] = {
    ("avx2", "accepted"): (
        {
            1: (1.58, 1.68, 2.16, 2.51),
            2: (1.72, 1.88, 2.83, 3.55),
            3: (1.72, 2.16, 3.47, 4.13),
            4: (2.01, 2.26, 3.67, 4.50),
        },
        _AVX2_SOURCE.format(placement="accepted") + " --rounds 2",
    ),
    ("avx2", "window"): (
        {
            1: (1.45, 1.73, 2.29, 2.53),
            2: (1.45, 2.12, 3.64, 4.38),
            4: (2.06, 4.24, 8.20, 12.16),
        },
        _AVX2_SOURCE.format(placement="window") + " --ks 1,2,4 --rounds 1",
    ),
    ("avx512_bf16", "accepted"): (
        {
            1: (1.20, 1.58, 2.08, 2.36),
            2: (1.20, 1.81, 2.88, 3.10),
            3: (1.20, 2.07, 3.34, 3.85),
            4: (1.20, 2.36, 3.98, 4.51),
        },
        _AVX512_BF16_SOURCE.format(placement="accepted"),
    ),
    ("avx512_bf16", "window"): (
        {
            1: (1.07, 1.50, 2.23, 2.50),
            2: (1.07, 1.81, 3.31, 3.69),
            3: (1.16, 2.25, 4.21, 5.04),
            4: (1.25, 2.78, 5.70, 6.72),
        },
        _AVX512_BF16_SOURCE.format(placement="window"),
    ),
    ("avx512", "window"): (
        {
            1: (1.22, 1.58, 2.20, 2.58),
            2: (1.22, 2.11, 3.39, 3.91),
            3: (1.32, 2.51, 4.49, 5.30),
            4: (1.47, 3.20, 5.68, 6.97),
        },
        _AVX512_EMULATED_SOURCE.format(placement="window"),
    ),
    ("avx512", "accepted"): (
        {
            1: (1.34, 1.76, 2.33, 2.49),
            2: (1.34, 2.02, 3.24, 3.33),
            3: (1.34, 2.33, 3.83, 4.02),
            4: (1.34, 2.56, 4.41, 4.96),
        },
        _AVX512_EMULATED_SOURCE.format(placement="accepted"),
    ),
    ("amx", "window"): (
        {
            1: (1.17, 1.47, 1.81, 2.15),
            2: (1.25, 1.69, 2.37, 2.89),
            3: (1.35, 1.99, 2.89, 3.56),
            4: (1.45, 2.24, 3.51, 4.67),
        },
        _AMX_SOURCE.format(placement="window"),
    ),
    ("amx", "accepted"): (
        {
            1: (1.32, 1.51, 1.78, 2.05),
            2: (1.34, 1.65, 2.12, 2.49),
            3: (1.36, 1.82, 2.42, 2.92),
            4: (1.39, 1.94, 2.76, 3.37),
        },
        _AMX_SOURCE.format(placement="accepted"),
    ),
}

#: The measured tables per (CPU class, placement).
TABLES: dict[tuple[str, str], StepCostTable] = {
    (cls, placement): StepCostTable(cls, _BATCH_SIZES, ratios, source)
    for (cls, placement), (ratios, source) in _MEASURED.items()
}


#: Draft lengths the start-up placement choice weighs, at batch 1 (where drafts pay most).
PLACEMENT_CHOICE_KS = (1, 2, 3, 4)


def cheaper_placement(cls: str | None = None) -> str:
    """The placement an eager engine takes on CPU class ``cls`` (default: this CPU's): the
    one whose batch-1 step costs less summed over :data:`PLACEMENT_CHOICE_KS` in the class's
    tables. ``window`` on every measured class (it also prices chains with their streams at
    the anchors, so the policy can take the cheaper of the two step by step)."""
    return min(
        PLACEMENTS,
        key=lambda p: sum(table_for(p, cls).ratio(1, k) for k in PLACEMENT_CHOICE_KS),
    )


def table_for(placement: str, cls: str | None = None) -> StepCostTable:
    """The table for ``placement`` on CPU class ``cls`` (default: this CPU's); every class
    of :data:`vllm_specstream.machine.CPU_CLASSES` has one per placement."""
    return TABLES[cls or cpu_class(), placement]
