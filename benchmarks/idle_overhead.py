"""What a specstream engine costs on steps that draft nothing, against plain vLLM.

Runs, on one merged checkpoint and the same prompts: plain decoding, specstream with a
schedule that drafts nothing past batch 1 (``num_speculative_tokens_per_batch_size``
``[(1, 1, 4), (2, 65536, 0)]``: the proposer, the stash and the policy's bookkeeping run at
every step, the streams only at prefill), the adaptive specstream engine, and plain again;
prints tok/s, decoding ms per output token and the drafts vLLM counted per batch size, and
each engine's speedup over the mean of the two plain runs.

    .venv/bin/python benchmarks/idle_overhead.py CKPT --task e2e --data FILE [--split val]
        [-n 16] [--batch-sizes 4,16] [--max-tokens 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bs1_child import add_task_data_args, task_data_fields

from vllm_specstream.bench import BenchConfig, run_method
from vllm_specstream.machine import describe_machine

IDLE = {"num_speculative_tokens_per_batch_size": [(1, 1, 4), (2, 65536, 0)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_task_data_args(p)
    p.add_argument("-n", type=int, default=16)
    p.add_argument("--batch-sizes", default="4,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="idle-overhead")
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    base = dict(
        **task_data_fields(a),
        out_dir=a.out,
        num_prompts=a.n,
        batch_sizes=tuple(int(b) for b in a.batch_sizes.split(",")),
        temperatures=(0.0,),
        max_tokens=a.max_tokens,
        repeats=2,
        omp_threads_bind="nobind",
    )
    runs = [("plain", {}), ("specstream-idle", IDLE), ("specstream", {}), ("plain", {})]
    rows = []
    for label, options in runs:
        method = label.removesuffix("-idle")
        result = run_method(
            method, BenchConfig(methods=(method,), specstream_options=options, **base)
        )
        cells = {
            c["batch_size"]: {
                "tok_s": statistics.median(c["rates"]),
                "tpot_ms": 1e3 * statistics.median(c["tpot_s"]),
                "drafts": c["drafts"],
            }
            for c in result["cells"]
        }
        rows.append({"engine": label, "cells": cells})
        print(label, json.dumps(cells), flush=True)
    plain = [r for r in rows if r["engine"] == "plain"]
    for r in rows[1:-1]:
        for b, c in r["cells"].items():
            ref = statistics.mean(p["cells"][b]["tok_s"] for p in plain)
            print(f"{r['engine']:>16} batch {b}: {c['tok_s'] / ref:.2f}x plain "
                  f"({c['drafts']:.0f} drafts)")  # fmt: skip
    machine = describe_machine()
    print(machine)
    out = {"machine": machine, "checkpoint": a.checkpoint, "runs": rows}
    (Path(a.out) / "idle_overhead.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
