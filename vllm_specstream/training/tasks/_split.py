"""Split assignment shared by the task builders: stable hashing, key normalisation, drawing."""

# Every builder is deterministic given ``(split, seed)`` and its splits cannot leak: an item's
# split is a stable hash of what identifies it (the SQL schema + question, the Python module,
# the meaning representation), and each split is drawn from its own RNG stream.

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

#: Share of the item space that belongs to the test split (per-mille of the hash range;
#: for code, of the stdlib source bytes).
TEST_PER_MILLE = {"sql": 150, "code": 100, "text": 150}
#: Give up when this many candidates in a row are rejected (split or duplicate).
MAX_REJECTS = 20_000


def stable_hash(text: str) -> int:
    """A process-independent hash (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def split_of(task: str, key: str) -> str:
    """The split an item with identity ``key`` belongs to."""
    return "test" if stable_hash(f"{task}\0{key}") % 1000 < TEST_PER_MILLE[task] else "train"


def normalise_key(*parts: str) -> str:
    return "\n".join(" ".join(p.lower().split()) for p in parts)


def draw(
    task: str,
    split: str,
    n: int,
    seed: int,
    make: Callable[[random.Random], dict],
    key: Callable[[dict], str],
) -> list[dict]:
    """Draw ``n`` distinct records of ``split`` from that split's own RNG stream."""
    rng = random.Random(f"{task}:{split}:{seed}")
    records, seen, rejects = [], set(), 0
    while len(records) < n:
        record = make(rng)
        k = key(record)
        if k in seen or split_of(task, k) != split:
            rejects += 1
            if rejects > MAX_REJECTS:
                raise RuntimeError(f"{task}/{split}: only {len(records)} of {n} distinct records")
            continue
        rejects = 0
        seen.add(k)
        records.append(record)
    return records
