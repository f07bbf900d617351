"""Suffix decoding beside the streams: drafts copied from text the request has seen.

A task fine-tune's answers copy a lot: column names from the schema in the prompt, a speaker's
name from the dialogue, phrases of earlier answers. Suffix decoding (arXiv 2411.04975) drafts
those for free, by matching the request's last tokens in suffix trees over its prompt and
output and over earlier requests' outputs; the streams draft what is learnt, at the cost of a
stream pass. With the engine field ``suffix_drafts: on`` (:mod:`vllm_specstream.speculation.settings`) a request's step takes the suffix trees'
draft where its score (the sum of its tokens' estimated probabilities: expected accepted
tokens) makes the step yield as many tokens per cost as the streams are expected to (the
adaptive policy's expected tokens over its step cost; a step with suffix drafts only runs no
stream pass and is priced as such steps are timed in the engine, as a plain step until then),
and then skips the stream pass for that request; the streams draft for the others. A number
instead of ``on`` is a fixed score threshold.

The trees are arctic-inference's ``SuffixDecodingCache``, kept per request exactly as vLLM's
own ``suffix`` method keeps them (started from the prompt at a request's first step, grown by
its sampled tokens, stopped when it leaves the batch; finished requests' outputs stay in the
global tree), with the same ``suffix_decoding_*`` settings of vLLM's ``speculative_config``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from vllm_specstream.checkpoint.config import ConfigError

#: A fixed threshold's stand-in for the streams' expected accepted drafts where no adaptive
#: policy estimates them (the user's batch-size schedule).
SCHEDULED_MIN_SCORE = 1.0


#: Where ``make suffix-decoding`` (``scripts/suffix_decoding.sh``) installs arctic-inference's
#: suffix tree for this CPU (``$SPECSTREAM_SUFFIX_DECODING`` moves it).
SUFFIX_DECODING_DIR = Path(
    os.environ.get("SPECSTREAM_SUFFIX_DECODING", "~/.cache/vllm-specstream/suffix-decoding")
).expanduser()


def suffix_cache_class():
    """arctic-inference's ``SuffixDecodingCache`` (vLLM's ``suffix`` method imports it too):
    importable as installed, else from ``make suffix-decoding``'s build, whose directory is
    then appended to ``sys.path`` (it holds that package only)."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        built = SUFFIX_DECODING_DIR / "arctic_inference" / "suffix_decoding"
        if not built.is_dir() or str(SUFFIX_DECODING_DIR) in sys.path:
            raise ConfigError(
                "suffix drafts (field suffix_drafts) need arctic-inference's suffix decoding, "
                f"which is not importable ({e}) nor built in {SUFFIX_DECODING_DIR}; `make "
                "suffix-decoding` builds it for this CPU, or leave suffix_drafts out"
            ) from e
        sys.path.append(str(SUFFIX_DECODING_DIR))
        return suffix_cache_class()
    return SuffixDecodingCache


@dataclass(frozen=True)
class SuffixSettings:
    """How the suffix trees draft (vLLM's ``suffix_decoding_*`` fields, same defaults)."""

    max_tree_depth: int = 24
    """Longest match, and deepest draft, in the trees."""
    max_cached_requests: int = 10000
    """Finished requests whose outputs stay in the global tree."""
    max_spec_factor: float = 1.0
    """Draft at most this many tokens per matched token."""
    min_token_prob: float = 0.1
    """A draft stops at a token whose estimated probability is below this."""

    @classmethod
    def of(cls, spec) -> SuffixSettings:
        """The settings of vLLM's ``speculative_config`` ``spec`` (defaults where absent)."""
        base = cls()
        values = {}
        for f in fields(cls):
            default = getattr(base, f.name)
            values[f.name] = type(default)(getattr(spec, f"suffix_decoding_{f.name}", default))
        return cls(**values)


@dataclass(frozen=True)
class SuffixDraft:
    tokens: list[int]
    score: float
    """Sum of the tokens' estimated probabilities (0 without a draft)."""


def suffix_rows(drafts: dict[int, SuffixDraft], min_score: float) -> dict[int, list[int]]:
    """The rows whose suffix draft is taken (score at least ``min_score``, not empty)."""
    return {r: d.tokens for r, d in drafts.items() if d.tokens and d.score >= min_score}


class SuffixDrafts:
    """The suffix trees of one engine's requests (one per worker)."""

    def __init__(self, settings: SuffixSettings, max_model_len: int, cache=None):
        self.settings = settings
        self.max_model_len = max_model_len
        self.cache = (
            cache
            if cache is not None
            else suffix_cache_class()(
                max_tree_depth=settings.max_tree_depth,
                max_cached_requests=settings.max_cached_requests,
            )
        )

    def update(
        self,
        req_ids: Sequence[str],
        num_prompt_tokens: Sequence[int],
        token_ids: np.ndarray,
        sampled_token_ids: Sequence[Sequence[int]],
    ) -> None:
        """A step's sampled tokens: each row's request starts its tree from its prompt (the
        first time it sampled; again after it was stopped) and grows by them; requests no
        longer in the batch are stopped (their output stays in the global tree)."""
        cache = self.cache
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue  # a partial prefill chunk
            req_id = req_ids[i]
            if req_id not in cache.active_requests:
                if req_id in cache.cached_requests:
                    cache.evict_cached_response(req_id)
                cache.start_request(req_id, token_ids[i, : int(num_prompt_tokens[i])])
            cache.add_active_response(req_id, list(sampled))
        for req_id in set(cache.active_requests) - set(req_ids):
            cache.stop_request(req_id)

    def draft(self, req_id: str, row_tokens: np.ndarray, num_tokens: int, k: int) -> SuffixDraft:
        """Up to ``k`` tokens continuing ``row_tokens[:num_tokens]`` of an active request."""
        k = min(k, self.max_model_len - num_tokens - 1)
        if k <= 0:
            return SuffixDraft([], 0.0)
        s = self.settings
        start = max(0, num_tokens - s.max_tree_depth)
        draft = self.cache.speculate(
            req_id,
            row_tokens[start:num_tokens],
            max_spec_tokens=k,
            max_spec_factor=s.max_spec_factor,
            min_token_prob=s.min_token_prob,
        )
        return SuffixDraft([int(t) for t in draft.token_ids], float(draft.score))
