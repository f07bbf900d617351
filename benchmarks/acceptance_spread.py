"""How much the streams' acceptance differs from one request to the next.

The adaptive policy keeps one acceptance estimate per engine (decayed over the last ~50
drafting steps, :class:`vllm_specstream.policy.AcceptanceStats`). Where requests differ in
how well they draft, an estimate per request would follow each request instead of the mix
of the last few; where they do not, it would only add noise. This script decodes held-out
prompts with the reference decoder (chain of all ``num_streams`` drafts, greedy) and sets
the spread of each request's first-draft acceptance against the spread that chance alone
gives requests of its length (binomial, at the pooled rate): the difference is the
requests' own spread (method of moments). It also gives the lag-1 correlation of
first-draft acceptance between a request's consecutive steps (runs of easy tokens).

    .venv/bin/python benchmarks/acceptance_spread.py RUNS/dialogsum-merged --task dialogsum \
        --data ../shared/data/dialogsum/dialogsum.dev.jsonl [-n 48] [--out FILE.json]

Runs on the CPU, in PyTorch (no vLLM engine): ~2 minutes for 48 DialogSum dialogues.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch


def spread(accepted: list[list[int]]) -> dict:
    """Per-request statistics of the drafts each step kept (``accepted[r][t]``)."""
    steps = [a for a in accepted if a]
    firsts = [[float(x >= 1) for x in a] for a in steps]
    pooled = sum(map(sum, firsts)) / sum(map(len, firsts))
    rates = [sum(f) / len(f) for f in firsts]
    observed = statistics.pvariance(rates)
    chance = statistics.fmean(pooled * (1 - pooled) / len(f) for f in firsts)
    pairs = [(f[i], f[i + 1]) for f in firsts for i in range(len(f) - 1)]
    lag1 = statistics.correlation(*zip(*pairs)) if len(pairs) > 2 else float("nan")
    tokens = [1 + statistics.fmean(a) for a in steps]
    return {
        "requests": len(steps),
        "steps": sum(map(len, steps)),
        "tokens_per_step": 1 + statistics.fmean(x for a in steps for x in a),
        "first_kept_pooled": pooled,
        "first_kept_sd_observed": math.sqrt(observed),
        "first_kept_sd_by_chance": math.sqrt(chance),
        "first_kept_sd_requests": math.sqrt(max(observed - chance, 0.0)),
        "first_kept_range": [min(rates), max(rates)],
        "tokens_per_step_range": [min(tokens), max(tokens)],
        "lag1_correlation": lag1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="specstream checkpoint (adapter or merged)")
    parser.add_argument("--task", required=True)
    parser.add_argument("--data", required=True, help="task file whose validation split is read")
    parser.add_argument("-n", type=int, default=48, help="held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", help="JSON file for the statistics and per-request counts")
    args = parser.parse_args()

    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from vllm_specstream.machine import describe_machine
    from vllm_specstream.training.data import end_of_turn_id, prompt_text
    from vllm_specstream.training.evaluate import eval_cases, load_any
    from vllm_specstream.training.reference_decoder import speculative_generate

    model = load_any(args.checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    eos = end_of_turn_id(tokenizer)
    cases = eval_cases(args.task, None, args.n, data=args.data, split="val")
    accepted = []
    for case in tqdm(cases, desc="decode"):
        prompt = tokenizer(
            prompt_text(tokenizer, case.messages), add_special_tokens=False
        ).input_ids
        with torch.no_grad():
            result = speculative_generate(model, prompt, args.max_tokens, eos, top_k=1)
        accepted.append(result.accepted)
    stats = spread(accepted)
    print(describe_machine())
    print(
        f"{args.task}: {stats['requests']} requests, {stats['steps']} steps, "
        f"{stats['tokens_per_step']:.2f} tokens/step with {model.config.num_streams} drafts"
    )
    print(
        f"P(first draft kept) {stats['first_kept_pooled']:.3f}; sd over requests "
        f"{stats['first_kept_sd_observed']:.3f}, by chance alone "
        f"{stats['first_kept_sd_by_chance']:.3f}, so the requests' own "
        f"{stats['first_kept_sd_requests']:.3f} (range "
        f"{stats['first_kept_range'][0]:.2f}-{stats['first_kept_range'][1]:.2f})"
    )
    print(
        f"lag-1 correlation of first-draft acceptance in a request: {stats['lag1_correlation']:.3f}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**stats, "accepted": accepted}, f, indent=1)


if __name__ == "__main__":
    main()
