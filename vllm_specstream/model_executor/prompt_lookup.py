"""Prompt-lookup drafts beside the streams: the tokens that followed the request's last
n-gram where it occurred before in its prompt or output.

Summaries copy from the dialogue and SQL copies names from the schema: there a copied draft
costs no stream pass and is often kept. A request's lookup draft is priced by the acceptance
earlier lookup drafts had, per matched n-gram length and draft position (a running
:class:`~vllm_specstream.speculation.acceptance.AcceptanceStats` each); the proposer takes it
where it yields as many tokens per step cost as the streams, the rule suffix drafts follow
(:meth:`vllm_specstream.model_executor.proposer.SpecStreamProposer._copy_choice`).

The matcher is vLLM's own ``ngram`` method's (``_find_longest_matched_ngram_and_propose_tokens``
in ``vllm/v1/spec_decode/ngram_proposer.py``, numba-compiled, private): imported here only,
and ``tests/vllm/test_patches.py`` fails loudly when it moves or changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_specstream.speculation.acceptance import AcceptanceStats


def ngram_matcher():
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens,
    )

    return _find_longest_matched_ngram_and_propose_tokens


@dataclass(frozen=True)
class LookupSettings:
    """Which n-grams a lookup matches (the ``prompt_lookup_min``/``_max`` of vLLM's ``ngram``
    method as ``specstream bench`` runs it)."""

    min_ngram: int = 2
    max_ngram: int = 4
    prior_rate: float = 0.7
    """Conditional acceptance assumed per draft position before evidence: with it a lookup of
    4 drafts expects 1.8 kept, enough to be tried where the streams do not pay."""
    unused_decay: float = 0.995
    """Evidence kept per step in which a match of that length was found but not drafted, so
    that a length that stopped paying is tried again after some hundred steps."""


@dataclass(frozen=True)
class LookupDraft:
    tokens: list[int]
    score: float
    """Expected accepted drafts: the sum of the positions' running acceptance."""
    ngram: int
    """Length of the matched n-gram (0: no match)."""


NO_DRAFT = LookupDraft([], 0.0, 0)


class PromptLookup:
    """Lookup drafts of one engine and the acceptance they had, per matched n-gram length."""

    def __init__(self, k: int, max_model_len: int, settings: LookupSettings | None = None):
        self.settings = settings = settings or LookupSettings()
        self.max_model_len = max_model_len
        self._match = ngram_matcher()
        self.stats = {
            n: AcceptanceStats(k, prior_rate=settings.prior_rate)
            for n in range(settings.min_ngram, settings.max_ngram + 1)
        }

    def drafts(
        self,
        token_ids: np.ndarray,
        num_tokens: Sequence[int],
        rows: Sequence[int],
        k: int,
        min_score: float = 0.0,
    ) -> dict[int, LookupDraft]:
        """Per row of ``rows``: up to ``k`` tokens continuing ``token_ids[row, :num_tokens[row]]``,
        those after the first occurrence of its longest last n-gram that occurred before.
        Empty where no lookup of ``k`` could score ``min_score`` (no row is matched; the
        evidence of every length then fades, as that of a length not taken)."""
        s = self.settings
        rates = {n: stats.accept_rates() for n, stats in self.stats.items()}
        if max(float(r[:k].sum()) for r in rates.values()) < min_score:
            for stats in self.stats.values():
                stats.forget(s.unused_decay)
            return {}
        out: dict[int, LookupDraft] = {}
        lo, hi = s.min_ngram, s.max_ngram
        for r in rows:
            context = token_ids[r, : int(num_tokens[r])]
            # One call finds whether any n-gram matches (most rows: none); then the longest.
            tokens = self._match(context, lo, hi, self.max_model_len, k)
            n = lo
            for longer in range(hi, lo, -1) if len(tokens) else ():
                found = self._match(context, longer, longer, self.max_model_len, k)
                if len(found):
                    tokens, n = found, longer
                    break
            out[r] = (
                LookupDraft(tokens.tolist(), float(rates[n][: len(tokens)].sum()), n)
                if len(tokens)
                else NO_DRAFT
            )
        return out

    def proposed(self, drafts: dict[int, LookupDraft], taken: Sequence[int], num_rows: int):
        """This step's lookup drafts (per row) and the rows that took them: each length's
        estimate awaits the drafts taken; a length matched but not taken fades."""
        for n, stats in self.stats.items():
            rows = [r for r in taken if drafts[r].ngram == n]
            per_row: list[list[int]] = [[] for _ in range(num_rows)]
            for r in rows:
                per_row[r] = drafts[r].tokens
            stats.record_proposed(per_row)
            if not rows and any(d.ngram == n for d in drafts.values()):
                stats.forget(self.settings.unused_decay)

    def verified(self, ngrams: dict[int, int], sampled_token_ids: Sequence[Sequence[int]]):
        """The tokens sampled for the rows whose last drafts were lookups (``ngrams``: row
        -> the matched length those drafts had)."""
        for n, stats in self.stats.items():
            stats.record_verified(
                [s if ngrams.get(r) == n else [] for r, s in enumerate(sampled_token_ids)]
            )
