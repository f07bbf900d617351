"""Writing without losing what was there: every file and directory a command writes is
written beside its target under a name of its own and renamed into place, so a crash, a full
disk or Ctrl-C leaves the previous version whole, and nothing is removed that the command did
not write itself."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


def _beside(target: Path, suffix: str) -> Path:
    """A name in ``target``'s directory that nothing holds (hidden, unique)."""
    return target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.{suffix}")


def remove_partial(target: Path) -> None:
    """Remove what an interrupted write to ``target`` left beside it (names of
    :func:`_beside`'s pattern only: nothing else is ever removed)."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.[0-9a-f]{{12}}\.partial")
    if target.parent.is_dir():
        for path in target.parent.iterdir():
            if pattern.fullmatch(path.name):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


def write_file(target: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(path)`` on a fresh path beside ``target``, then rename it onto ``target``."""
    target = Path(target)
    tmp = _beside(target, "partial")
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def write_text(target: str | Path, text: str) -> Path:
    return write_file(target, lambda p: p.write_text(text))


@contextlib.contextmanager
def new_dir(target: str | Path) -> Iterator[Path]:
    """A fresh directory beside ``target`` to write into. When the block ends without an
    error it replaces ``target`` (see :func:`replace_dir`); on an error it is removed and
    ``target`` stays as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_partial(target)
    tmp = _beside(target, "partial")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, target)


@contextlib.contextmanager
def files_into(target: str | Path) -> Iterator[Path]:
    """A fresh directory beside ``target`` to write files into. When the block ends without
    an error each file is renamed into ``target`` (each replacing its earlier version whole;
    what else ``target`` holds stays); on an error they are removed and ``target`` is as it
    was."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    tmp = _beside(target, "partial")
    tmp.mkdir()
    try:
        yield tmp
        for path in sorted(tmp.iterdir()):
            os.replace(path, target / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(src: Path, target: Path) -> None:
    """Rename ``src`` onto ``target``. A ``target`` that exists (the caller has checked that
    it holds only what an earlier run of the same command wrote) is moved aside first and
    removed only once ``src`` stands in its place."""
    if not target.exists():
        src.replace(target)
        return
    old = _beside(target, "old")
    target.replace(old)
    try:
        src.replace(target)
    except BaseException:
        old.replace(target)
        raise
    shutil.rmtree(old)
