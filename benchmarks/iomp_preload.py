"""Does preloading Intel OpenMP (libiomp5) speed up vLLM's CPU decode? Plain vLLM, batch 1.

Runs the same greedy generations in two engine processes, one with the venv's
``libiomp5.so`` in ``LD_PRELOAD`` (what vllm-specstream gives its engines) and one with
vLLM's default (PyTorch's GNU OpenMP), alternating, and prints median output tokens/s of each and their ratio.

    .venv/bin/python benchmarks/iomp_preload.py [--repeats 5] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from vllm_specstream.machine import describe_machine

PROMPTS = [
    "Write a SQL query that lists the names of employees hired after 2020.",
    "Write a Python function that reverses a string.",
]


def child(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    from vllm_specstream.base_model import prepare_base
    from vllm_specstream.patches.cpu_env import cpu_engine_kwargs

    llm = LLM(model=str(prepare_base(progress=False)), **cpu_engine_kwargs())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    llm.chat(conversations[:1], params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(args.repeats):
        for conversation in conversations:
            start = time.perf_counter()
            out = llm.chat([conversation], params, use_tqdm=False)[0].outputs[0]
            rates.append(len(out.token_ids) / (time.perf_counter() - start))
    line = json.dumps({"rates": rates, "ld_preload": os.environ.get("LD_PRELOAD", "")})
    sys.stdout.write("RESULT " + line + "\n")  # one write: vLLM's threads share stdout


def run_variant(preload: bool, args: argparse.Namespace) -> list[float]:
    from vllm_specstream.patches.cpu_env import find_iomp

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = str(find_iomp())
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--repeats",
        str(args.repeats),
        "--max-tokens",
        str(args.max_tokens),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])["rates"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="engine starts per variant")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rates: dict[str, list[float]] = {"gomp": [], "iomp": []}
    for _ in range(args.rounds):  # alternate so drift on a shared VM hits both
        rates["gomp"] += run_variant(False, args)
        rates["iomp"] += run_variant(True, args)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"machine: {describe_machine()}; "
        f"plain vLLM, batch 1, {args.max_tokens} greedy tokens (ignore_eos), "
        f"{len(PROMPTS)} chat prompts x {args.repeats} repeats x {args.rounds} engine starts"
    )
    for k, v in rates.items():
        print(f"{k}: median {med[k]:.2f} tok/s (min {min(v):.2f}, max {max(v):.2f}, n={len(v)})")
    print(f"ratio iomp/gomp: {med['iomp'] / med['gomp']:.3f}")


if __name__ == "__main__":
    main()
