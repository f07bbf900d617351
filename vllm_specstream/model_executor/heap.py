"""Freed heap memory handed back to the OS in a speculating engine's worker.

A speculative step allocates temporaries of many sizes (``k + 1`` rows per request, stream
rows, drafted logits), and glibc's ``malloc`` keeps what they free in its heap, fragmented:
over a 500-request serving soak the worker's resident memory grew 134 MiB per 100 requests
where plain decoding's grew 39, and ``malloc_trim(0)`` gave 200-450 MiB of it back at any
point (an engine in one process, 40 rounds of mixed batches); with it the soak's memory is
flat (``benchmarks/results/soak.md``).
So every :data:`TRIM_EVERY_S` seconds of steps the worker calls it: 1-30 ms, at most 1.5% of
the steps' time. Other C libraries (no ``malloc_trim``) are left alone.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

from vllm_specstream.logger import init_logger

logger = init_logger(__name__)

#: Seconds between two trims (checked at each step).
TRIM_EVERY_S = 2.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


class HeapTrim:
    """Trims the heap at a step once ``every_s`` seconds have passed since the last trim."""

    def __init__(
        self,
        every_s: float = TRIM_EVERY_S,
        trim: Callable[[int], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.every_s = every_s
        self.trims = 0
        self._trim = trim if trim is not None else _malloc_trim()
        self._clock = clock
        self._last = clock()

    def step(self) -> None:
        if self._trim is None:
            return
        now = self._clock()
        if now - self._last < self.every_s:
            return
        self._last = now
        before = resident_mib()
        self._trim(0)
        self.trims += 1
        if self.trims == 1:
            logger.info(
                "specstream trims the worker's heap every %g s of steps (first: RSS %.0f -> "
                "%.0f MiB)",
                self.every_s,
                before,
                resident_mib(),
            )


def resident_mib() -> float:
    """This process's resident memory in MiB (psutil, a dependency of vLLM)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20
