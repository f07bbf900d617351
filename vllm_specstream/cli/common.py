"""What several commands share: the task and data flags."""

from __future__ import annotations

import argparse
import dataclasses
import functools

TASK_HELP = (
    "sql, e2e, dialogsum: the paper's tasks, read from --data FILE in their public format "
    '(docs/training.md, "Tasks"; sql without --data: a synthetic generator); code, text: synthetic builders'
)
DATA_HELP = (
    "a file in the task's public format: sql: JSON list or JSONL of context, question, answer "
    "(optional db_id); e2e: CSV with columns mr, ref (one row per reference); dialogsum: "
    "JSONL with dialogue and summary (or summary1, summary2, ...)"
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends with the flag's default where it has one (not "(default: None)": a
    flag without a default says in its help what happens without it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


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


@functools.cache  # parsed once a process: CPython 3.11's ast.parse can fail spuriously
def field_docs(cls) -> dict[str, str]:
    """The attribute docstrings of dataclass ``cls`` (the string under each field), one line
    each, as ``--help`` shows them: roles and backticks dropped, the class's own field names
    written as their flags."""
    import ast
    import inspect
    import re
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    names = {f.name for f in dataclasses.fields(cls)}
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            text = " ".join(str(nxt.value.value).split())
            text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([^`]+)`", r"\1", text)
            text = re.sub(
                r"``(\w+)``",
                lambda m: (
                    "--" + m.group(1).replace("_", "-") if m.group(1) in names else m.group(1)
                ),
                text,
            )
            docs[node.target.id] = text.replace("``", "")
    return docs


def add_field_flags(p: argparse.ArgumentParser, cls, names: list[str], **kwargs: dict) -> None:
    """``--name`` for each field ``name`` of dataclass ``cls``: its type, default and
    docstring (``kwargs[name]`` adds or overrides ``add_argument`` keywords); a bool field
    that defaults to true is ``--no-name``."""
    import typing

    hints = typing.get_type_hints(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    docs = field_docs(cls)
    for name in names:
        flag = name.replace("_", "-")
        kind = hints[name]
        options: dict = {"help": docs.get(name, ""), "default": defaults[name]}
        if options["default"] is dataclasses.MISSING:
            options.update(required=True, default=None)
        if kind is bool:
            if not defaults[name]:
                raise TypeError(f"{cls.__name__}.{name}: only true-by-default bools are flags")
            # The parser's default, set before the flag: "(default: True)" under a --no-
            # flag would read as the opposite.
            p.set_defaults(**{name: True})
            options.update(kwargs.get(name, {}), default=argparse.SUPPRESS)
            p.add_argument(f"--no-{flag}", dest=name, action="store_false", **options)
            continue
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is typing.Literal:
            options.update(type=type(args[0]), choices=args)
        else:
            options["type"] = args[0] if args else kind
        options.update(kwargs.get(name, {}))
        p.add_argument(f"--{flag}", dest=name, **options)
