"""Helpers shared by tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(
    code: str, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment (vLLM spawns processes, so
    engine code runs in its own ``__main__``); return the finished process."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO / "tests",
    )


def venv_script(name: str) -> str:
    """Path of a console script installed next to this interpreter."""
    return str(Path(sys.executable).with_name(name))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
