"""Cost of a specstream decode step relative to a plain one, by batch size and draft length.

Runs ``profile_step.py`` once per draft length k (plain first and last, so drift shows), on
the same prompts, ``--rounds`` times, and divides each median decode-step time by plain's at
the same batch size. Other work on the machine only ever adds time (on a 2-core VM a busy
second core slows a step up to 2x), so each cell keeps its fastest round. The ratios are what ``vllm_specstream.step_cost`` keeps per CPU class: the adaptive
policy weighs them against the tokens a step is expected to yield.

    .venv/bin/python benchmarks/step_cost.py CKPT [--ks 1,2,3,4] [--batch-sizes 1,4,8,16,32]
        [--task sql --data FILE] [--out benchmarks/results/step-cost]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_specstream.machine import cpu_class, describe_machine

STEP = "decode step (execute_model + sample_tokens)"


def measure(args, k: int, tmp: Path) -> dict:
    out = tmp / f"k{k}-{len(list(tmp.iterdir()))}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("profile_step.py")),
        args.checkpoint,
        "--k",
        str(k),
        "-n",
        str(args.n),
        "--batch-sizes",
        args.batch_sizes,
        "--max-tokens",
        str(args.max_tokens),
        "--task",
        args.task,
        "--json",
        str(out),
    ]
    if args.data:
        cmd += ["--data", args.data]
    if args.placement and k:
        cmd += ["--placement", args.placement]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0", **os.environ}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    return {int(b): cell["median_ms"][STEP] for b, cell in report["batch_sizes"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="merged specstream checkpoint")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--batch-sizes", default="1,4,8,16,32")
    ap.add_argument("-n", type=int, default=2, help="batches per batch size")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--task", default="sql")
    ap.add_argument("--data", help="task file whose validation split gives the prompts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--placement", help="window or accepted (default: the proposer's)")
    ap.add_argument("--out", default="benchmarks/results/step-cost")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    runs: dict[int, list[dict[int, float]]] = {k: [] for k in [0, *ks]}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for k in [0, *ks, 0]:
                runs[k].append(measure(args, k, Path(tmp)))
    sizes = sorted(runs[0][0])
    fastest = {k: {b: min(r[b] for r in rs) for b in sizes} for k, rs in runs.items()}
    ratios = {k: [round(fastest[k][b] / fastest[0][b], 3) for b in sizes] for k in ks}
    report = {
        "machine": describe_machine(),
        "cpu_class": cpu_class(),
        "placement": args.placement or "default",
        "checkpoint": args.checkpoint,
        "prompts": f"{args.task} {args.data or 'synthetic'}",
        "batch_sizes": sizes,
        "median_ms_per_run": {
            k: {b: [round(r[b], 1) for r in rs] for b in sizes} for k, rs in runs.items()
        },
        "ratios": ratios,
    }
    print(f"{report['machine']} ({report['cpu_class']})")
    plain = report["median_ms_per_run"][0]
    print("plain ms/step (each run): " + ", ".join(f"{b}: {plain[b]}" for b in sizes))
    print("step cost / plain, by batch size: " + " ".join(f"{b:>6d}" for b in sizes))
    for k in ks:
        print(f"  k = {k}{'':32s}" + " ".join(f"{r:6.2f}" for r in ratios[k]))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.placement}" if args.placement else ""
    path = Path(args.out) / f"{report['cpu_class']}{suffix}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
