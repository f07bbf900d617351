"""What the adaptive policy's choice costs a step, in Python time (no engine).

Builds the policy a window engine gets (chains of 1-4 drafts in the window and at the anchors,
the AVX2 tables, step times measured as they come), feeds it a stream of steps at one batch
size (each step: the choice, the drafts verified at ``--accept`` per draft, the step time
recorded) and times what a proposer call spends choosing: the choice itself, and in a step
that drafts nothing, the second pricing under the prior. Prints the median ms per step and
how many steps got each choice (the same choices before and after a change of the pricing
code say it changed nothing but the time).

    .venv/bin/python benchmarks/policy_pricing.py [--batch-sizes 1,4] [--steps 400]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from vllm_specstream.policy import AcceptanceStats, AnchoredChain, DraftPolicy, MeasuredCost
from vllm_specstream.step_cost import table_for


def window_policy(k_max: int = 4) -> DraftPolicy:
    policy = DraftPolicy(k_max, None, AcceptanceStats(k_max))
    policy.anchored = tuple(AnchoredChain(k) for k in range(1, k_max + 1))
    policy.cost = MeasuredCost(
        table_for("window", "avx2"), anchored_table=table_for("accepted", "avx2")
    )
    return policy


def run(batch_size: int, steps: int, accept: float, seed: int = 0) -> tuple[float, dict]:
    rng = random.Random(seed)
    policy = window_policy()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        k = policy.draft_length(batch_size)
        times.append(time.perf_counter() - start)
        n = k.k if isinstance(k, AnchoredChain) else k
        drafts = [[1] * n] * batch_size
        policy.stats.record_proposed(drafts)
        kept = []
        for d in drafts:
            accepted = 0
            while accepted < len(d) and rng.random() < accept:
                accepted += 1
            kept.append([1] * (1 + accepted))
        policy.stats.record_verified(kept)
        cost = 1.0 if n == 0 else 1.3 + 0.15 * n
        policy.cost.record(batch_size, k, 0.05 * cost * (1 + 0.1 * rng.random()))
    return statistics.median(times) * 1e3, {str(c): m for c, m in policy.decisions.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--accept", type=float, default=0.7, help="P(a draft is accepted)")
    args = ap.parse_args()
    for b in (int(x) for x in args.batch_sizes.split(",")):
        ms, decisions = run(b, args.steps, args.accept)
        print(f"batch {b}: {ms:.3f} ms per step choosing; choices {decisions}")


if __name__ == "__main__":
    main()
