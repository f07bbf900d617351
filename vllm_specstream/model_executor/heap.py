"""Freed heap memory handed back to the OS in a speculating engine's worker.

A speculative step allocates temporaries of many sizes (``k + 1`` rows per request, stream
rows, drafted logits), and glibc's ``malloc`` keeps what they free in its heap, fragmented:
over a 500-request serving soak the worker's resident memory grew 134 MiB per 100 requests
where plain decoding's grew 39 (``benchmarks/results/soak.md``), and ``malloc_trim(0)`` gave
200-250 MiB of it back at any point (an engine in one process, 40 rounds of mixed batches).
So every :data:`TRIM_EVERY` steps the worker calls it: 1-30 ms, under 0.5% of the steps'
time. Other C libraries (no ``malloc_trim``) are left alone.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

#: Steps between two trims.
TRIM_EVERY = 256


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


class HeapTrim:
    """Counts the worker's steps and trims the heap every ``every`` of them."""

    def __init__(self, every: int = TRIM_EVERY, trim: Callable[[int], int] | None = None):
        self.every = every
        self.steps = 0
        self.trims = 0
        self._trim = trim if trim is not None else _malloc_trim()

    def step(self) -> None:
        if self._trim is None:
            return
        self.steps += 1
        if self.steps % self.every == 0:
            self._trim(0)
            self.trims += 1
