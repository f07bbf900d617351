"""``CopiedDrafts``: drafts copied from the request's own tokens, beside the streams.

Two sources: prompt lookup (:mod:`vllm_specstream.model_executor.prompt_lookup`: the tokens
that followed the request's last n-gram earlier in its prompt or output; field
``prompt_lookup``) and the suffix trees (:mod:`vllm_specstream.speculation.suffix_drafts`:
over the prompt, the output and earlier outputs; field ``suffix_drafts``). Each scores its
draft by the tokens it expects kept; a row takes the better of the two where that score
reaches the proposer's threshold (the price of the step it replaces). Copied drafts are
followed by request id, which the model runner's input batch holds: the runner hands itself
over (:mod:`vllm_specstream.patches.proposer_runner`).
"""

from __future__ import annotations

import math
import weakref

from vllm_specstream.logger import init_logger
from vllm_specstream.model_executor.prompt_lookup import PromptLookup
from vllm_specstream.speculation.suffix_drafts import SuffixDrafts, suffix_rows

logger = init_logger(__name__)


class CopiedDrafts:
    """Prompt-lookup and suffix-tree drafts of one engine (either may be None: off).
    ``suffix_min_score`` is field ``suffix_drafts``' fixed threshold (nan: the proposer's)."""

    def __init__(
        self,
        prompt_lookup: PromptLookup | None,
        suffix: SuffixDrafts | None,
        suffix_min_score: float | None,
    ):
        self.prompt_lookup = prompt_lookup
        self.suffix = suffix
        self.suffix_min_score = suffix_min_score
        #: The model runner (its input batch's request ids follow copied drafts and key the
        #: suffix trees).
        self._runner = None
        #: Requests whose last drafts were copied: the matched n-gram length of a lookup, 0
        #: for the suffix trees' (left out of the streams' acceptance estimate when verified).
        self.copied: dict[str, int] = {}
        #: Requests' drafts taken from the suffix trees, and from prompt lookup.
        self.suffix_drafted = 0
        self.lookup_drafted = 0

    @property
    def active(self) -> bool:
        return self.suffix is not None or self.prompt_lookup is not None

    def bind_runner(self, runner) -> None:
        self._runner = weakref.ref(runner)

    def req_ids(self, sampled_token_ids, token_ids_cpu) -> list[str]:
        """The batch's request ids ([] with neither source); the suffix trees grow by this
        step's sampled tokens."""
        if not self.active:
            return []
        runner = self._runner() if self._runner is not None else None
        if runner is None:
            self.suffix = self.prompt_lookup = None
            logger.warning(
                "specstream: the model runner was not handed to the proposer (patch "
                "proposer-runner not applied in this process), so the streams draft alone"
            )
            return []
        batch = runner.input_batch
        n = len(sampled_token_ids)
        req_ids = list(batch.req_ids[:n])
        if self.suffix is not None:
            self.suffix.update(
                req_ids, batch.num_prompt_tokens[:n], token_ids_cpu, sampled_token_ids
            )
        return req_ids

    def verified(self, req_ids: list[str], sampled_token_ids) -> dict[int, int]:
        """Rows whose last drafts were copied (row -> n-gram length, 0: suffix trees), their
        verified tokens filed with prompt lookup's estimate."""
        copied = {r: self.copied[q] for r, q in enumerate(req_ids) if q in self.copied}
        if self.prompt_lookup is not None and copied:
            self.prompt_lookup.verified(copied, sampled_token_ids)
        return copied

    def choose(
        self, req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, length, min_score
    ) -> dict[int, list[int]]:
        """Rows that draft a copy this step, with their drafts of up to ``length`` tokens:
        per row the better scoring of its prompt-lookup and suffix-tree drafts, where it
        reaches ``min_score`` (the suffix drafts' own fixed threshold where field
        ``suffix_drafts`` is a number)."""
        n = len(sampled_token_ids)
        rows = [r for r, sampled in enumerate(sampled_token_ids) if sampled]
        chosen: dict[int, list[int]] = {}
        copied: dict[str, int] = {}
        lookups = {}
        if self.prompt_lookup is not None:
            lookups = self.prompt_lookup.drafts(
                token_ids_cpu, num_tokens_no_spec, rows, length, min_score
            )
            for r, d in lookups.items():
                if d.tokens and d.score >= min_score:
                    chosen[r], copied[req_ids[r]] = d.tokens, d.ngram
        if self.suffix is not None:
            fixed = self.suffix_min_score
            suffix_min = min_score if math.isnan(fixed) else fixed
            drafts = {
                r: self.suffix.draft(
                    req_ids[r], token_ids_cpu[r], int(num_tokens_no_spec[r]), length
                )
                for r in rows
            }
            for r, tokens in suffix_rows(drafts, suffix_min).items():
                if r not in chosen or drafts[r].score > lookups[r].score:
                    chosen[r], copied[req_ids[r]] = tokens, 0
            self._count("suffix_drafted", sum(1 for q in copied.values() if q == 0), n)
        if self.prompt_lookup is not None:
            taken = [r for r in chosen if copied[req_ids[r]] > 0]
            self.prompt_lookup.proposed(lookups, taken, n)
        self._count("lookup_drafted", sum(1 for q in copied.values() if q > 0), n)
        self.copied = copied
        return chosen

    def _count(self, counter: str, taken: int, batch_size: int) -> None:
        """Adds ``taken`` rows to ``counter``; the first such draft is said once."""
        if taken and not getattr(self, counter):
            source = "from the suffix trees" if counter == "suffix_drafted" else "by prompt lookup"
            logger.info("specstream drafts %s (first at batch %d)", source, batch_size)
        setattr(self, counter, getattr(self, counter) + taken)
