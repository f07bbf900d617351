"""A run's state on disk: checkpoints to resume from, the log, the progress file, and
continuing an unfinished run's adapter (``--continue-from``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.logger import init_logger
from vllm_specstream.safe_write import new_dir, write_text
from vllm_specstream.training.args import CHAIN_FIELDS, TrainArgs
from vllm_specstream.training.batches import seen_examples

logger = init_logger(__name__)

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
#: How far a run got, written beside its adapter: the step reached of the run's ``steps``,
#: where it last continued (``continue_from``), and the data it has seen so far.
PROGRESS_FILE = "train_state.json"


def save_checkpoint(
    job,
    optimizer,
    step: int,
    out: Path,
    continued_at: int = 0,
    segments: tuple[dict, ...] | list[dict] = (),
) -> None:
    """Trainable weights + optimizer state in ``out/checkpoint`` (written aside, then swapped
    in), with the processes that trained it so far (``segments``: a run killed before it
    wrote its progress file resumes with them)."""
    state = {
        "step": step,
        "continued_at": continued_at,
        "segments": list(segments),
        "optimizer": optimizer.state_dict(),
    }
    with new_dir(out / CHECKPOINT_DIR) as tmp:
        job.save(tmp)
        torch.save(state, tmp / STATE_FILE)


def resume(job, optimizer, out: Path) -> tuple[int, int, list[dict] | None]:
    """Load ``out/checkpoint`` if present; return the step to continue from, the step at
    which the run last continued from an adapter (0: never) and the processes that trained
    it (None: not recorded in the checkpoint)."""
    ckpt = out / CHECKPOINT_DIR
    if not (ckpt / STATE_FILE).is_file():
        return 0, 0, None
    job.load_trainable(ckpt)
    # Optimizer state follows its parameters' device (a run may resume on another one).
    state = torch.load(ckpt / STATE_FILE, weights_only=True, map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])
    keep_log(out / LOG_FILE, state["step"])
    logger.info("Resuming from %s at step %d", ckpt, state["step"])
    return int(state["step"]), int(state.get("continued_at", 0)), state.get("segments")


def keep_log(log: Path, step: int) -> None:
    """Drop the records of steps after ``step`` (they will run again)."""
    if log.is_file():
        kept = [x for x in log.read_text().splitlines() if json.loads(x)["step"] <= step]
        write_text(log, "".join(x + "\n" for x in kept))


def continue_chain(job, args: TrainArgs, num_examples: int) -> int:
    """Load the unfinished run's adapter ``args.continue_from`` after checking that it was
    trained with this run's settings and data; copy its log; return its step."""
    src = Path(args.continue_from)
    flag = f"--continue-from {src}"
    try:
        progress = json.loads((src / PROGRESS_FILE).read_text())
        before = json.loads((src / "train_args.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{flag}: not the adapter of an unfinished run ({e}); it must hold "
            f"{PROGRESS_FILE} and train_args.json as `specstream train --max-minutes` writes them"
        ) from None
    now = json.loads(json.dumps(asdict(args), default=str))
    for settings in (before, now):  # the base may lie elsewhere on another machine
        (settings.get("spec") or {}).pop("base_model", None)
    for name in CHAIN_FIELDS:
        if before.get(name) != now.get(name):
            raise ConfigError(
                f"{flag}: it was trained with {name}={before.get(name)!r}, this run has "
                f"{now.get(name)!r}; continue with the adapter's settings (its train_args.json)"
            )
    if progress["train_examples"] != num_examples:
        raise ConfigError(
            f"{flag}: it trained on {progress['train_examples']} examples of "
            f"{before.get('data')}, --data {args.data} gives {num_examples}; continue on the "
            "same file"
        )
    step = int(progress["step"])
    if step >= args.steps:
        raise ConfigError(f"{flag}: it is finished ({step} of {args.steps} steps)")
    job.load_trainable(src)
    log = Path(args.out) / LOG_FILE
    if (src / LOG_FILE).is_file():
        log.write_text((src / LOG_FILE).read_text())
        keep_log(log, step)
    logger.info("Continuing %s at step %d of %d", src, step, args.steps)
    return step


def earlier_segments(args: TrainArgs, start: int) -> list[dict]:
    """The processes that trained this run's steps before ``start`` (from ``out``'s progress
    file, or that of the adapter it continues)."""
    sources = [Path(args.out)] + ([Path(args.continue_from)] if args.continue_from else [])
    for src in sources:
        try:
            segments = json.loads((src / PROGRESS_FILE).read_text())["segments"]
        except (OSError, ValueError, KeyError):
            continue
        return [x for x in segments if x["to"] <= start]
    return []


def write_progress(
    out: Path,
    args: TrainArgs,
    step: int,
    continued_at: int,
    prompts: list[str],
    segments: list[dict],
) -> dict:
    """``train_state.json``: how far the run got, what it has trained on (an example is a
    prompt and one reference: E2E has several references per meaning representation) and
    the processes that trained it (steps, tokens, seconds, machine)."""
    micro = step * args.grad_accum
    seen = seen_examples(len(prompts), args.batch_size, micro, args.seed)
    progress = {
        "step": step,
        "steps": args.steps,
        "continued_at": continued_at,
        "examples_seen": micro * args.batch_size,
        "train_examples": len(prompts),
        "distinct_examples": len(seen),
        "distinct_prompts": len({prompts[i] for i in seen}),
        "train_prompts": len(set(prompts)),
        "segments": segments,
    }
    write_text(out / PROGRESS_FILE, json.dumps(progress, indent=2) + "\n")
    return progress
