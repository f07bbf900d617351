"""The draft vocabulary: the tokens a task's streams draft from.

The streams' LM head multiplies a few rows per step by every row of the head (49,152 for
SmolLM2): on a CPU that step reads the whole head for a handful of drafts. A task's replies
use a small part of it (E2E's training replies: 1,262 distinct tokens), so a checkpoint may
carry a draft vocabulary (``SpecStreamConfig.draft_vocab_size``, the ``draft_vocab_mask``
stream tensor), and the streams then draft from its rows only. Drafts are still verified by
the whole model: a draft vocabulary changes which tokens can be drafted, never the outputs.

:func:`draft_vocab_ids` ranks the tokens of the training split's replies (most frequent
first), then those of its prompts (a reply copies names from its prompt: SQL columns, the
speakers of a dialogue), then the tokenizer's lowest ids (a byte-level BPE numbers its
pieces in merge order, frequent ones first), and keeps the first ``size``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from vllm_specstream.checkpoint.config import DRAFT_VOCAB_MASK, ConfigError

#: Default size: covers E2E's and DialogSum's held-out replies to 99.7% / 94.5% (tokens) with
#: SmolLM2's tokenizer; the head's matmul over it is about 1/6 of the whole head's.
DEFAULT_DRAFT_VOCAB_SIZE = 8192


def draft_vocab_ids(
    reply_counts: Counter,
    prompt_counts: Counter,
    vocab_size: int,
    size: int,
    always: Sequence[int] = (),
) -> list[int]:
    """The ``size`` token ids of the draft vocabulary, ascending: ``always`` (e.g. the
    end-of-turn token), then reply tokens by count, prompt tokens by count (ties: lower id
    first), then the lowest ids; ids outside ``[0, vocab_size)`` are ignored."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")

    def by_count(counts: Counter) -> list[int]:
        return sorted(counts, key=lambda t: (-counts[t], t))

    chosen: dict[int, None] = {}
    for t in (*always, *by_count(reply_counts), *by_count(prompt_counts), *range(vocab_size)):
        if len(chosen) == size:
            break
        if 0 <= t < vocab_size:
            chosen.setdefault(int(t), None)
    return sorted(chosen)


def draft_vocab_mask(ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """``[vocab_size]``: 1 at each of ``ids``, 0 elsewhere (the checkpoint's tensor)."""
    mask = torch.zeros(vocab_size)
    mask[torch.as_tensor(list(ids), dtype=torch.long)] = 1.0
    return mask


def mask_token_ids(mask: torch.Tensor, expected: int, where: str) -> torch.Tensor:
    """The ids a ``draft_vocab_mask`` marks (ascending), checked against the config's
    ``draft_vocab_size`` and for values other than 0 and 1."""
    values = mask.detach().float()
    if not bool(((values == 0) | (values == 1)).all()):
        raise ConfigError(f"{where}: {DRAFT_VOCAB_MASK} must hold only 0 and 1")
    ids = torch.nonzero(values, as_tuple=True)[0]
    if ids.numel() != expected:
        raise ConfigError(
            f"{where}: {DRAFT_VOCAB_MASK} marks {ids.numel()} tokens but draft_vocab_size is "
            f"{expected}"
        )
    return ids
