"""`specstream eval`: tokens per step and the task metric of a checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_specstream.cli.common import (
    DATA_HELP,
    TASK_HELP,
    DefaultsHelpFormatter,
    add_split_args,
)


def _cmd_eval(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_specstream.training.evaluate import eval_cases, evaluate_checkpoint, load_any

    if args.data and args.prompts:
        print("specstream eval: error: give --data or --prompts, not both", file=sys.stderr)
        return 2
    try:  # before loading the model: bad data fails fast
        cases = eval_cases(
            args.task,
            args.prompts,
            args.n,
            args.seed,
            data=args.data,
            split=args.split,
            val_fraction=args.val_fraction,
            split_seed=args.split_seed,
        )
    except (ValueError, OSError) as e:
        print(f"specstream eval: error: {e}", file=sys.stderr)
        return 2
    model = load_any(args.checkpoint, base=args.base)
    from vllm_specstream.training.checkpoint import resolve_base

    ckpt = Path(args.checkpoint)
    tokenizer_dir = (
        ckpt
        if (ckpt / "tokenizer.json").is_file()
        else resolve_base(args.base, model.config.base_model, ckpt)
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    result = evaluate_checkpoint(
        model, tokenizer, args.task, cases, args.max_new_tokens, args.tree_top_k
    )
    result["checkpoint"] = str(args.checkpoint)
    if args.data:
        result["data"] = {
            "file": args.data,
            "split": args.split,
            "val_fraction": args.val_fraction,
            "split_seed": args.split_seed,
        }
    print(json.dumps(result))
    return 0


def add_parser(sub) -> None:
    from vllm_specstream.training.tasks import ALL_TASKS

    defaults = DefaultsHelpFormatter

    p = sub.add_parser(
        "eval",
        help="tokens/step (reference decoder, chain and tree) and task quality",
        description="Greedy-decode held-out prompts with the reference speculative-streaming "
        "decoder (chain and tree) and print, as the last line, one JSON object with "
        "tokens_per_step, extra_params and the task metrics in percent, averaged over "
        "prompts: exact_match for sql (after whitespace, case and quote normalisation; "
        "sqlglot's canonical SQL where both queries parse), rouge1 and rougeLsum F-measures "
        "for e2e and dialogsum (rouge-score, stemmed; one sentence per line for rougeLsum), "
        "rouge_l for the synthetic text and code tasks. A prompt with several references "
        "scores its best one, for each metric.",
        formatter_class=defaults,
    )
    p.add_argument("--checkpoint", required=True, help="adapter or merged checkpoint")
    p.add_argument("--task", default="sql", choices=ALL_TASKS, help=TASK_HELP)
    p.add_argument("--data", help=DATA_HELP)
    add_split_args(p, choose_split=True, val_note=" (training's value)")
    p.add_argument("--prompts", help="generic JSONL of prompts and references (sql records too)")
    p.add_argument("--base", help="base model dir for an adapter (default: the recorded one)")
    p.add_argument(
        "-n", "--n", type=int, help="first N prompts (default: the whole test split or file)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--tree-top-k",
        type=int,
        default=2,
        help="candidates per stream in tree mode (0: chain only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_eval)
