"""Building a task's draft vocabulary from its training split and writing it into an adapter
(the vocabulary itself: :mod:`vllm_specstream.checkpoint.draft_vocab`)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vllm_specstream.checkpoint.config import (
    CONFIG_FILE,
    DRAFT_VOCAB_MASK,
    STREAM_FILE,
    ConfigError,
    SpecStreamConfig,
)
from vllm_specstream.checkpoint.draft_vocab import (
    DEFAULT_DRAFT_VOCAB_SIZE,
    draft_vocab_ids,
    draft_vocab_mask,
)


def token_counts(
    tokenizer, replies: Iterable[str], prompts: Iterable[str]
) -> tuple[Counter, Counter]:
    """Token counts of ``replies`` and of ``prompts`` (no special tokens added)."""

    def count(texts: Iterable[str]) -> Counter:
        counts: Counter = Counter()
        for text in texts:
            counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
        return counts

    return count(replies), count(prompts)


@dataclass
class TaskTokens:
    """The tokens a task file's training split uses, which rank a draft vocabulary."""

    replies: Counter
    prompts: Counter
    always: list[int]
    """Tokens every draft vocabulary keeps: the end of a reply."""

    def draft_vocab_ids(self, vocab_size: int, size: int) -> list[int]:
        return draft_vocab_ids(self.replies, self.prompts, vocab_size, size, self.always)


def task_tokens(
    tokenizer, task: str, data: str | Path, val_fraction: float | None = None, seed: int = 0
) -> TaskTokens:
    """:class:`TaskTokens` of the training split of ``data`` (``task``'s format; the split
    ``specstream train`` trains on with the same ``val_fraction`` and ``seed``)."""
    from vllm_specstream.training.data import end_of_turn_id
    from vllm_specstream.training.tasks.holdout import DEFAULT_VAL_FRACTION, select_split
    from vllm_specstream.training.tasks.public import load_task_data

    fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
    records = select_split(load_task_data(task, data), "train", fraction, seed)
    replies = [ref for r in records for ref in r.references]
    reply_counts, prompt_counts = token_counts(tokenizer, replies, [r.prompt for r in records])
    always = [end_of_turn_id(tokenizer)]
    if tokenizer.eos_token_id is not None:
        always.append(int(tokenizer.eos_token_id))
    return TaskTokens(reply_counts, prompt_counts, always)


@dataclass
class DraftVocabSummary:
    """What :func:`add_draft_vocab` wrote."""

    size: int
    vocab_size: int
    reply_tokens: int
    """Distinct tokens of the training replies."""
    reply_coverage: float
    """Share of the training replies' tokens (with repeats) in the draft vocabulary."""


def add_draft_vocab(
    adapter_dir: str | Path,
    task: str,
    data: str | Path,
    size: int = DEFAULT_DRAFT_VOCAB_SIZE,
    val_fraction: float | None = None,
    seed: int = 0,
    base: str | Path | None = None,
) -> DraftVocabSummary:
    """Give the adapter in ``adapter_dir`` the draft vocabulary of the training split of
    ``data`` (``task``'s format; the split ``specstream train`` trains on with the same
    ``val_fraction`` and ``seed``): ``draft_vocab_size`` in its config, ``draft_vocab_mask``
    in its stream tensors (replacing one it had)."""
    from transformers import AutoTokenizer

    from vllm_specstream.training.checkpoint import resolve_base

    adapter = Path(adapter_dir)
    config = SpecStreamConfig.load(adapter)
    stream_file = adapter / STREAM_FILE
    if not stream_file.is_file():
        raise ConfigError(f"{stream_file}: missing; {adapter} is not a specstream adapter")
    base_dir = resolve_base(base, config.base_model, adapter / CONFIG_FILE)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    hf_config = json.loads((Path(base_dir) / "config.json").read_text())
    vocab_size = int(hf_config["vocab_size"])
    tokens = task_tokens(tokenizer, task, data, val_fraction, seed)
    ids = tokens.draft_vocab_ids(vocab_size, size)
    kept = set(ids)
    total = sum(tokens.replies.values())
    covered = sum(n for t, n in tokens.replies.items() if t in kept)

    write_draft_vocab(adapter, ids, vocab_size)
    return DraftVocabSummary(
        size=len(ids),
        vocab_size=vocab_size,
        reply_tokens=len(tokens.replies),
        reply_coverage=covered / total if total else 1.0,
    )


def write_draft_vocab(adapter_dir: str | Path, ids: Iterable[int], vocab_size: int) -> None:
    """Make ``ids`` the draft vocabulary of the adapter in ``adapter_dir`` (its config's
    ``draft_vocab_size``, its ``draft_vocab_mask`` stream tensor)."""
    from safetensors.torch import save_file

    from vllm_specstream.checkpoint.tensor_files import read_tensors

    adapter = Path(adapter_dir)
    config = SpecStreamConfig.load(adapter)
    stream_file = adapter / STREAM_FILE
    mask = draft_vocab_mask(ids, vocab_size)
    tensors = read_tensors(stream_file)
    tensors[DRAFT_VOCAB_MASK] = mask
    config.draft_vocab_size = int(mask.sum())
    config.validate()
    save_file(tensors, str(stream_file), metadata={"format": "pt"})
    config.save(adapter)
