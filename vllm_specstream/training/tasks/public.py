"""Loaders for the public task formats (docs/training.md, "Tasks"): sql-create-context/Spider, E2E, DialogSum.

A file is read as rows (CSV by its ``.csv`` suffix, else a JSON list or JSONL, told apart by
the first character), then each task turns rows into :class:`TaskRecord` s: one prompt with
every reference it has. E2E has one row per reference, so the rows of one meaning
representation become one record; the other tasks have one record per row.

The stdlib ``csv``/``json`` readers are used rather than Hugging Face ``datasets``: errors here
name the file, line and field, the strings are kept verbatim (``datasets``' CSV loader turns
cells such as ``None`` or ``NA`` into nulls) and nothing is cached on disk.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_specstream.training.data import (
    ChatExample,
    DataError,
    jsonl_records,
    sql_example,
    user_example,
)
from vllm_specstream.training.tasks._split import normalise_key

#: Tasks with a public data format; ``--task`` also offers the synthetic ``code`` and ``text``.
PUBLIC_TASKS = ("sql", "e2e", "dialogsum")
E2E_INSTRUCTION = "Describe this restaurant in one or two sentences."
DIALOGSUM_INSTRUCTION = "Summarize this dialogue."
#: Multi-reference DialogSum test files name their references ``summary1``, ``summary2``, ...
MAX_SUMMARIES = 9


@dataclass(frozen=True)
class TaskRecord:
    """One prompt of a public task with every reference it has (E2E: all rows of one MR)."""

    task: str
    """``sql``, ``e2e`` or ``dialogsum``."""
    prompt: str
    """The user message, in the format (docs/training.md) of ``task``."""
    references: tuple[str, ...]
    """Gold replies: one for SQL and DialogSum train files, several for E2E and test files."""
    group: str
    """What the validation split keeps on one side: ``db_id`` (else the schema) for SQL, the
    MR for E2E, the dialogue for DialogSum; whitespace- and case-normalised."""
    where: str
    """``file:line`` of the record's first row, for messages."""
    rows: tuple[dict, ...]
    """The rows it was read from, verbatim (split files are written back from them)."""

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    def examples(self) -> list[ChatExample]:
        """One training example per reference."""
        return [user_example(self.prompt, ref) for ref in self.references]


# --------------------------------------------------------------------------- reading rows


def _json_list_items(text: str, path: Path) -> Iterator[tuple[int, Any]]:
    """``(line, item)`` of each element of a top-level JSON list, with the line it starts on."""
    decoder = json.JSONDecoder()

    def skip_space(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    def fail(pos: int, msg: str) -> DataError:
        line = text.count("\n", 0, pos) + 1
        return DataError(f"{path}:{line}: invalid JSON: {msg}")

    pos = skip_space(text.index("[") + 1)
    if pos < len(text) and text[pos] == "]":
        return
    while True:
        try:
            item, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise fail(e.pos, f"{e.msg} (column {e.colno})") from None
        yield text.count("\n", 0, pos) + 1, item
        pos = skip_space(end)
        if pos >= len(text):
            raise fail(pos, "the list is not closed with ']'")
        if text[pos] == "]":
            return
        if text[pos] != ",":
            raise fail(pos, "expected ',' or ']' after a list item")
        pos = skip_space(pos + 1)


def read_rows(path: str | Path) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` of every record of a CSV, JSON-list or JSONL file; ``where`` is
    ``file:line`` (the line a JSON record starts on, the line a CSV row ends on)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; give the path of the task's data file")
    try:
        yield from _rows(path)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); give the task's data file "
            "in its public format (CSV, JSON list or JSONL)"
        ) from None


def _rows(path: Path) -> Iterator[tuple[str, dict]]:
    if path.suffix.lower() == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if None in row:  # DictReader's key for cells beyond the header
                    raise DataError(f"{where}: more cells than the header's columns")
                if any(row.values()):  # skip blank lines
                    yield where, row
        return
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        for line, item in _json_list_items(text, path):
            yield _checked_object(item, f"{path}:{line}")
        return
    for where, item in jsonl_records(path, text):
        yield _checked_object(item, where)


def _checked_object(item: Any, where: str) -> tuple[str, dict]:
    if not isinstance(item, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(item).__name__}")
    return where, item


def _text(row: dict, field: str, where: str, *, required: bool = True) -> str:
    """Field ``field`` of ``row``, stripped; must be a non-empty string when ``required``."""
    value = row.get(field)
    if value is None:
        if required:
            hint = (
                "; a generic chat record: `specstream train --data` reads those without --task"
                if "messages" in row or "prompt" in row
                else ""
            )
            raise DataError(f"{where}: missing field {field!r} (fields: {', '.join(row)}){hint}")
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise DataError(f"{where}: empty field {field!r}")
    return value.strip()


# --------------------------------------------------------------------------- tasks


def sql_prompt(context: str, question: str) -> str:
    """The schema, then the question (data.py's format, shared with the generic JSONL loader)."""
    return sql_example(context, question, "").messages[0]["content"]


def e2e_prompt(mr: str) -> str:
    """The instruction, then the meaning representation as the file writes it."""
    return f"{E2E_INSTRUCTION}\n{mr}"


def dialogsum_prompt(dialogue: str) -> str:
    """The instruction, then the dialogue (``#Person1#: ...`` turns, one per line)."""
    return f"{DIALOGSUM_INSTRUCTION}\n{dialogue}"


def _sql_records(rows: Iterator[tuple[str, dict]]) -> list[TaskRecord]:
    records = []
    for where, row in rows:
        context = _text(row, "context", where)
        question = _text(row, "question", where)
        answer = _text(row, "answer", where)
        db_id = _text(row, "db_id", where, required=False)
        prompt = sql_prompt(context, question)
        group = normalise_key(db_id or context)
        records.append(TaskRecord("sql", prompt, (answer,), group, where, (row,)))
    return records


def _e2e_records(rows: Iterator[tuple[str, dict]]) -> list[TaskRecord]:
    by_mr: dict[str, list[tuple[str, dict, str, str]]] = {}
    for where, row in rows:
        mr, ref = _text(row, "mr", where), _text(row, "ref", where)
        by_mr.setdefault(normalise_key(mr), []).append((where, row, mr, ref))
    return [
        TaskRecord(
            "e2e",
            e2e_prompt(group[0][2]),
            tuple(ref for *_, ref in group),
            key,
            group[0][0],
            tuple(row for _, row, *_ in group),
        )
        for key, group in by_mr.items()
    ]


def _summaries(row: dict, where: str) -> tuple[str, ...]:
    fields = ("summary", *(f"summary{i}" for i in range(1, MAX_SUMMARIES + 1)))
    present = [f for f in fields if row.get(f) is not None]
    if not present:
        raise DataError(
            f"{where}: missing field 'summary' (or 'summary1', 'summary2', ... in "
            f"multi-reference files; fields: {', '.join(row)})"
        )
    return tuple(_text(row, f, where) for f in present)


def _dialogsum_records(rows: Iterator[tuple[str, dict]]) -> list[TaskRecord]:
    records = []
    for where, row in rows:
        dialogue = _text(row, "dialogue", where)
        records.append(
            TaskRecord(
                "dialogsum",
                dialogsum_prompt(dialogue),
                _summaries(row, where),
                normalise_key(dialogue),
                where,
                (row,),
            )
        )
    return records


_LOADERS = {"sql": _sql_records, "e2e": _e2e_records, "dialogsum": _dialogsum_records}


def load_task_data(task: str, path: str | Path) -> list[TaskRecord]:
    """Every record of a ``task`` file, in file order (E2E: one record per MR, in the order of
    each MR's first row).

    * ``sql``: JSON list or JSONL of ``context``, ``question``, ``answer`` (optional ``db_id``);
    * ``e2e``: CSV (or JSON/JSONL) with ``mr``, ``ref``, one row per reference;
    * ``dialogsum``: JSONL (or JSON/CSV) with ``dialogue`` and ``summary``, or
      ``summary1``, ``summary2``, ... for multi-reference files.
    """
    if task not in _LOADERS:
        raise DataError(f"unknown task {task!r} for --data; valid: {', '.join(PUBLIC_TASKS)}")
    records = _LOADERS[task](read_rows(path))
    if not records:
        raise DataError(
            f'{path}: no records; give the task\'s data file (docs/training.md, "Tasks")'
        )
    return records


# --------------------------------------------------------------------------- writing


def write_task_data(records: list[TaskRecord], path: str | Path) -> Path:
    """Write the rows of ``records`` verbatim: CSV for a ``.csv`` path, a JSON list for
    ``.json``, else JSONL."""
    path = Path(path)
    rows = [row for record in records for row in record.rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        columns = list(dict.fromkeys(key for row in rows for key in row))
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
    elif suffix == ".json":
        path.write_text(json.dumps(rows, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    else:
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        path.write_text(lines, encoding="utf-8")
    return path
