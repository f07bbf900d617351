"""``specstream eval``: acceptance (reference decoder, chain and tree) and task quality."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_specstream.config import CONFIG_FILE, ConfigError
from vllm_specstream.training.model import SpecStreamModel


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
    messages: list[dict]
    reference: str


def eval_cases(task: str, prompts: str | None, n: int | None, seed: int = 0) -> list[EvalCase]:
    """``n`` held-out cases (None: all of the task's test split, or of ``prompts``)."""
    from vllm_specstream.training.data import load_jsonl
    from vllm_specstream.training.tasks import build_task, reference, to_example

    if prompts:
        examples = load_jsonl(prompts)[:n]
        return [EvalCase(e.messages, e.completion) for e in examples]
    records = build_task(task, "test", n=n, seed=seed)
    return [EvalCase(to_example(task, r).messages, reference(task, r)) for r in records]


def task_metric(task: str, predictions: list[str], references: list[str]) -> tuple[str, float]:
    """Exact match (SQL, normalised) in percent, else ROUGE-L F in percent."""
    from vllm_specstream.training.metrics import rouge_l, sql_exact_match

    if task == "sql":
        score = statistics.mean(sql_exact_match(p, r) for p, r in zip(predictions, references))
        return "exact_match", 100.0 * score
    return "rouge_l", 100.0 * statistics.mean(
        rouge_l(p, r) for p, r in zip(predictions, references)
    )


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
    report the SPEC metrics."""
    from tqdm.auto import tqdm

    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.reference_decoder import speculative_generate

    eos = tokenizer.eos_token_id
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
    metric, score = task_metric(task, predictions, [c.reference for c in cases])
    extra = sum(p.numel() for p in model.stream_parameters().values())
    return {
        "task": task,
        "num_prompts": len(cases),
        "tokens_per_step": {
            "chain": chain_tokens / max(1, chain_steps),
            "tree": tree_tokens / tree_steps if tree_steps else None,
            "tree_top_k": tree_top_k,
        },
        metric: score,
        "extra_params": extra,
        "chain_tree_identical": mismatches == 0,
        "num_streams": model.config.num_streams,
    }
