"""Fine-tuning tasks: the public formats (SQL, E2E, DialogSum) and synthetic builders: public API."""

from __future__ import annotations

from vllm_specstream.training.data import ChatExample, DataError, sql_example, user_example
from vllm_specstream.training.metrics import normalize_sql, rouge_l, sql_exact_match
from vllm_specstream.training.tasks._split import split_of
from vllm_specstream.training.tasks.code import (
    build_code,
    code_test_packages,
    package_of,
    stdlib_files,
)
from vllm_specstream.training.tasks.holdout import (
    DATA_SPLITS,
    DEFAULT_VAL_FRACTION,
    select_split,
    split_by_group,
    write_split,
)
from vllm_specstream.training.tasks.public import (
    PUBLIC_TASKS,
    TaskRecord,
    load_task_data,
    sql_prompt,
    write_task_data,
)
from vllm_specstream.training.tasks.sql import build_sql, sql_key
from vllm_specstream.training.tasks.sql_rename import DEFAULT_RENAME_RATE
from vllm_specstream.training.tasks.text import build_text, text_key

__all__ = [
    "ALL_TASKS",
    "DATA_SPLITS",
    "DEFAULT_N",
    "DEFAULT_VAL_FRACTION",
    "PUBLIC_TASKS",
    "SPLITS",
    "TASKS",
    "TaskRecord",
    "build_task",
    "code_test_packages",
    "normalize_sql",
    "record_split",
    "reference",
    "load_task_data",
    "rouge_l",
    "select_split",
    "split_by_group",
    "split_of",
    "sql_exact_match",
    "stdlib_files",
    "task_examples",
    "to_example",
    "write_split",
    "write_task_data",
]

#: Tasks with a synthetic builder (``build_task``); ``sql`` also has a public format.
TASKS = ("sql", "code", "text")
#: ``--task`` choices: the public formats (``--data FILE``) and the synthetic builders.
ALL_TASKS = (*PUBLIC_TASKS, *(t for t in TASKS if t not in PUBLIC_TASKS))
SPLITS = ("train", "test")
DEFAULT_N = {"sql": (2000, 300), "code": (2000, 200), "text": (2000, 300)}


def build_task(name: str, split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """``n`` records of task ``name`` for ``split`` (``train`` or ``test``), deterministic."""
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if n is None:
        n = DEFAULT_N[name][SPLITS.index(split)]
    if n < 0:
        raise DataError(f"n must be >= 0, got {n}")
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
    raise DataError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")


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
    raise DataError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")


def reference(name: str, record: dict) -> str:
    """The gold completion of a task record."""
    return to_example(name, record).completion


def task_examples(
    task: str | None,
    split: str,
    n: int | None = None,
    *,
    data: str | None = None,
    eval_data: str | None = None,
    seed: int = 0,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    split_seed: int = 0,
    sql_rename_copies: int = 0,
    sql_rename_rate: float = DEFAULT_RENAME_RATE,
) -> list[ChatExample]:
    """Training (``split="train"``) or held-out (``"test"``) examples, first ``n`` (all if
    ``n`` is falsy), as ``specstream train`` reads them.

    A public ``task`` with ``data`` reads that file in its format: training gets one example
    per reference of the records :func:`split_by_group` leaves for training; held out is
    ``eval_data`` (same format) or else the validation part, one example per record (its
    first reference) so that a few dozen examples still cover as many records. Otherwise
    ``data``/``eval_data`` are generic JSONL (:func:`~vllm_specstream.training.data.load_jsonl`)
    and without ``data`` the synthetic builder of ``task`` generates both splits.
    ``sql_rename_copies`` adds that many schema-renamed copies of each SQL training record
    (:func:`renamed_sql_examples`).
    """
    from vllm_specstream.training.data import load_jsonl

    if data and task in PUBLIC_TASKS:
        if split == "train":
            records = select_split(load_task_data(task, data), "train", val_fraction, split_seed)
            examples = [e for r in records for e in r.examples()]
            if task == "sql" and sql_rename_copies:
                examples += renamed_sql_examples(records, sql_rename_copies, sql_rename_rate, seed)
        else:
            if eval_data:
                records = load_task_data(task, eval_data)
            else:
                _, records = split_by_group(load_task_data(task, data), val_fraction, split_seed)
            examples = [r.examples()[0] for r in records]
        return examples[:n] if n else examples
    path = data if split == "train" else eval_data
    if path:
        return load_jsonl(path)[:n] if n else load_jsonl(path)
    if data and split == "test":
        return []
    task = task or "sql"
    if task not in TASKS:
        raise DataError(
            f"--task {task} needs --data FILE (its public format; see docs/training.md)"
        )
    return [to_example(task, r) for r in build_task(task, split, n=n, seed=seed)]


def renamed_sql_examples(
    records: list[TaskRecord], copies: int, rate: float, seed: int = 0
) -> list[ChatExample]:
    """``copies`` schema-renamed versions of each SQL record (``rate``: share of word parts
    renamed; :mod:`~vllm_specstream.training.tasks.sql_rename`), new names drawn from the
    records' own schemas and the synthetic generator's domain words."""
    import random

    from vllm_specstream.training.tasks.sql_rename import entity_words, pool_words, rename_schema

    rows = [row for r in records for row in r.rows]
    pool = sorted(set(pool_words(row["context"] for row in rows)) | set(entity_words()))
    rng = random.Random(seed)
    out = []
    for _ in range(copies):
        for row in rows:
            context, question, answer = rename_schema(
                row["context"].strip(),
                row["question"].strip(),
                row["answer"].strip(),
                pool,
                rng,
                rate,
            )
            out.append(user_example(sql_prompt(context, question), answer))
    return out
