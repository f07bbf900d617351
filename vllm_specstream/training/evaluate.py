"""``specstream eval``: acceptance (reference decoder, chain and tree) and task quality."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_specstream.checkpoint.config import CONFIG_FILE, ConfigError, counts_as_parameters
from vllm_specstream.training.metrics import task_metrics
from vllm_specstream.training.model import SpecStreamModel
from vllm_specstream.training.tasks.holdout import DEFAULT_VAL_FRACTION


def load_any(checkpoint: str | Path, base: str | None = None) -> SpecStreamModel:
    """An adapter checkpoint (``specstream_config.json``) or a merged one (``config.json``)."""
    from vllm_specstream.training.checkpoint import load_adapter, load_merged

    ckpt = Path(checkpoint)
    if (ckpt / CONFIG_FILE).is_file():
        return load_adapter(ckpt, base=base)
    if (ckpt / "config.json").is_file():
        return load_merged(ckpt)
    raise ConfigError(
        f"{ckpt}: neither an adapter checkpoint ({CONFIG_FILE}) nor a merged one (config.json)"
    )


@dataclass
class EvalCase:
    """One held-out prompt and every reference it is scored against (the best one counts)."""

    messages: list[dict]
    references: list[str]


def eval_cases(
    task: str,
    prompts: str | None,
    n: int | None,
    seed: int = 0,
    *,
    data: str | None = None,
    split: str = "all",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    split_seed: int = 0,
) -> list[EvalCase]:
    """The first ``n`` held-out cases (None: all): ``split`` of the public-format ``data``
    file, else every record of the JSONL ``prompts``, else the task's synthetic test split."""
    from vllm_specstream.training.data import load_jsonl
    from vllm_specstream.training.tasks import (
        PUBLIC_TASKS,
        TASKS,
        build_task,
        load_task_data,
        reference,
        select_split,
        to_example,
    )

    if data:
        if task not in PUBLIC_TASKS:
            raise ValueError(f"--data needs --task {' or '.join(PUBLIC_TASKS)}, got {task!r}")
        records = select_split(load_task_data(task, data), split, val_fraction, split_seed)
        return [EvalCase(r.messages, list(r.references)) for r in records[:n]]
    if prompts:
        examples = load_jsonl(prompts)[:n]
        return [EvalCase(e.messages, [e.completion]) for e in examples]
    if task not in TASKS:
        raise ValueError(
            f"--task {task} needs --data FILE (its public format; see docs/training.md)"
        )
    records = build_task(task, "test", n=n, seed=seed)
    return [EvalCase(to_example(task, r).messages, [reference(task, r)]) for r in records]


@torch.no_grad()
def evaluate_checkpoint(
    model: SpecStreamModel,
    tokenizer,
    task: str,
    cases: list[EvalCase],
    max_new_tokens: int = 128,
    tree_top_k: int = 2,
    progress: bool = True,
) -> dict:
    """Greedy-decode every case with the chain (and, if ``tree_top_k > 1``, the tree) decoder;
    report tokens per step and the task's SPEC metrics (:func:`task_metrics`, from the chain
    decoder's outputs)."""
    from tqdm.auto import tqdm

    from vllm_specstream.training.data import end_of_turn_id, prompt_text
    from vllm_specstream.training.reference_decoder import speculative_generate

    eos = end_of_turn_id(tokenizer)
    chain_tokens = chain_steps = tree_tokens = tree_steps = 0
    predictions, mismatches = [], 0
    for case in tqdm(cases, desc=f"eval {task}", disable=not progress):
        prompt = tokenizer(
            prompt_text(tokenizer, case.messages), add_special_tokens=False
        ).input_ids
        chain = speculative_generate(model, prompt, max_new_tokens, eos, top_k=1)
        chain_tokens, chain_steps = chain_tokens + len(chain.tokens) - 1, chain_steps + chain.steps
        if tree_top_k > 1:
            tree = speculative_generate(model, prompt, max_new_tokens, eos, top_k=tree_top_k)
            mismatches += chain.tokens != tree.tokens
            tree_tokens, tree_steps = tree_tokens + len(tree.tokens) - 1, tree_steps + tree.steps
        predictions.append(tokenizer.decode(chain.tokens, skip_special_tokens=True).strip())
    metrics = task_metrics(task, predictions, [c.references for c in cases])
    extra = sum(p.numel() for n, p in model.stream_parameters().items() if counts_as_parameters(n))
    return {
        "task": task,
        "num_prompts": len(cases),
        "tokens_per_step": {
            "chain": chain_tokens / max(1, chain_steps),
            "tree": tree_tokens / tree_steps if tree_steps else None,
            "tree_top_k": tree_top_k,
        },
        **metrics,
        "extra_params": extra,
        "chain_tree_identical": mismatches == 0,
        "num_streams": model.config.num_streams,
    }
