"""The early-exit pruning threshold against what it keeps: tokens per step and verified
nodes per step of the reference tree decoder (the training side's, which vLLM's tree steps
match within 5%) on a task's validation prompts, one threshold after another, and the
speedup each would give under this CPU class's measured step-cost table. Thresholds already
in ``OUT/sweep.json`` (same checkpoint, prompts and tree) are kept: the script resumes.

Cost of a pruned step (an estimate, stated in the output): the layers below the pruning
layer run every node, those from it up the kept ones, so a step costs the table's ratio
for all nodes times the share of layers below ``Lp`` plus its ratio for the kept nodes
times the rest (the head's own cost and the stream pass are left out). Tokens per step are
measured; the speedup column is tokens per step over that cost.

    .venv/bin/python benchmarks/prune_threshold_sweep.py RUN/e2e-merged --task e2e \\
        --data ../shared/data/e2e/devset.csv --out benchmarks/results/e2e/prune-threshold
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def sweep(args: argparse.Namespace, done: dict[float, dict]) -> dict:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_specstream.bench import BenchConfig, load_prompts
    from vllm_specstream.training.evaluate import load_any
    from vllm_specstream.training.reference_decoder import speculative_generate

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    cfg = BenchConfig(
        checkpoint=args.checkpoint, task=args.task, data=args.data, split="val",
        num_prompts=args.n, methods=["plain"],
    )  # fmt: skip
    prompts = [tok(p, add_special_tokens=False).input_ids for p in load_prompts(cfg, tok)]
    model = load_any(args.checkpoint).eval().to(torch.float32)
    if model.prune_a is None:
        raise SystemExit(f"{args.checkpoint}: no pruning adapter (specstream.prune.enabled)")
    rows = []
    for threshold in args.thresholds:
        if threshold in done:
            rows.append(done[threshold])
            continue
        tokens = steps = verified = 0
        for prompt in tqdm(prompts, desc=f"threshold {threshold:g}", leave=False):
            r = speculative_generate(
                model, prompt, args.max_tokens, tok.eos_token_id, top_k=args.tree_top_k,
                max_nodes=args.nodes, prune_threshold=threshold,
            )  # fmt: skip
            tokens, steps, verified = (
                tokens + len(r.tokens) - 1,
                steps + r.steps,
                verified + sum(r.verified),
            )
        rows.append(
            {
                "threshold": threshold,
                "tokens_per_step": tokens / steps,
                "nodes_per_step": verified / steps,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return {
        "rows": rows,
        "prune_layer": (model.config.prune_layer(model.num_layers), model.num_layers),
    }


def estimate(result: dict, nodes: int, batch_sizes: list[int], placement: str) -> list[dict]:
    from vllm_specstream.step_cost import table_for

    table = table_for(placement)
    lp, layers = result["prune_layer"]
    below = lp / layers
    out = []
    for row in result["rows"]:
        for b in batch_sizes:
            cost = below * table.ratio(b, nodes) + (1 - below) * table.ratio(
                b, row["nodes_per_step"]
            )
            out.append({**row, "batch": b, "cost": cost, "speedup": row["tokens_per_step"] / cost})
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Reference tree decoder, {meta['prompts']}; top-{meta['tree_top_k']}, {meta['nodes']} "
        f"nodes, {meta['max_tokens']} tokens; pruning layer {meta['prune_layer'][0]} of "
        f"{meta['prune_layer'][1]}. Estimated speedup: tokens per step over the step-cost "
        f"table's ratio ({meta['cpu_class']}, {meta['placement']} placement) for all nodes "
        f"below the pruning layer and the kept ones above it.",
        "",
        "| threshold | tokens/step | of unpruned | nodes verified/step | nodes pruned | batch "
        "| est. cost (plain steps) | est. speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = (
        next(r for r in rows if r["threshold"] == 0)
        if any(r["threshold"] == 0 for r in rows)
        else rows[0]
    )
    for r in rows:
        lines.append(
            f"| {r['threshold']:g} | {r['tokens_per_step']:.2f} | "
            f"{r['tokens_per_step'] / base['tokens_per_step']:.1%} | {r['nodes_per_step']:.1f} | "
            f"{1 - r['nodes_per_step'] / base['nodes_per_step']:.0%} | {r['batch']} | "
            f"{r['cost']:.2f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="merged checkpoint with a pruning adapter")
    p.add_argument("--task", default="e2e")
    p.add_argument("--data", required=True, help="the task's public-format file (val split used)")
    p.add_argument("--out", required=True, help="directory for sweep.json and sweep.md")
    p.add_argument("-n", type=int, default=16, help="validation prompts")
    p.add_argument(
        "--nodes", type=int, default=16, help="tree nodes (vLLM's num_speculative_tokens)"
    )
    p.add_argument("--tree-top-k", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--thresholds", default="0,0.001,0.003,0.01,0.03,0.1",
        type=lambda s: [float(x) for x in s.split(",")],
    )  # fmt: skip
    p.add_argument("--batch-sizes", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument(
        "--placement", default="accepted", help="step-cost table (tree engines: accepted)"
    )
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from vllm_specstream.machine import cpu_class

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = {
        "checkpoint": args.checkpoint,
        "prompts": f"{args.n} {args.task} validation prompts ({args.data})",
        "tree_top_k": args.tree_top_k, "nodes": args.nodes, "max_tokens": args.max_tokens,
    }  # fmt: skip
    done = {}
    if (out / "sweep.json").is_file():
        old = json.loads((out / "sweep.json").read_text())
        if {k: old["meta"].get(k) for k in measured} == measured:
            keys = ("threshold", "tokens_per_step", "nodes_per_step")
            done = {r["threshold"]: {k: r[k] for k in keys} for r in old["rows"]}
    result = sweep(args, done)
    meta = {
        **measured,
        "prune_layer": result["prune_layer"], "cpu_class": cpu_class(), "placement": args.placement,
    }  # fmt: skip
    rows = estimate(result, args.nodes, args.batch_sizes, args.placement)
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / "sweep.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
