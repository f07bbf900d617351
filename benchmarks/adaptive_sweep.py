"""Where speculation stops paying: specstream speedup by batch size and draft length.

Runs plain decoding and specstream with a fixed draft length k (adaptive policy off) for
each k, on one merged checkpoint, greedy, the same prompts, and prints the speedup table
and the batch-size schedule it suggests (the longest-paying k per batch size; 0 where no
k beats plain by more than ``--margin``): a fixed schedule for
``num_speculative_tokens_per_batch_size``, where a user wants one instead of the adaptive policy.

    .venv/bin/python benchmarks/adaptive_sweep.py CKPT [--ks 1,2,4] [--batch-sizes 1,2,4,8,12,16]
        [-n 16] [--repeats 2] [--out DIR]

Plain decoding runs first and last; speedups are against the mean of the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from vllm_specstream.bench import BenchConfig, run_method
from vllm_specstream.machine import describe_machine


def suggest_schedule(speedups: dict[int, dict[int, float]], margin: float) -> list[tuple]:
    """``(first, last, k)`` ranges: per batch size the best k if it beats plain by ``margin``."""
    best = {}
    for b in sorted(next(iter(speedups.values()))):
        k, s = max(((k, row[b]) for k, row in speedups.items()), key=lambda x: x[1])
        best[b] = k if s > 1 + margin else 0
    ranges, sizes = [], sorted(best)
    for i, b in enumerate(sizes):
        last = sizes[i + 1] - 1 if i + 1 < len(sizes) else 1 << 16
        if ranges and ranges[-1][2] == best[b]:
            ranges[-1] = (ranges[-1][0], last, best[b])
        else:
            ranges.append((b if ranges else 1, last, best[b]))
    return ranges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--batch-sizes", default="1,2,4,8,12,16")
    parser.add_argument("-n", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--margin", type=float, default=0.03, help="speedup that counts as a win")
    parser.add_argument("--out", default="bench-results/adaptive")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    sizes = tuple(int(x) for x in args.batch_sizes.split(","))

    def cells(method: str, k: int) -> dict[int, dict]:
        cfg = BenchConfig(
            checkpoint=args.checkpoint,
            out_dir=args.out,
            methods=("plain", method),
            num_prompts=args.n,
            batch_sizes=sizes,
            temperatures=(0.0,),
            num_speculative_tokens=k,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            specstream_options={"adaptive": False},
        )
        print(f"running {method} k={k}", flush=True)
        return {c["batch_size"]: c for c in run_method(method, cfg)["cells"]}

    # Plain runs first and last: the speedups are against the mean of both, which evens out
    # a machine that drifts while the sweep runs.
    plain = cells("plain", 1)
    spec_runs = {int(k): cells("specstream", int(k)) for k in args.ks.split(",")}
    plain_again = cells("plain", 1)
    plain_rates = {
        b: (statistics.median(plain[b]["rates"]) + statistics.median(plain_again[b]["rates"])) / 2
        for b in sizes
    }
    speedups: dict[int, dict[int, float]] = {}
    for k, spec in spec_runs.items():
        speedups[k] = {}
        for b in sizes:
            assert spec[b]["tokens"] == plain[b]["tokens"], f"k={k} batch {b}: not lossless"
            speedups[k][b] = statistics.median(spec[b]["rates"]) / plain_rates[b]
    print(f"\nMachine: {describe_machine()}\nspeedup of specstream (fixed k) over plain, greedy")
    print("| k | " + " | ".join(f"bs {b}" for b in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    print("| plain tok/s | " + " | ".join(f"{plain_rates[b]:.1f}" for b in sizes) + " |")
    for k, row in speedups.items():
        print(f"| {k} | " + " | ".join(f"{row[b]:.2f}x" for b in sizes) + " |")
    schedule = suggest_schedule(speedups, args.margin)
    print(f"\nsuggested num_speculative_tokens_per_batch_size: {schedule}")
    report = {
        "machine": describe_machine(),
        "plain_tok_s": plain_rates,
        "speedups": speedups,
        "schedule": schedule,
    }
    (Path(args.out) / "adaptive.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
