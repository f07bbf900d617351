"""Command-line flags made from typed config dataclasses: type, default and help from the
field, so a default or a description lives in one place."""

import argparse
from dataclasses import dataclass
from typing import Literal

import pytest

from vllm_specstream.cli.common import add_field_flags


@dataclass
class _Settings:
    out: str
    """Where the ``steps`` go."""
    steps: int = 300
    """Optimizer steps."""
    rate: float | None = None
    mode: Literal["fast", "exact"] = "fast"
    pack: bool = True
    """Pack examples into rows."""


def _parser(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_field_flags(p, _Settings, ["out", "steps", "rate", "mode", "pack"], **kwargs)
    return p


def test_flags_take_the_fields_types_defaults_and_docstrings():
    p = _parser(rate={"metavar": "R"})
    args = p.parse_args(["--out", "x"])
    assert (args.out, args.steps, args.rate, args.mode, args.pack) == ("x", 300, None, "fast", True)
    args = p.parse_args(
        ["--out", "x", "--steps", "5", "--rate", "0.5", "--mode", "exact", "--no-pack"]
    )
    assert (args.steps, args.rate, args.mode, args.pack) == (5, 0.5, "exact", False)
    text = " ".join(p.format_help().split())
    assert "Where the --steps go." in text  # a field's name reads as its flag
    assert "Optimizer steps. (default: 300)" in text and "--rate R" in text
    assert "--no-pack Pack examples into rows." in text and "(default: True)" not in text
    with pytest.raises(SystemExit):
        p.parse_args(["--steps", "5"])  # a field without default is a required flag
    with pytest.raises(SystemExit):
        p.parse_args(["--out", "x", "--mode", "slow"])  # a Literal's values are the choices
