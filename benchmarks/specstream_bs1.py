"""Plain vLLM vs speculative streaming on one merged checkpoint: batch 1, greedy, same prompts.

For each dtype, runs plain decoding and specstream with each stream placement (one engine
each, the same prompts one at a time) and prints output tokens/s (median over prompts), the
speedup over plain decoding of the same dtype and over the fastest plain run, vLLM's
tokens_per_step (1 + accepted drafts per drafting step) and whether outputs are identical.

    .venv/bin/python benchmarks/specstream_bs1.py CKPT [--task sql] [-n 20] [--k 4]
        [--dtypes float32,bfloat16] [--placements window,accepted] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bs1_child import emit_result, make_llm, run_child, task_prompts

from vllm_specstream.machine import describe_machine


def child(args: argparse.Namespace) -> None:
    from vllm import SamplingParams

    prompts = task_prompts(args.ckpt, args.task, args.n)
    llm = make_llm(args.ckpt, args.dtype, args.k, args.placement, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    before = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    rates, tokens, total_tokens, total_time = [], [], 0, 0.0
    for p in prompts:
        start = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        elapsed = time.perf_counter() - start
        rates.append(len(out.token_ids) / elapsed)
        tokens.append(list(out.token_ids))
        total_tokens += len(out.token_ids)
        total_time += elapsed
    after = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    d = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in after if "spec_decode" in k}
    drafts = d.get("vllm:spec_decode_num_drafts", 0)
    accepted = d.get("vllm:spec_decode_num_accepted_tokens", 0)
    emit_result(
        {
            "rates": rates,
            "tokens": tokens,
            "total_tokens": total_tokens,
            "total_time": total_time,
            "tokens_per_step": 1 + accepted / drafts if drafts else 1.0,
            "drafts": drafts,
        }
    )


def run(args: argparse.Namespace, k: int, dtype: str, placement: str | None) -> dict:
    argv = [args.ckpt, "--child", "--k", str(k), "--task", args.task, "-n", str(args.n)]
    argv += ["--max-tokens", str(args.max_tokens), "--dtype", dtype]
    return run_child(__file__, argv + (["--placement", placement] if placement else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("--task", default="sql")
    parser.add_argument("-n", type=int, default=20, help="test prompts")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--placements", default="window,accepted", help="comma-separated")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument("--placement", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for dtype in args.dtypes.split(","):
        plain = run(args, 0, dtype, None)
        rows.append({"dtype": dtype, "mode": "plain", **_summary(plain, plain)})
        for placement in args.placements.split(","):
            spec = run(args, args.k, dtype, placement)
            rows.append(
                {"dtype": dtype, "mode": f"specstream/{placement}", **_summary(spec, plain)}
            )
    best_plain = max(r["tok_s_median"] for r in rows if r["mode"] == "plain")
    for r in rows:
        r["speedup_vs_fastest_plain"] = round(r["tok_s_median"] / best_plain, 3)
    result = {
        "machine": describe_machine(),
        "checkpoint": args.ckpt,
        "setting": f"batch 1, greedy, max_tokens {args.max_tokens}, {args.n} {args.task} test "
        f"prompts, eager, num_speculative_tokens {args.k}",
        "rows": rows,
    }
    print(f"{'dtype':9} {'mode':22} {'tok/s':>7} {'speedup':>8} {'vs best':>8} {'tps':>6} lossless")
    for r in rows:
        print(
            f"{r['dtype']:9} {r['mode']:22} {r['tok_s_median']:7.2f} {r['speedup_median']:8.3f} "
            f"{r['speedup_vs_fastest_plain']:8.3f} {r['tokens_per_step']:6.3f} {r['lossless']}"
        )
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def _summary(run_: dict, plain: dict) -> dict:
    """Median tok/s, speedup over ``plain`` (same dtype), tokens_per_step, identical outputs."""
    med, med_plain = statistics.median(run_["rates"]), statistics.median(plain["rates"])
    return {
        "tok_s_median": round(med, 2),
        "speedup_median": round(med / med_plain, 3),
        "tok_s_total": round(run_["total_tokens"] / run_["total_time"], 2),
        "tokens_per_step": round(run_["tokens_per_step"], 3),
        "lossless": run_["tokens"] == plain["tokens"],
    }


if __name__ == "__main__":
    main()
