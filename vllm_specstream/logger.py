"""Loggers that print through vLLM's handler and format.

vLLM configures the ``vllm`` logger; children named ``vllm.<module>`` inherit its handler,
so plugin messages look like vLLM's own. Outside vLLM processes (training, the CLI) the
CLI attaches an equivalent handler itself, without importing vLLM.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


def init_logger(name: str) -> logging.Logger:
    """Logger for module ``name`` under vLLM's ``vllm`` logger."""
    return logging.getLogger(f"vllm.{name}")


def configure_cli_logging(level: str | None = None) -> None:
    """Give the ``vllm`` logger a stderr handler if vLLM has not configured it."""
    root = logging.getLogger("vllm")
    level = level or os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
    root.setLevel(level.upper())
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False
