"""Built-in fine-tuning tasks (text-to-SQL, Python continuation, data-to-text): public API."""

from __future__ import annotations

from vllm_specstream.training.data import ChatExample, sql_example, user_example
from vllm_specstream.training.metrics import normalize_sql, rouge_l, sql_exact_match
from vllm_specstream.training.tasks._split import split_of
from vllm_specstream.training.tasks.code import (
    build_code,
    code_test_packages,
    package_of,
    stdlib_files,
)
from vllm_specstream.training.tasks.sql import build_sql, sql_key
from vllm_specstream.training.tasks.text import build_text, text_key

__all__ = [
    "DEFAULT_N",
    "SPLITS",
    "TASKS",
    "build_task",
    "code_test_packages",
    "normalize_sql",
    "record_split",
    "reference",
    "rouge_l",
    "split_of",
    "sql_exact_match",
    "stdlib_files",
    "to_example",
]

TASKS = ("sql", "code", "text")
SPLITS = ("train", "test")
DEFAULT_N = {"sql": (2000, 300), "code": (2000, 200), "text": (2000, 300)}


def build_task(name: str, split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """``n`` records of task ``name`` for ``split`` (``train`` or ``test``), deterministic."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if n is None:
        n = DEFAULT_N[name][SPLITS.index(split)]
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if name == "sql":
        return build_sql(split, n, seed)
    if name == "text":
        return build_text(split, n, seed)
    return build_code(split, n, seed)


def record_split(name: str, record: dict) -> str:
    """The split a record of task ``name`` belongs to, whichever builder produced it."""
    if name == "sql":
        return split_of("sql", sql_key(record))
    if name == "text":
        return split_of("text", text_key(record))
    if name == "code":
        return "test" if package_of(record["module"]) in code_test_packages() else "train"
    raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")


def to_example(name: str, record: dict) -> ChatExample:
    """The chat example a task record trains on (and evaluators prompt with)."""
    if name == "sql":
        return sql_example(record["context"], record["question"], record["answer"])
    if name == "code":
        return user_example(record["prompt"], record["completion"])
    if name == "text":
        return user_example(
            f"Write one sentence describing this restaurant: {record['mr']}", record["ref"]
        )
    raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")


def reference(name: str, record: dict) -> str:
    """The gold completion of a task record."""
    return to_example(name, record).completion
