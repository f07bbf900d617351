"""Shared fixtures: the embedded model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import LONGEST_FIRST, REPO

#: vLLM's CPU thread binding (``VLLM_CPU_OMP_THREADS_BIND``).
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def pytest_configure(config):
    """Under pytest-xdist, each worker's vLLM engines compute on a core of their own. vLLM's
    ``auto`` binding puts the worker of every engine on the same core (two test workers'
    engines would share one core while the other idles) and the plugin gives a speculating
    engine every core (two of them would oversubscribe both). Tests that need another
    binding set their own; a binding the user set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    if workers < 2 or len(cpus) < workers or OMP_BIND in os.environ:
        return
    index = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    share = len(cpus) // workers
    os.environ[OMP_BIND] = ",".join(map(str, cpus[index * share : (index + 1) * share]))


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
