"""Batch 1, plain vLLM vs specstream: how a request's time splits into prefill and decoding.

Speculation only shortens decoding; the prefill (and the engine's per-request overhead) is
the same for both and bounds the end-to-end speedup when outputs are short (SQL queries end
after ~15-60 tokens). For each prompt, one at a time, greedy: the time to the first token
(a ``max_tokens=1`` request) and the time of the whole request. Prints medians of prompt and
output tokens, time to first token, decoding ms per output token after the first, and the
speedups end to end and of decoding alone.

    .venv/bin/python benchmarks/latency_split.py CKPT [--task sql] [-n 16] [--k 4] [--json OUT]
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
    llm = make_llm(args.ckpt, args.dtype, args.k)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    whole = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], whole, use_tqdm=False)  # warm-up
    rows = []
    for p in prompts:
        start = time.perf_counter()
        llm.generate([p], first, use_tqdm=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = llm.generate([p], whole, use_tqdm=False)[0]
        total = time.perf_counter() - start
        rows.append(
            {
                "prompt_tokens": len(out.prompt_token_ids),
                "output_tokens": len(out.outputs[0].token_ids),
                "ttft_s": ttft,
                "total_s": total,
                "tokens": list(out.outputs[0].token_ids),
            }
        )
    emit_result(rows)


def run(args: argparse.Namespace, k: int) -> list[dict]:
    argv = [args.ckpt, "--child", "--k", str(k), "--task", args.task, "-n", str(args.n)]
    argv += ["--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
    return run_child(__file__, argv)


def summary(rows: list[dict]) -> dict:
    """Medians per request; decoding = the time after the first token, per further token."""
    decode = [
        (r["total_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
        for r in rows
        if r["output_tokens"] > 1
    ]
    return {
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
        "output_tokens": statistics.median(r["output_tokens"] for r in rows),
        "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in rows),
        "decode_ms_per_token": 1e3 * statistics.median(decode),
        "request_s": statistics.median(r["total_s"] for r in rows),
        "tok_s": statistics.median(r["output_tokens"] / r["total_s"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("--task", default="sql")
    parser.add_argument("-n", type=int, default=16, help="test prompts")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    plain_rows, spec_rows = run(args, 0), run(args, args.k)
    plain, spec = summary(plain_rows), summary(spec_rows)
    result = {
        "machine": describe_machine(),
        "checkpoint": args.ckpt,
        "setting": f"batch 1, greedy, {args.n} {args.task} test prompts one at a time, "
        f"max_tokens {args.max_tokens}, {args.dtype}, eager, k {args.k}",
        "plain": plain,
        "specstream": spec,
        "speedup_end_to_end": spec["tok_s"] / plain["tok_s"],
        "speedup_decoding": plain["decode_ms_per_token"] / spec["decode_ms_per_token"],
        "prefill_share_of_specstream_request": spec["ttft_ms"] / 1e3 / spec["request_s"],
        "lossless": [r["tokens"] for r in plain_rows] == [r["tokens"] for r in spec_rows],
    }
    print(f"{result['machine']}\n{result['setting']}\n")
    print(f"{'':11} {'prompt':>6} {'output':>6} {'TTFT ms':>8} {'ms/token':>9} {'tok/s':>6}")
    for name, s in (("plain", plain), ("specstream", spec)):
        print(
            f"{name:11} {s['prompt_tokens']:6.0f} {s['output_tokens']:6.1f} {s['ttft_ms']:8.0f} "
            f"{s['decode_ms_per_token']:9.1f} {s['tok_s']:6.2f}"
        )
    print(
        f"\nspeedup end to end {result['speedup_end_to_end']:.2f}x, decoding alone "
        f"{result['speedup_decoding']:.2f}x; the first token is "
        f"{100 * result['prefill_share_of_specstream_request']:.0f}% of a specstream request; "
        f"identical outputs: {result['lossless']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
