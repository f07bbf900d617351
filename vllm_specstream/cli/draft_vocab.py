"""`specstream draft-vocab`: give an adapter a draft vocabulary."""

from __future__ import annotations

import argparse
import sys

from vllm_specstream.cli.common import (
    DATA_HELP,
    DefaultsHelpFormatter,
    add_split_args,
)


def _cmd_draft_vocab(args: argparse.Namespace) -> int:
    from vllm_specstream.checkpoint.config import ConfigError
    from vllm_specstream.training.draft_vocab import add_draft_vocab

    try:
        summary = add_draft_vocab(
            args.adapter_dir,
            args.task,
            args.data,
            size=args.size,
            val_fraction=args.val_fraction,
            seed=args.split_seed,
            base=args.base,
        )
    except (ConfigError, ValueError, OSError) as e:
        print(f"specstream draft-vocab: error: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.adapter_dir}: the streams draft from {summary.size} of {summary.vocab_size} "
        f"tokens ({summary.reply_tokens} distinct tokens in the training replies, "
        f"{summary.reply_coverage:.1%} of their tokens covered); export it again "
        "(`specstream export`) to serve it"
    )
    return 0


def add_parser(sub) -> None:
    defaults = DefaultsHelpFormatter

    from vllm_specstream.checkpoint.draft_vocab import DEFAULT_DRAFT_VOCAB_SIZE

    p = sub.add_parser(
        "draft-vocab",
        help="give an adapter a draft vocabulary: its streams' LM head reads only those rows",
        description="Choose the tokens an adapter's streams draft from, from the training "
        "split of a task file: the tokens of its replies (most frequent first), then of its "
        "prompts, then the tokenizer's lowest ids, up to --size. The streams' LM head then "
        "multiplies by those rows only (cheaper drafting steps on a CPU); drafts are still "
        "verified by the whole model, so outputs do not change. Writes draft_vocab_size into "
        "specstream_config.json and draft_vocab_mask into specstream.safetensors.",
        formatter_class=defaults,
    )
    p.add_argument("adapter_dir", help="adapter checkpoint (as `specstream train` writes it)")
    p.add_argument("--task", required=True, choices=["sql", "e2e", "dialogsum"])
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument(
        "--size", type=int, default=DEFAULT_DRAFT_VOCAB_SIZE, help="tokens in the vocabulary"
    )
    p.add_argument("--base", help="base model dir (default: the one recorded in the adapter)")
    add_split_args(p, choose_split=False)
    p.set_defaults(func=_cmd_draft_vocab)
