"""Task metrics in pure Python: normalised SQL exact match and ROUGE-L."""

from __future__ import annotations

import re


def normalize_sql(s: str) -> str:
    """Canonical SQL text for exact match: lowercase, one space, no trailing ``;``, ``"`` quotes."""
    s = " ".join(s.replace("'", '"').lower().split())
    s = re.sub(r"\s*([(),])\s*", r"\1", s)  # "COUNT( * )" == "COUNT(*)", "a ,b" == "a,b"
    return s.rstrip("; ").strip()


def sql_exact_match(pred: str, gold: str) -> bool:
    """Whether two queries are equal after :func:`normalize_sql`."""
    return normalize_sql(pred) == normalize_sql(gold)


def _rouge_tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F-measure (beta = 1) over lowercased word tokens (punctuation dropped)."""
    p, r = _rouge_tokens(pred), _rouge_tokens(ref)
    if not p or not r:
        return float(p == r)
    # LCS by dynamic programming, one row at a time.
    prev = [0] * (len(r) + 1)
    for x in p:
        cur = [0]
        for j, y in enumerate(r):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return 2 * precision * recall / (precision + recall)
