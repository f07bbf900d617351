"""Python-continuation task: prompt/completion windows over stdlib modules, split by package."""

from __future__ import annotations

import os
import random
import sysconfig
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from vllm_specstream.training.tasks._split import TEST_PER_MILLE, stable_hash

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
PROMPT_LINES = (20, 40)
COMPLETION_LINES = (8, 16)
LINES_PER_WINDOW = 50
MAX_WINDOWS_PER_FILE = 12
MAX_LINE_CHARS = 160


@lru_cache(maxsize=4)
def stdlib_files(root: Path | None = None) -> tuple[tuple[str, Path], ...]:
    """``(module, path)`` for every stdlib ``.py`` file outside tests/idlelib, sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for filename in sorted(filenames):
            if filename.endswith(".py"):
                path = Path(dirpath, filename)
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                if parts:
                    found.append((".".join(parts), path))
    return tuple(sorted(found))


def package_of(module: str) -> str:
    return module.split(".")[0]


@lru_cache(maxsize=4)
def code_test_packages(root: Path | None = None) -> frozenset[str]:
    """Top-level packages held out for test: taken in stable-hash order until they hold ~10%
    of the source bytes. Whole packages, so sibling files (e.g. near-identical codecs) never
    straddle the splits; by bytes, so one lucky draw of tiny modules cannot starve test."""
    sizes: dict[str, int] = {}
    for module, path in stdlib_files(root):
        sizes[package_of(module)] = sizes.get(package_of(module), 0) + path.stat().st_size
    budget = sum(sizes.values()) * TEST_PER_MILLE["code"] / 1000
    held: set[str] = set()
    for package in sorted(sizes, key=lambda p: (stable_hash(f"code\0{p}"), p)):
        if budget <= 0:
            break
        held.add(package)
        budget -= sizes[package]
    return frozenset(held)


def _code_windows(module: str, lines: list[str], rng: random.Random) -> Iterator[dict]:
    """Random prompt/continuation windows of one file, more for longer files."""
    wanted = min(MAX_WINDOWS_PER_FILE, max(1, len(lines) // LINES_PER_WINDOW))
    starts: set[int] = set()
    for _ in range(wanted * 3):  # a few tries: some windows are mostly blank
        if len(starts) >= wanted:
            return
        p, c = rng.randint(*PROMPT_LINES), rng.randint(*COMPLETION_LINES)
        if len(lines) < p + c:
            return
        start = rng.randrange(len(lines) - p - c + 1)
        prompt, completion = lines[start : start + p], lines[start + p : start + p + c]
        if (
            start in starts
            or sum(bool(x.strip()) for x in completion) < 3
            or sum(bool(x.strip()) for x in prompt) < 8
            or max(map(len, prompt + completion)) > MAX_LINE_CHARS
        ):
            continue
        starts.add(start)
        body = "\n".join(prompt)
        yield {
            "module": module,
            "prompt": f"Continue this Python code:\n```python\n{body}\n```",
            "completion": "\n".join(completion),
        }


def build_code(split: str, n: int, seed: int, root: Path | None = None) -> list[dict]:
    """Up to ``n`` continuation windows from this split's stdlib modules (bounded: stops at n)."""
    held_out = code_test_packages(root)
    files = [
        (module, path)
        for module, path in stdlib_files(root)
        if (package_of(module) in held_out) == (split == "test")
    ]
    rng = random.Random(f"code:{split}:{seed}")
    rng.shuffle(files)
    records: list[dict] = []
    for module, path in files:
        if len(records) >= n:
            break
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        records.extend(_code_windows(module, lines, rng))
    return records[:n]
