"""Task metrics (docs/training.md, "Tasks"): SQL exact match, ROUGE-1/ROUGE-Lsum, and the synthetic tasks'
ROUGE-L; every one scores a prediction against its best reference.

``sqlglot`` and ``rouge-score`` (the ``train`` extra) are imported when first used.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from functools import lru_cache

#: ROUGE variants of the paper's E2E and DialogSum columns (rouge-score's names).
ROUGE_TYPES = ("rouge1", "rougeLsum")


def normalize_sql(s: str) -> str:
    """Canonical SQL text for exact match: lowercase, one space, no trailing ``;``, ``"`` quotes."""
    s = " ".join(s.replace("'", '"').lower().split())
    s = re.sub(r"\s*([(),])\s*", r"\1", s)  # "COUNT( * )" == "COUNT(*)", "a ,b" == "a,b"
    return s.rstrip("; ").strip()


@lru_cache(maxsize=65536)
def canonical_sql(s: str) -> str | None:
    """SQL as sqlglot (SQLite dialect) writes it back, then :func:`normalize_sql`; None when
    it is not exactly one statement sqlglot can parse.

    Rewriting equates spellings of the same query (``t T1`` / ``t AS T1``, ``!=`` / ``<>``,
    spacing inside expressions); clauses are never reordered.
    """
    import sqlglot

    try:
        statements = [e for e in sqlglot.parse(s, read="sqlite") if e is not None]
        if len(statements) != 1:
            return None
        return normalize_sql(statements[0].sql(dialect="sqlite", normalize=True))
    except Exception:  # sqlglot raises several error types (and can recurse deeply)
        return None


def sql_exact_match(pred: str, gold: str) -> bool:
    """Whether two queries are equal after whitespace, case and quote normalisation: their
    :func:`normalize_sql` texts are equal, or both parse and their :func:`canonical_sql`
    are equal (text normalisation alone decides when either does not parse)."""
    if normalize_sql(pred) == normalize_sql(gold):
        return True
    canonical = canonical_sql(pred)
    return canonical is not None and canonical == canonical_sql(gold)


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


# --------------------------------------------------------------------------- ROUGE (rouge-score)


def split_sentences(text: str) -> str:
    """One sentence per line, for ROUGE-Lsum: a break after ``.``, ``!`` or ``?`` followed by
    whitespace, and at existing line breaks."""
    sentences = re.split(r"(?<=[.!?])\s+|\n+", text.strip())
    return "\n".join(s for s in sentences if s.strip())


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def rouge_scores(prediction: str, references: Sequence[str]) -> dict[str, float]:
    """ROUGE-1 and ROUGE-Lsum F-measures in [0, 1] (rouge-score, Porter stemmer), each the
    best over ``references`` (per metric, as rouge-score's ``score_multi``)."""
    if not references:
        raise ValueError("rouge_scores needs at least one reference")
    scorer = _rouge_scorer()
    pred = split_sentences(prediction)
    best = dict.fromkeys(ROUGE_TYPES, 0.0)
    for ref in references:
        scores = scorer.score(split_sentences(ref), pred)
        for key in ROUGE_TYPES:
            best[key] = max(best[key], scores[key].fmeasure)
    return best


# --------------------------------------------------------------------------- per task


def task_metrics(
    task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]
) -> dict[str, float]:
    """The metrics (docs/training.md) of ``task``, in percent, averaged over cases; each case
    scores its prediction against its best reference.

    ``sql``: ``exact_match`` (:func:`sql_exact_match` with any reference); ``e2e`` and
    ``dialogsum``: ``rouge1`` and ``rougeLsum`` (:func:`rouge_scores`); the synthetic
    ``code`` and ``text`` tasks: ``rouge_l`` (:func:`rouge_l`).
    """
    if len(predictions) != len(references) or not predictions:
        raise ValueError(
            f"need one reference list per prediction, got {len(predictions)} predictions and "
            f"{len(references)} reference lists"
        )
    if task == "sql":
        hits = [
            any(sql_exact_match(p, r) for r in refs) for p, refs in zip(predictions, references)
        ]
        return {"exact_match": 100.0 * statistics.fmean(hits)}
    if task in ("e2e", "dialogsum"):
        per_case = [rouge_scores(p, refs) for p, refs in zip(predictions, references)]
        return {k: 100.0 * statistics.fmean(c[k] for c in per_case) for k in ROUGE_TYPES}
    return {
        "rouge_l": 100.0
        * statistics.fmean(
            max(rouge_l(p, r) for r in refs) for p, refs in zip(predictions, references)
        )
    }
