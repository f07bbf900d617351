"""A validation split cut by group, so that no database, MR or dialogue is on both sides."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from vllm_specstream.training.data import DataError
from vllm_specstream.training.tasks._split import stable_hash
from vllm_specstream.training.tasks.public import load_task_data, write_task_data

T = TypeVar("T")

#: ``--split`` choices: the whole file, or one side of :func:`split_by_group`.
DATA_SPLITS = ("all", "train", "val")
#: Share of a file's records held out by default (``--val-fraction``); train and eval/bench
#: share it, so ``--split val`` is the part training left out unless told otherwise.
DEFAULT_VAL_FRACTION = 0.15


def split_by_group(
    records: Sequence[T],
    val_fraction: float,
    seed: int = 0,
    group: Callable[[T], str] = lambda r: r.group,  # type: ignore[attr-defined]
) -> tuple[list[T], list[T]]:
    """``(train, val)``: whole groups go to ``val`` until it holds about ``val_fraction`` of
    the records; both keep file order.

    Groups are visited in the order of a stable hash of ``(seed, group)``, so the split
    depends on the seed and the groups only (not on file order or the process), and a
    group's side rarely changes when other groups are added. A group is taken while it
    brings the validation size closer to the target; at least one group is held out when
    ``val_fraction > 0``, and one group always stays for training.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0.0 or not records:
        return list(records), []
    sizes: dict[str, int] = {}
    for r in records:
        sizes[group(r)] = sizes.get(group(r), 0) + 1
    if len(sizes) < 2:
        raise DataError(
            f"cannot hold out {val_fraction:.0%} by group: all {len(records)} records share "
            "one group"
        )
    target = val_fraction * len(records)
    held: set[str] = set()
    held_size = 0
    for g in sorted(sizes, key=lambda g: (stable_hash(f"{seed}\0{g}"), g)):
        # Taking g moves the size closer to the target iff held_size + size / 2 < target.
        if len(held) < len(sizes) - 1 and (not held or held_size + sizes[g] / 2 < target):
            held.add(g)
            held_size += sizes[g]
    train = [r for r in records if group(r) not in held]
    val = [r for r in records if group(r) in held]
    return train, val


def select_split(records: Sequence[T], split: str, val_fraction: float, seed: int = 0) -> list[T]:
    """The records of ``split`` (``all``, ``train`` or ``val``) of :func:`split_by_group`."""
    if split not in DATA_SPLITS:
        raise DataError(f"unknown split {split!r}; valid splits: {', '.join(DATA_SPLITS)}")
    if split == "all":
        return list(records)
    train, val = split_by_group(records, val_fraction, seed)
    if split == "val" and not val:
        raise DataError("--split val is empty: give a --val-fraction above 0")
    return train if split == "train" else val


def write_split(
    task: str, path: str | Path, out_dir: str | Path, val_fraction: float, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``out_dir/train.EXT`` and ``out_dir/val.EXT`` in the format of ``path``."""
    train, val = split_by_group(load_task_data(task, path), val_fraction, seed)
    suffix = Path(path).suffix or ".jsonl"
    out_dir = Path(out_dir)
    return (
        write_task_data(train, out_dir / f"train{suffix}"),
        write_task_data(val, out_dir / f"val{suffix}"),
    )
