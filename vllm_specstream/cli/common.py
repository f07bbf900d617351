"""What several commands share: the task and data flags."""

from __future__ import annotations

import argparse

TASK_HELP = (
    "sql, e2e, dialogsum: the paper's tasks, read from --data FILE in their public format "
    '(docs/training.md, "Tasks"; sql without --data: a synthetic generator); code, text: synthetic builders'
)
DATA_HELP = (
    "a file in the task's public format: sql: JSON list or JSONL of context, question, answer "
    "(optional db_id); e2e: CSV with columns mr, ref (one row per reference); dialogsum: "
    "JSONL with dialogue and summary (or summary1, summary2, ...)"
)


def add_split_args(p: argparse.ArgumentParser, choose_split: bool, val_note: str = "") -> None:
    """--val-fraction and --split-seed (and --split): the same values in train, eval, bench
    and data split cut the same by-group split of a --data file."""
    from vllm_specstream.training.tasks import DEFAULT_VAL_FRACTION

    if choose_split:
        p.add_argument(
            "--split",
            default="all",
            choices=["all", "train", "val"],
            help="records of --data to use: all, or one side of the split that `specstream "
            "train` cuts by group (sql: db_id, else the schema; e2e: mr; dialogsum: dialogue)",
        )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help="share of a --data file's records held out, whole groups at a time" + val_note,
    )
    p.add_argument("--split-seed", type=int, default=0, help="seed of that split")
