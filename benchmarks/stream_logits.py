"""What the streams' LM head costs a window step, riding along the main rows or on its own.

A window step of ``b`` requests drafting ``k`` tokens each samples ``b (k + 1)`` main rows and
runs ``k`` streams at each of the ``k + 1`` window positions: ``b (k + 1) k`` stream rows.
Riding along, they all go through the LM head in the main rows' call; on their own, only
the ``b k`` rows at the anchors the proposer reads do, in a second call that reads the head
again. Times vLLM's CPU matmul (oneDNN, as its LM head runs) for both, on an LM head of the
given shape (random weights: the time depends on the shape only), and prints the median ms
of the main rows' call and what each way adds to it.

    .venv/bin/python benchmarks/stream_logits.py [--threads 1] [--vocab 49152 --hidden 576]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch/oneDNN threads")
    parser.add_argument("--vocab", type=int, default=49152, help="LM head rows (tokens)")
    parser.add_argument("--hidden", type=int, default=576, help="hidden size")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--ks", default="1,2,3,4", help="drafts per request")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from vllm import _custom_ops as ops

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    head = ops.create_onednn_mm(torch.randn(args.vocab, args.hidden).t(), 32)

    def logits_ms(rows: int) -> float:
        x = torch.randn(rows, args.hidden)
        return median_ms(lambda: ops.onednn_mm(head, x, None), args.repeats)

    print(f"LM head {args.vocab} x {args.hidden}, fp32, {args.threads} thread(s)")
    print("| batch | k | main rows ms | stream rows riding along | + ms | at the anchors | + ms |")
    print("|---|---|---|---|---|---|---|")
    for b in map(int, args.batch_sizes.split(",")):
        for k in map(int, args.ks.split(",")):
            main_rows, window_rows, anchor_rows = b * (k + 1), b * (k + 1) * k, b * k
            main = logits_ms(main_rows)
            fused = logits_ms(main_rows + window_rows) - main
            alone = logits_ms(anchor_rows)
            print(
                f"| {b} | {k} | {main:.1f} | {window_rows} | {fused:.1f} | {anchor_rows} "
                f"| {alone:.1f} |"
            )


if __name__ == "__main__":
    main()
