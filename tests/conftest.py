"""Shared fixtures: the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def base_model_dir() -> Path:
    """The converted embedded SmolLM2-135M-Instruct (converted on first use)."""
    from vllm_specstream.base_model import prepare_base

    return prepare_base(progress=False)
