"""A run's training data: its examples, their order over the steps and the batches made of
them (padded, or packed with the frozen layers' output cached: :mod:`.fast_batches`)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from vllm_specstream.logger import init_logger
from vllm_specstream.training.args import TrainArgs
from vllm_specstream.training.device import to_device

logger = init_logger(__name__)

#: The frozen layers' output per training example, kept until the run finishes so that a
#: resumed run does not compute it again.
FROZEN_PREFIX_FILE = "frozen_prefix.pt"


def load_examples(args: TrainArgs, split: str, n: int | None, distilled: bool = True):
    """The examples of ``split`` (``train`` or ``test``), with the base model's own replies
    when ``args.distill`` is set (and ``distilled``)."""
    from vllm_specstream.training.data import read_replies, with_replies

    examples = _task_examples(args, split, n)
    if args.distill and distilled:
        return with_replies(examples, read_replies(args.distill), args.distill)
    return examples


def _task_examples(args: TrainArgs, split: str, n: int | None):
    from vllm_specstream.training.tasks import task_examples

    return task_examples(
        args.task,
        split,
        n,
        data=args.data,
        eval_data=args.eval_data,
        seed=args.seed,
        val_fraction=args.val_fraction,
        split_seed=args.split_seed,
        sql_rename_copies=args.sql_rename_copies,
        sql_rename_rate=args.sql_rename_rate,
    )


def collate(encoded: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``labels_mask``."""
    t = max(len(e["input_ids"]) for e in encoded)
    ids = torch.zeros(len(encoded), t, dtype=torch.long)
    attn = torch.zeros(len(encoded), t, dtype=torch.bool)
    labels = torch.zeros(len(encoded), t, dtype=torch.bool)
    for i, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        attn[i, :n] = True
        labels[i, :n] = torch.tensor(e["labels_mask"])
    return {"input_ids": ids, "attention_mask": attn, "labels_mask": labels}


def epoch_order(num_examples: int, epoch: int, seed: int) -> list[int]:
    """The order in which epoch ``epoch`` visits the examples (a permutation fixed by
    ``seed``): every example once before any repeats."""
    perm = list(range(num_examples))
    random.Random(seed * 100_003 + epoch).shuffle(perm)
    return perm


def batch_indices(num_examples: int, batch_size: int, micro_step: int, seed: int) -> list[int]:
    """Examples of micro-batch ``micro_step`` (:func:`epoch_order`), so a resumed or continued
    run sees exactly the batches an uninterrupted one would."""
    start = micro_step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_examples)
        out.extend(epoch_order(num_examples, epoch, seed)[offset : offset + batch_size - len(out)])
    return out


def seen_examples(num_examples: int, batch_size: int, micro_steps: int, seed: int) -> set[int]:
    """Indices of the examples the first ``micro_steps`` micro-batches trained on."""
    epochs, offset = divmod(micro_steps * batch_size, num_examples)
    if epochs:
        return set(range(num_examples))
    return set(epoch_order(num_examples, 0, seed)[:offset])


def batch_maker(job, args: TrainArgs, train_set: list[dict], autocast, progress: bool = False):
    """The function from example indices to a training batch on the model's device: padded
    (:func:`collate`), or packed, with the frozen layers' output cached where that applies
    (:mod:`.fast_batches`; a drafter on the frozen base (``job.frozen_base``): the whole
    model is frozen, its outputs are cached)."""
    from vllm_specstream.training.fast_batches import pack_batch, pad_rows

    whole_base = job.frozen_base
    model = job.model
    start = _frozen_layers(job, args, train_set)
    hidden = _frozen_output(job, args, train_set, start, autocast, progress) if start else None
    device = next(model.parameters()).device

    def build(idx: list[int]) -> dict:
        examples = [train_set[i] for i in idx]
        rows = None if hidden is None else [hidden[i] for i in idx]
        if whole_base or not args.pack:
            batch = collate(examples)
            if rows is not None:
                batch["hidden"] = pad_rows(rows)
                if not whole_base:
                    batch["start_layer"] = start
            return batch
        return pack_batch(
            examples, args.max_length, model.config.num_streams, rows, start
        ).as_dict()

    return lambda idx: to_device(build(idx), device)


def _frozen_layers(job, args: TrainArgs, train_set: list[dict]) -> int:
    """Layers below the lowest trainable one whose output is worth caching (0: none)."""
    from vllm_specstream.training.fast_batches import first_trainable_layer

    if not args.frozen_prefix:
        return 0
    model = job.model
    start = model.lm.config.num_hidden_layers if job.frozen_base else first_trainable_layer(model)
    seen = args.steps * args.batch_size * args.grad_accum
    if start > 0 and seen < len(train_set):
        # Caching every example costs more than the run's own steps would spend on them.
        logger.info(
            "Frozen-prefix cache skipped: the run sees %d examples, fewer than the %d it "
            "would cache",
            seen,
            len(train_set),
        )
        return 0
    return start


def _frozen_output(job, args: TrainArgs, train_set: list[dict], start: int, autocast, progress):
    """The output of layers ``0 .. start-1`` for every example (None where it would take
    more than ``--frozen-prefix-max-gib``), computed once and kept in the run's directory."""
    from vllm_specstream.training.fast_batches import cache_key, load_or_compute, prefix_hidden

    model = job.model
    h = getattr(model, "feature_width", model.lm.config.hidden_size)
    gib = sum(len(e["input_ids"]) for e in train_set) * h * 4 / 2**30
    if gib > args.frozen_prefix_max_gib:
        logger.warning(
            "Frozen-prefix cache skipped: %.1f GiB > --frozen-prefix-max-gib %.1f",
            gib,
            args.frozen_prefix_max_gib,
        )
        return None
    t0 = time.monotonic()

    def compute():
        with autocast():  # the precision the layers would run in at every step
            if job.frozen_base:
                return model.final_hidden(train_set, progress=progress)
            return prefix_hidden(model, train_set, start, progress=progress)

    key = cache_key(
        args.base,
        args.init_from,
        start,
        job.frozen_base,
        args.dtype,
        *job.cache_tag,
        encoded=train_set,
    )
    hidden = load_or_compute(Path(args.out) / FROZEN_PREFIX_FILE, key, compute)
    logger.info(
        "Layers 0-%d are frozen: their output for %d examples cached (%.2f GiB, %.0f s)",
        start - 1,
        len(train_set),
        gib,
        time.monotonic() - t0,
    )
    return hidden
