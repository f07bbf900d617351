"""The training loop: steps of the run's job (:mod:`.jobs`) over its batches
(:mod:`.batches`), with periodic evaluation, checkpoints and resume (:mod:`.resume`)."""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm_specstream.logger import init_logger
from vllm_specstream.training.args import TrainArgs
from vllm_specstream.training.batches import (
    FROZEN_PREFIX_FILE,
    batch_indices,
    batch_maker,
    collate,
    load_examples,
)
from vllm_specstream.training.checkpoint import check_model_dir
from vllm_specstream.training.device import (
    cast_frozen_linears,
    describe_device,
    resolve_device,
    resolve_dtype,
    to_device,
)
from vllm_specstream.training.jobs import make_job
from vllm_specstream.training.resume import (
    LOG_FILE,
    continue_chain,
    earlier_segments,
    resume,
    save_checkpoint,
    write_progress,
)

logger = init_logger(__name__)

#: Training metrics shown on the progress bar.
SHOWN = ("loss", "top1_main", "top1_stream1", "top1_step1")


def lr_factor(step: int, warmup: int, total: int, continued_at: int = 0) -> float:
    """Linear warm-up, then cosine decay to 10% of the run's ``total`` steps; a run continued
    at ``continued_at`` (fresh optimizer moments) warms up again over ``warmup`` steps."""
    if step < warmup:
        factor = (step + 1) / warmup
    else:
        progress = (step - warmup) / max(1, total - warmup)
        factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    if continued_at and step - continued_at < warmup:
        factor *= (step - continued_at + 1) / warmup
    return factor


def train_step(
    job,
    optimizer,
    base_lrs: list[float],
    make_batch,
    num_examples: int,
    args,
    step: int,
    autocast,
    continued_at: int = 0,
) -> tuple[dict[str, float], int]:
    """One optimizer step (``grad_accum`` micro-batches); returns its metrics and the number
    of real (non-padding) tokens it trained on."""
    factor = lr_factor(step, args.warmup_steps, args.steps, continued_at)
    for g, base_lr in zip(optimizer.param_groups, base_lrs):
        g["lr"] = base_lr * factor
    totals: dict[str, float] = {}
    tokens = 0
    for micro in range(args.grad_accum):
        idx = batch_indices(
            num_examples, args.batch_size, step * args.grad_accum + micro, args.seed
        )
        batch = make_batch(idx)
        tokens += int(batch["attention_mask"].sum())
        with autocast():
            loss, metrics = job.loss(batch)
        (loss / args.grad_accum).backward()
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v / args.grad_accum
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return totals, tokens


@torch.no_grad()
def evaluate(job, encoded: list[dict], args: TrainArgs, autocast) -> dict[str, float]:
    """Mean loss and per-stream (per-head) top-1 accuracy over the held-out examples."""
    job.model.eval()
    device = next(job.model.parameters()).device
    sums: dict[str, float] = {}
    batches = 0
    for i in range(0, len(encoded), args.batch_size):
        with autocast():
            _, metrics = job.loss(to_device(collate(encoded[i : i + args.batch_size]), device))
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        batches += 1
    job.model.train()
    return {f"eval_{k}": v / max(1, batches) for k, v in sums.items()}


@dataclass
class Run:
    """What the steps of one training process share."""

    args: TrainArgs
    job: object
    optimizer: torch.optim.Optimizer
    make_batch: object
    train_set: list[dict]
    eval_set: list[dict]
    prompts: list[str]
    autocast: object
    machine: str
    start: int
    continued_at: int
    segments: list[dict]
    started: float = 0.0
    tokens: int = 0

    def segment(self, to: int) -> dict:
        """This process's part of the run, up to step ``to``."""
        return {
            "from": self.start,
            "to": to,
            "tokens": self.tokens,
            "seconds": round(time.monotonic() - self.started, 1),
            "trained_on": self.machine,
        }


def train(args: TrainArgs, progress: bool = True) -> Path:
    """Run (or resume) training; return the adapter checkpoint directory."""
    out = Path(args.out)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if dtype == torch.bfloat16
        else nullcontext
    )
    train_set, prompts, eval_set = _encoded_data(args)
    out.mkdir(parents=True, exist_ok=True)  # once the data and base are known to be usable
    job = make_job(args, train_set)
    if dtype == torch.bfloat16:
        cast_frozen_linears(job.model, dtype)
    job.model.to(device)
    job.model.train()
    optimizer = torch.optim.AdamW(job.param_groups(), betas=(0.9, 0.99))
    start, continued_at, segments = resume(job, optimizer, out)
    if start == 0 and args.continue_from:
        start = continued_at = continue_chain(job, args, len(train_set))
    if segments is None:
        segments = earlier_segments(args, start)
    if start >= args.steps:  # e.g. a script run again: never relabel a longer run's state
        logger.info("%s is trained to step %d >= --steps %d: nothing to do", out, start, args.steps)
        return out
    make_batch = batch_maker(job, args, train_set, autocast, progress)
    if start == 0:
        first = [train_set[i] for i in batch_indices(len(train_set), args.batch_size, 0, args.seed)]
        with autocast():  # the precision of the steps (frozen weights may be bf16)
            job.calibrate(to_device(collate(first), device))
    run = Run(
        args,
        job,
        optimizer,
        make_batch,
        train_set,
        eval_set,
        prompts,
        autocast,
        describe_device(device),
        start,
        continued_at,
        segments,
    )
    _announce(run, dtype, device)
    done = _run_steps(run, progress)
    return _finish(run, done)


def _encoded_data(args: TrainArgs) -> tuple[list[dict], list[str], list[dict]]:
    """The encoded training examples, each one's prompt (for the progress file) and the
    encoded held-out examples."""
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import encode_example, prompt_key

    tokenizer = AutoTokenizer.from_pretrained(check_model_dir(args.base), local_files_only=True)
    examples = load_examples(args, "train", args.num_train)
    train_set = [encode_example(tokenizer, e, args.max_length) for e in examples]
    prompts = [prompt_key(e.messages) for e in examples]
    eval_set = [
        encode_example(tokenizer, e, args.max_length)
        for e in load_examples(args, "test", args.num_eval)
    ]
    if not train_set:
        raise ValueError(f"no training examples (task={args.task!r}, data={args.data!r})")
    return train_set, prompts, eval_set


def _announce(run: Run, dtype: torch.dtype, device: torch.device) -> None:
    """``train_args.json`` (with the machine) and the run's first log line."""
    args = run.args
    record = {**asdict(args), "trained_on": run.machine}
    (Path(args.out) / "train_args.json").write_text(
        json.dumps(record, indent=2, default=str) + "\n"
    )
    n_trainable = sum(p.numel() for g in run.optimizer.param_groups for p in g["params"])
    logger.info(
        "Training %s on %d examples (%d held out): %d trainable parameters, %s on %s, "
        "%d steps x %d x %d",
        args.objective,
        len(run.train_set),
        len(run.eval_set),
        n_trainable,
        dtype,
        device,
        args.steps,
        args.batch_size,
        args.grad_accum,
    )


def _run_steps(run: Run, progress: bool) -> int:
    """The steps from ``run.start`` until the last or ``--max-minutes``, logged, evaluated
    and checkpointed; returns the step reached."""
    from tqdm.auto import tqdm

    args, out = run.args, Path(run.args.out)
    base_lrs = [g["lr"] for g in run.optimizer.param_groups]
    bar = tqdm(
        total=args.steps, initial=run.start, desc=f"train {args.objective}", disable=not progress
    )
    log = open(out / LOG_FILE, "a")  # noqa: SIM115 (one handle for the whole run)
    run.started = time.monotonic()
    step = run.start
    try:
        for step in range(run.start, args.steps):
            totals, tokens = train_step(
                run.job,
                run.optimizer,
                base_lrs,
                run.make_batch,
                len(run.train_set),
                args,
                step,
                run.autocast,
                run.continued_at,
            )
            log.write(json.dumps(_step_record(run, step, totals, tokens)) + "\n")
            log.flush()
            run.tokens += tokens
            elapsed = time.monotonic() - run.started
            bar.update()
            postfix = {k: f"{v:.3f}" for k, v in totals.items() if k in SHOWN}
            bar.set_postfix(postfix | {"tok/s": f"{run.tokens / max(1e-9, elapsed):.0f}"})
            if args.max_minutes is not None and elapsed >= 60 * args.max_minutes:
                break
            if (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                so_far = [*run.segments, run.segment(step + 1)]
                save_checkpoint(run.job, run.optimizer, step + 1, out, run.continued_at, so_far)
    finally:
        bar.close()
        log.close()
    return step + 1


def _step_record(run: Run, step: int, totals: dict[str, float], tokens: int) -> dict:
    """The log record of ``step``, with the held-out metrics where it evaluates."""
    args = run.args
    record = {
        "step": step + 1,
        "tokens": tokens,
        "lr": run.optimizer.param_groups[0]["lr"],
        **totals,
        **run.job.log_extra(),
        "elapsed_s": round(time.monotonic() - run.started, 1),
    }
    periodic = args.eval_every > 0 and (step + 1) % args.eval_every == 0
    if run.eval_set and (periodic or step + 1 == args.steps):
        record.update(evaluate(run.job, run.eval_set, args, run.autocast))
        logger.info(
            "step %d: %s",
            step + 1,
            {k: round(v, 4) for k, v in record.items() if k.startswith("eval_")},
        )
    return record


def _finish(run: Run, done: int) -> Path:
    """The adapter, the last checkpoint and the progress file at step ``done``."""
    args, out = run.args, Path(run.args.out)
    run.job.save(out)
    run.segments.append(run.segment(done))
    save_checkpoint(run.job, run.optimizer, done, out, run.continued_at, run.segments)
    reached = write_progress(out, args, done, run.continued_at, run.prompts, run.segments)
    if done < args.steps:
        logger.info(
            "Stopped after --max-minutes %g at step %d of %d (%d examples seen, %d distinct): "
            "the adapter in %s is usable as it stands; run the same command to continue, or "
            "--continue-from that adapter (the same settings) to continue elsewhere",
            args.max_minutes,
            done,
            args.steps,
            reached["examples_seen"],
            reached["distinct_examples"],
            out,
        )
        return out
    (out / FROZEN_PREFIX_FILE).unlink(missing_ok=True)  # only a resumed run needs it
    logger.info("Adapter saved to %s (%.0f s)", out, time.monotonic() - run.started)
    return out
