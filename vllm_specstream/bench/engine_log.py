"""vLLM's own output to a log file, the results to the screen.

vLLM's engine core runs in a child process, and C++ libraries (oneDNN, torch) write to the
file descriptors directly; redirecting ``sys.stdout`` alone misses both. ``output_to``
redirects descriptors 1 and 2 themselves, so everything this process and its children
print lands in the log, and hands back a stream to the real terminal for what a person reads.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from vllm_specstream.paths import specstream_home


def default_log(name: str) -> Path:
    """``<SPECSTREAM_HOME>/logs/<name>.log``."""
    return specstream_home() / "logs" / f"{name}.log"


@contextmanager
def output_to(log: Path) -> Iterator[TextIO]:
    """Within the block, descriptors 1 and 2 (this process and every child it starts) write to
    ``log`` (truncated first); yields a line-buffered stream to the original stdout."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    screen = os.fdopen(os.dup(saved_out), "w", buffering=1)
    try:
        with open(log, "w") as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                yield screen
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved_out, 1)
                os.dup2(saved_err, 2)
    finally:
        os.close(saved_out)
        os.close(saved_err)
        screen.close()
