"""Several specstream adapters on one base (vLLM multi-LoRA) against their merged checkpoints.

Serves the base once with every adapter (``adapter_deployment``), and each adapter's merged
checkpoint alone, on the same prompts (request ``i`` goes to adapter ``i mod A``), greedy:

* **acceptance**: tokens per drafting step of each adapter's requests, drafting ``k`` at
  every step, on the deployment and on the adapter's merged checkpoint (they should agree);
* **speed**: output tokens/s of mixed-adapter batches of 1/4/16 requests, plain LoRA serving
  against specstream (the adaptive policy) on the deployment; and the merged checkpoints
  plain and specstream, to show what vLLM's CPU LoRA path costs;
* that outputs with and without speculation are identical.

One engine per child process; the parent prints and saves the table (JSON + Markdown).

    .venv/bin/python benchmarks/multi_lora.py BASE --adapter NAME=DIR=MERGED ... \\
        --task sql --data FILE --split val -n 16 --out benchmarks/results/multi-lora
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def prompts_for(args) -> list[str]:
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks import load_task_data, select_split
    from vllm_specstream.training.tasks.holdout import DEFAULT_VAL_FRACTION

    tok = AutoTokenizer.from_pretrained(args.base)
    records = select_split(load_task_data(args.task, args.data), args.split, DEFAULT_VAL_FRACTION)
    return [prompt_text(tok, r.messages) for r in records[: args.n]]


def child(args, spec: dict) -> dict:
    """One engine: ``spec`` = {ckpt, lora: [dirs] or [], k, adaptive, batch_sizes, engine}."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from vllm_specstream import speculative_config
    from vllm_specstream.cpu_env import cpu_engine_kwargs

    prompts = prompts_for(args)
    kw = cpu_engine_kwargs(dtype="float32", max_num_seqs=16, **spec["engine"])
    if spec["k"]:
        kw["speculative_config"] = speculative_config(spec["k"], adaptive=spec["adaptive"])
        kw["per_request_spec_decode_metrics"] = "summary"  # acceptance per adapter
    llm = LLM(model=spec["ckpt"], disable_log_stats=False, **kw)
    loras = [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(spec["lora"])]
    owner = [i % spec["num_adapters"] for i in range(len(prompts))]
    # Requests of the adapters this engine serves (all on the deployment, one on a merged).
    mine = [i for i in range(len(prompts)) if owner[i] in spec["adapters"]]
    lora_of = {i: (loras[owner[i]] if loras else None) for i in mine}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], params, lora_request=lora_of[mine[0]], use_tqdm=False)
    out: dict = {"tokens": {}, "cells": {}, "acceptance": {}}
    for b in spec["batch_sizes"]:
        rates = []
        for start in range(0, len(mine), b):
            group = mine[start : start + b]
            t = time.perf_counter()
            outs = llm.generate(
                [prompts[i] for i in group],
                params,
                lora_request=[lora_of[i] for i in group],
                use_tqdm=False,
            )
            took = time.perf_counter() - t
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / took)
            for i, o in zip(group, outs):
                out["tokens"][str(i)] = list(o.outputs[0].token_ids)
                m = o.outputs[0].spec_decode_metrics
                if m is not None and b == spec["batch_sizes"][0]:
                    d = m.to_dict()
                    a = out["acceptance"].setdefault(str(owner[i]), [0, 0])
                    a[0] += d["num_accepted_draft_tokens"]
                    a[1] += d["num_spec_steps"]
        out["cells"][str(b)] = statistics.median(rates)
    llm.llm_engine.engine_core.shutdown()
    return out


def run(args, spec: dict) -> dict:
    argv = [sys.executable, __file__, *sys.argv[1:], "--child", json.dumps(spec)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.exit(f"multi_lora: child failed ({spec['name']}):\n{proc.stderr[-4000:]}")
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("--adapter", action="append", required=True, help="NAME=ADAPTER_DIR=MERGED_DIR")
    ap.add_argument("--task", default="sql")
    ap.add_argument("--data", required=True)
    ap.add_argument("--split", default="val")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--reuse", action="store_true", help="keep the runs already in OUT/multi_lora.json"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child(args, json.loads(args.child))
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")
        return

    from vllm_specstream.adapter_deployment import plan_deployment
    from vllm_specstream.machine import describe_machine

    triples = [a.split("=") for a in args.adapter]
    names = [t[0] for t in triples]
    plan = plan_deployment(args.base, {name: d for name, d, _ in triples})
    deployment = {
        "enable_lora": True,
        "max_loras": len(triples),
        "max_lora_rank": plan.max_lora_rank,
        "hf_overrides": plan.overrides(),
    }
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    every = list(range(len(triples)))
    lora_dirs = [d for _, d, _ in triples]
    specs = [
        {"name": "lora plain", "ckpt": args.base, "lora": lora_dirs, "adapters": every,
         "k": 0, "adaptive": False, "batch_sizes": sizes, "engine": deployment},
        {"name": "lora specstream", "ckpt": args.base, "lora": lora_dirs, "adapters": every,
         "k": args.k, "adaptive": True, "batch_sizes": sizes, "engine": deployment},
        {"name": "lora drafts every step", "ckpt": args.base, "lora": lora_dirs,
         "adapters": every, "k": args.k, "adaptive": False, "batch_sizes": [1],
         "engine": deployment},
    ]  # fmt: skip
    for i, (name, _, merged) in enumerate(triples):
        for label, k, adaptive, batch_sizes in (
            ("plain", 0, False, sizes),
            ("specstream", args.k, True, sizes),
            ("drafts every step", args.k, False, [1]),
        ):
            specs.append(
                {"name": f"merged {name} {label}", "ckpt": merged, "lora": [], "adapters": [i],
                 "k": k, "adaptive": adaptive, "batch_sizes": batch_sizes, "engine": {}}
            )  # fmt: skip
    saved = Path(args.out) / "multi_lora.json"
    results = json.loads(saved.read_text()) if args.reuse and saved.is_file() else {}
    for spec in specs:
        spec["num_adapters"] = len(triples)
        if spec["name"] in results:
            continue
        print(f"running {spec['name']} ...", file=sys.stderr, flush=True)
        results[spec["name"]] = run(args, spec)

    def tps(name: str, adapter: int) -> float:
        accepted, steps = results[name]["acceptance"].get(str(adapter), [0, 0])
        return 1 + accepted / steps if steps else float("nan")

    lines = [
        f"Machine: {describe_machine()}",
        "",
        f"Base {args.base}; adapters {', '.join(names)} (request i -> adapter i mod "
        f"{len(names)}); {args.n} prompts ({args.task} {args.data}, {args.split} split), "
        f"max_tokens {args.max_tokens}, float32, k={args.k}.",
        "",
        "| adapter | tokens/step on the LoRA deployment | on its merged checkpoint | ratio |",
        "|---|---|---|---|",
    ]
    for i, name in enumerate(names):
        on_lora, merged = (
            tps("lora drafts every step", i),
            tps(f"merged {name} drafts every step", i),
        )
        lines.append(f"| {name} | {on_lora:.2f} | {merged:.2f} | {on_lora / merged:.3f} |")
    lines += ["", "| serving | batch | tok/s | speedup vs its plain |", "|---|---|---|---|"]
    for b in sizes:
        key = str(b)
        plain = results["lora plain"]["cells"][key]
        spec = results["lora specstream"]["cells"][key]
        lines.append(f"| LoRA deployment, plain | {b} | {plain:.2f} | 1.00x |")
        lines.append(f"| LoRA deployment, specstream | {b} | {spec:.2f} | {spec / plain:.2f}x |")
        for name in names:
            mp = results[f"merged {name} plain"]["cells"][key]
            ms = results[f"merged {name} specstream"]["cells"][key]
            lines.append(f"| merged {name}, plain | {b} | {mp:.2f} | 1.00x |")
            lines.append(f"| merged {name}, specstream | {b} | {ms:.2f} | {ms / mp:.2f}x |")
    same = results["lora plain"]["tokens"] == results["lora specstream"]["tokens"]
    lines += ["", f"LoRA deployment outputs identical with and without speculation: {same}"]
    # A streams-only adapter's LoRA changes nothing: its requests must get exactly the tokens
    # of its merged checkpoint (the base); a task LoRA merged into the weights rounds apart.
    for name in names:
        merged_tokens = results[f"merged {name} plain"]["tokens"]
        equal = all(results["lora plain"]["tokens"][j] == t for j, t in merged_tokens.items())
        lines.append(f"{name}: deployment outputs identical to its merged checkpoint's: {equal}")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi_lora.md").write_text(table + "\n")
    (out / "multi_lora.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
