"""`specstream data split`: the by-group train/val split of a task file."""

from __future__ import annotations

import argparse
import sys

from vllm_specstream.cli.common import (
    DATA_HELP,
    DefaultsHelpFormatter,
    add_split_args,
)


def _cmd_data_split(args: argparse.Namespace) -> int:
    from vllm_specstream.training.tasks import write_split

    try:
        paths = write_split(args.task, args.data, args.out, args.val_fraction, args.split_seed)
    except (ValueError, OSError) as e:
        print(f"specstream data split: error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def add_parser(sub) -> None:
    defaults = DefaultsHelpFormatter

    p = sub.add_parser("data", help="task data files: split", description="Task data files.")
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = data_sub.add_parser(
        "split",
        help="write the by-group train/val split of a task file",
        description="Write OUT/train.EXT and OUT/val.EXT, the rows of --data verbatim in its "
        "format: the split that `specstream train` trains on and `eval`/`bench --split val` "
        "evaluate with the same --val-fraction and --split-seed.",
        formatter_class=defaults,
    )
    p.add_argument("--task", required=True, choices=["sql", "e2e", "dialogsum"])
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument("--out", required=True, help="output directory")
    add_split_args(p, choose_split=False)
    p.set_defaults(func=_cmd_data_split)
