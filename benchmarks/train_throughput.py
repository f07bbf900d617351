"""Training throughput: padded batches recomputed every step vs packed rows with the frozen
prefix cached (``specstream train``'s default), same config, same batches, one run.

    .venv/bin/python benchmarks/train_throughput.py --task sql \\
        --data ../shared/data/spider/spider-dev-half.jsonl --steps 20

Prints real (non-padding) training tokens/s of both paths, the speedup with and without the
one-off cache build, and the loss of every step side by side; writes them as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def run(args, fast: bool, out: Path) -> dict:
    from vllm_specstream.base_model import prepare_base
    from vllm_specstream.config import SpecStreamConfig
    from vllm_specstream.training.checkpoint import LoraSettings
    from vllm_specstream.training.train import TrainArgs, train

    targs = TrainArgs(
        base=str(prepare_base(progress=False)),
        out=str(out),
        task=args.task,
        data=args.data,
        spec=SpecStreamConfig(num_streams=4, num_msa_layers=args.num_msa_layers),
        lora=LoraSettings(rank=args.lora_rank, layers="msa"),
        steps=args.steps,
        batch_size=args.batch_size,
        lr=5e-4,
        max_length=args.max_length,
        num_eval=0,
        eval_every=10**9,
        save_every=10**9,
        dtype=args.dtype,
        pack=fast,
        frozen_prefix=fast,
    )
    t0 = time.monotonic()
    train(targs, progress=False)
    total = time.monotonic() - t0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    loop = log[-1]["elapsed_s"]
    # Steady state: skip the first steps (allocator and oneDNN warm-up).
    skip = min(2, len(log) - 1)
    steady_tokens = sum(r["tokens"] for r in log[skip:])
    steady_s = loop - log[skip - 1]["elapsed_s"] if skip else loop
    return {
        "path": "packed+frozen-prefix" if fast else "padded",
        "steps": len(log),
        "tokens": sum(r["tokens"] for r in log),
        "loop_s": loop,
        "total_s": round(total, 1),
        "tokens_per_s": steady_tokens / steady_s,
        "step_s_median": statistics.median(
            b["elapsed_s"] - a["elapsed_s"] for a, b in zip(log, log[1:])
        ),
        "loss": [r["loss"] for r in log],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="sql")
    p.add_argument("--data", help="task file (default: the synthetic task)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--num-msa-layers", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    from vllm_specstream.logger import configure_cli_logging

    configure_cli_logging("WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        slow = run(args, False, Path(tmp) / "padded")
        fast = run(args, True, Path(tmp) / "fast")
    gap = max(abs(a - b) / max(abs(a), 1e-9) for a, b in zip(slow["loss"], fast["loss"]))
    result = {
        "machine": f"{cpu_name()}, {__import__('os').cpu_count()} cores",
        "config": vars(args),
        "padded": slow,
        "fast": fast,
        "speedup_steady": fast["tokens_per_s"] / slow["tokens_per_s"],
        "speedup_total": slow["total_s"] / fast["total_s"],
        "max_rel_loss_gap": gap,
    }
    print(f"machine: {result['machine']}")
    print(f"{'path':<22}{'tok/s':>9}{'step s':>9}{'total s':>9}")
    for r in (slow, fast):
        print(
            f"{r['path']:<22}{r['tokens_per_s']:>9.0f}{r['step_s_median']:>9.2f}{r['total_s']:>9.1f}"
        )
    print(
        f"speedup: {result['speedup_steady']:.2f}x steady, {result['speedup_total']:.2f}x "
        f"including the cache build; largest relative loss gap over {len(slow['loss'])} steps: "
        f"{gap:.1e}"
    )
    print("step  loss padded  loss fast")
    for i, (a, b) in enumerate(zip(slow["loss"], fast["loss"]), start=1):
        print(f"{i:>4}  {a:>11.5f}  {b:>9.5f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
