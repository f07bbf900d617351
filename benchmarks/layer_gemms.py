"""What a window step's extra rows cost in the decoder layers' matmuls, by row count.

A batch-1 window step with ``k`` drafts runs ``k + 1`` main rows through every layer and,
in the top ``num_msa_layers`` layers, ``(k + 1) k`` stream rows beside them (4 drafts: 5 and
25 rows). Times vLLM's CPU matmul (oneDNN, as the decoder's projections run) over the four
projections of every layer of a model of the given shape, the layers' weights cycling
through memory as in a forward (random weights: the time depends on the shapes only), and
prints the median ms per forward for each row count and what the rows beyond the first
cost. Where the extra rows cost in proportion to their number the matmuls are bound by
arithmetic, not by reading the weights.

    .venv/bin/python benchmarks/layer_gemms.py [--threads 1] [--rows 1,2,5,10,25]
        [--layers 30 --hidden 576 --intermediate 1536 --heads 9 --kv-heads 3]
"""

from __future__ import annotations

import argparse

import torch
from stream_logits import median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch/oneDNN threads")
    parser.add_argument("--rows", default="1,2,5,10,25", help="rows per matmul call")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7, help="forwards timed per row count")
    args = parser.parse_args()

    from vllm import _custom_ops as ops

    from vllm_specstream.machine import describe_machine

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, head_dim = args.hidden, args.hidden // args.heads
    # (out, in) of qkv_proj, o_proj, gate_up_proj, down_proj, as vLLM fuses them.
    shapes = [
        (h + 2 * args.kv_heads * head_dim, h),
        (h, h),
        (2 * args.intermediate, h),
        (h, args.intermediate),
    ]
    layers = [
        [ops.create_onednn_mm((torch.randn(o, i) * 0.02).t(), 32) for o, i in shapes]
        for _ in range(args.layers)
    ]
    flops_per_row = 2 * args.layers * sum(o * i for o, i in shapes)

    def forward_ms(rows: int) -> float:
        xs = [torch.randn(rows, i) for _, i in shapes]

        def forward() -> None:
            for layer in layers:
                for handle, x in zip(layer, xs):
                    ops.onednn_mm(handle, x, None)

        return median_ms(forward, args.repeats)

    print(describe_machine())
    print(
        f"{args.layers} layers x 4 projections (hidden {h}, intermediate {args.intermediate}), "
        f"fp32, {args.threads} thread(s), median of {args.repeats} forwards"
    )
    print("| rows | ms per forward | ms per row beyond the first | GFLOP/s |")
    print("|---|---|---|---|")
    one = None
    for rows in map(int, args.rows.split(",")):
        ms = forward_ms(rows)
        one = ms if one is None else one
        extra = f"{(ms - one) / (rows - 1):.2f}" if rows > 1 else "-"
        print(f"| {rows} | {ms:.1f} | {extra} | {flops_per_row * rows / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
