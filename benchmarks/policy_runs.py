"""Batch 1: a window entry's extra cost spread over the run of drafting steps (the policy's
rule) against priced whole at every step (``max_run_horizon = 1``, the rule before), in one
engine.

The engine runs the default adaptive policy. Each prompt is served once under each rule,
back to back, the order alternating from prompt to prompt and between trials, so that the
two rules are compared seconds apart on the same engine (the policy's timings and
acceptance estimate are shared: what differs is the choice). Outputs must be identical
(greedy). Prints per trial each rule's tokens per second and the ratio, the medians over
trials, and how often each rule chose each draft length.

    .venv/bin/python benchmarks/policy_runs.py CKPT --task sql --data FILE [--split val]
        [-n 16] [--max-tokens 96] [--trials 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter

from bs1_child import adaptive_engine_here, add_task_data_args
from profile_step import preload_iomp_and_reexec

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the rule is set in-process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

RULES = {"spread over the run": None, "whole at every step": 1.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_task_data_args(p)
    p.add_argument("-n", type=int, default=16, help="prompts")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--json", help="write the per-trial figures here")
    a = p.parse_args()
    preload_iomp_and_reexec()

    from vllm import SamplingParams

    from vllm_specstream.machine import describe_machine

    llm, proposer, prompts = adaptive_engine_here(a, a.n)
    policy = proposer.policy
    spread = policy.max_run_horizon
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    llm.generate(prompts[:1], params, use_tqdm=False)

    trials = []
    for trial in range(a.trials):
        seconds, tokens = Counter(), Counter()
        choices: dict[str, Counter] = {rule: Counter() for rule in RULES}
        for i, prompt in enumerate(prompts):
            order = list(RULES) if (i + trial) % 2 == 0 else list(RULES)[::-1]
            outputs = {}
            for rule in order:
                policy.max_run_horizon = RULES[rule] or spread
                before = Counter({str(k): n for k, n in policy.decisions.items()})
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
                seconds[rule] += time.perf_counter() - start
                tokens[rule] += len(out.token_ids)
                outputs[rule] = list(out.token_ids)
                after = Counter({str(k): n for k, n in policy.decisions.items()})
                choices[rule].update(after - before)
            if len(set(map(tuple, outputs.values()))) != 1:
                raise SystemExit(f"prompt {i}: the two rules' outputs differ")
        tps = {rule: tokens[rule] / seconds[rule] for rule in RULES}
        new, old = RULES
        trials.append({"tok_s": tps, "ratio": tps[new] / tps[old], "choices": choices})
        print(
            f"trial {trial}: "
            + ", ".join(f"{rule} {tps[rule]:.2f} tok/s" for rule in RULES)
            + f"; ratio {trials[-1]['ratio']:.3f}",
            flush=True,
        )
    machine = describe_machine()
    print(f"\n{machine}; {a.task} {a.split}, {len(prompts)} prompts, {a.max_tokens} tokens")
    for rule in RULES:
        tps = statistics.median(t["tok_s"][rule] for t in trials)
        chosen = sum((t["choices"][rule] for t in trials), Counter())
        print(f"{rule}: median {tps:.2f} tok/s; steps by choice {dict(chosen)}")
    print(f"ratio (spread / whole): median {statistics.median(t['ratio'] for t in trials):.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine, "args": vars(a), "trials": trials}, f, indent=1)


if __name__ == "__main__":
    main()
