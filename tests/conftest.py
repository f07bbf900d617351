"""Shared fixtures: the embedded model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import LONGEST_FIRST, REPO

# One unpinned OpenMP thread per engine and per test process: several engines run at once on
# the suite's few cores, and vLLM's default binding would pin every plain engine to the same
# core while a speculating one spins two threads. (The binding rules are tested as functions:
# tests/unit/test_cpu_env.py.) Set before any engine or fork server starts; inherited by all.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


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
