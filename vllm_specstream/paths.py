"""Where vllm-specstream keeps its caches (``SPECSTREAM_HOME``)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_HOME = "SPECSTREAM_HOME"


def specstream_home() -> Path:
    """The cache root: ``$SPECSTREAM_HOME``, else ``$XDG_CACHE_HOME/vllm-specstream``,
    else ``~/.cache/vllm-specstream``."""
    if os.environ.get(ENV_HOME):
        return Path(os.environ[ENV_HOME]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return root / "vllm-specstream"
