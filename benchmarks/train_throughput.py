"""Training throughput: padded batches recomputed every step vs packed rows with the frozen
prefix cached (``specstream train``'s default), same config, same batches, one run.

    .venv/bin/python benchmarks/train_throughput.py --task sql \\
        --data ../shared/data/spider/spider-dev-half.jsonl --steps 20

The two paths alternate step by step in one process (so load from elsewhere slows both
alike). Prints real (non-padding) training tokens/s of both, the speedup with and without
the one-off cache build, and the loss of every step side by side; --out writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def train_args(args, fast: bool):
    from vllm_specstream.base_model import prepare_base
    from vllm_specstream.checkpoint.config import SpecStreamConfig
    from vllm_specstream.training.args import TrainArgs
    from vllm_specstream.training.checkpoint import LoraSettings

    return TrainArgs(
        base=str(prepare_base(progress=False)),
        out=args.work_dir,
        task=args.task,
        data=args.data,
        objective=args.objective,
        spec=SpecStreamConfig(num_streams=4, num_msa_layers=args.num_msa_layers),
        lora=LoraSettings(rank=args.lora_rank, layers="msa"),
        steps=args.steps,
        batch_size=args.batch_size,
        lr=5e-4,
        max_length=args.max_length,
        dtype=args.dtype,
        pack=fast,
        frozen_prefix=fast,
    )


def paired_run(args) -> dict:
    """Both paths in one process, one step of each in turn, so that whatever else the
    machine does slows both alike."""
    from contextlib import nullcontext

    import torch
    from transformers import AutoTokenizer

    from vllm_specstream.training.batches import batch_maker, load_examples
    from vllm_specstream.training.data import encode_example
    from vllm_specstream.training.jobs import make_job
    from vllm_specstream.training.train import train_step

    paths = {}
    for name, fast in (("padded", False), ("fast", True)):
        targs = train_args(args, fast)
        tokenizer = AutoTokenizer.from_pretrained(targs.base)
        train_set = [
            encode_example(tokenizer, e, targs.max_length)
            for e in load_examples(targs, "train", None)
        ]
        torch.manual_seed(targs.seed)
        job = make_job(targs)
        job.model.train()
        optimizer = torch.optim.AdamW(job.param_groups(), betas=(0.9, 0.99))
        t0 = time.monotonic()
        # The run being projected decides whether the frozen prefix is cached (a run of a
        # few steps would skip it: caching every example would cost more than its steps).
        run = dataclasses.replace(targs, steps=max(args.project_steps, args.steps))
        make_batch = batch_maker(job, run, train_set, nullcontext)
        paths[name] = {
            "targs": targs,
            "job": job,
            "optimizer": optimizer,
            "base_lrs": [g["lr"] for g in optimizer.param_groups],
            "make_batch": make_batch,
            "n": len(train_set),
            "setup_s": time.monotonic() - t0,
            "step_s": [],
            "tokens": [],
            "loss": [],
        }
    for step in range(args.steps):
        for p in paths.values():
            t0 = time.perf_counter()
            totals, tokens = train_step(
                p["job"], p["optimizer"], p["base_lrs"], p["make_batch"], p["n"], p["targs"],
                step, nullcontext,
            )  # fmt: skip
            p["step_s"].append(time.perf_counter() - t0)
            p["tokens"].append(tokens)
            p["loss"].append(totals["loss"])
        print(
            f"step {step + 1}: padded {paths['padded']['step_s'][-1]:.1f} s, "
            f"fast {paths['fast']['step_s'][-1]:.1f} s",
            flush=True,
        )
    return {
        name: {
            "setup_s": round(p["setup_s"], 1),
            "train_s": round(sum(p["step_s"]), 1),
            "step_s_median": statistics.median(p["step_s"]),
            "real_tokens": sum(p["tokens"]),
            "loss": p["loss"],
        }
        for name, p in paths.items()
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
    p.add_argument("--objective", default="specstream", choices=["specstream", "ntp", "medusa"])
    p.add_argument("--project-steps", type=int, default=600, help="run length to project to")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    # Where the fast path keeps its frozen-prefix cache while the benchmark runs.
    args.work_dir = tempfile.mkdtemp(prefix="specstream-train-throughput-")
    from vllm_specstream.logger import configure_cli_logging

    configure_cli_logging("WARNING")
    try:
        runs = paired_run(args)
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    slow, fast = runs["padded"], runs["fast"]
    gap = max(abs(a - b) / max(abs(a), 1e-9) for a, b in zip(slow["loss"], fast["loss"]))
    tokens = slow["real_tokens"]  # the same batches: the same real tokens
    result = {
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, torch threads {torch_threads()}",
        "config": {k: v for k, v in vars(args).items() if k != "work_dir"},
        **runs,
        "tokens_per_s": {k: tokens / r["train_s"] for k, r in runs.items()},
        "speedup": slow["train_s"] / fast["train_s"],
        "speedup_with_setup": (slow["train_s"] + slow["setup_s"])
        / (fast["train_s"] + fast["setup_s"]),
        "max_rel_loss_gap": gap,
    }
    n = args.project_steps
    result[f"speedup_projected_{n}_steps"] = (n * slow["step_s_median"]) / (
        n * fast["step_s_median"] + fast["setup_s"]
    )
    print(f"machine: {result['machine']}")
    print(f"{'path':<8}{'tok/s':>8}{'step s (median)':>17}{'setup s':>9}")
    for name, r in runs.items():
        print(
            f"{name:<8}{result['tokens_per_s'][name]:>8.0f}{r['step_s_median']:>17.2f}"
            f"{r['setup_s']:>9.1f}"
        )
    print(
        f"speedup {result['speedup']:.2f}x ({result['speedup_with_setup']:.2f}x counting the "
        f"one-off cache build over these {args.steps} steps, "
        f"{result[f'speedup_projected_{n}_steps']:.2f}x over {n}); largest relative loss gap: "
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
