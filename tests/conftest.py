"""Shared fixtures: the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import LONGEST_FIRST, REPO


def pytest_collection_modifyitems(config, items):
    """Engine-heavy files first, longest first (see ``helpers.LONGEST_FIRST``); a stable
    sort, so each file's tests keep their order and stay together."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        rel = item.path.resolve().relative_to(REPO / "tests").as_posix()
        return rank.get(rel, len(rank))

    items.sort(key=key)


@pytest.fixture(scope="session")
def base_model_dir() -> Path:
    """The converted embedded SmolLM2-135M-Instruct (converted on first use)."""
    from vllm_specstream.base_model import prepare_base

    return prepare_base(progress=False)


@pytest.fixture(autouse=True)
def _restore_vllm_logger():
    """CLI entry points called in-process attach a handler to the ``vllm`` logger bound to
    pytest's captured stderr of that test; later tests would log into a closed stream."""
    import logging

    root = logging.getLogger("vllm")
    saved = (list(root.handlers), root.propagate, root.level)
    yield
    root.handlers[:], root.propagate = saved[0], saved[1]
    root.setLevel(saved[2])
