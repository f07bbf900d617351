"""The suite's scheduling order names files that exist."""

from __future__ import annotations

from helpers import LONGEST_FIRST, REPO


def test_every_file_scheduled_first_exists():
    # A renamed or removed engine file would silently fall back to the end of the run.
    missing = [name for name in LONGEST_FIRST if not (REPO / "tests" / name).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
