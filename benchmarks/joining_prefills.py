"""Requests joining a window engine that drafts: their prefills with the window streams the
proposer chose for the smaller batch before them (the rule before), against the streams the
policy would choose at the forward's own batch size (``window_streams_at``), in one engine.

The engine runs the default adaptive policy. Each trial serves one request alone (at batch 1
the policy drafts from the window, so the next forward's streams are on), then the batch,
once with each rule, the order alternating between trials (``--window-on``: 4 window streams
set before the batch, as a window run at batch 1 leaves them). Prints the median time to first
token over the batch's requests and the batch's wall time per rule, and the medians over
trials; outputs must be identical.

    .venv/bin/python benchmarks/joining_prefills.py CKPT --task e2e --data FILE [--split val]
        [--batch-size 16] [--max-tokens 16] [--trials 6] [--window-on]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bs1_child import adaptive_engine_here, add_task_data_args
from profile_step import preload_iomp_and_reexec

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the rule is set in-process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_task_data_args(p)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--trials", type=int, default=6)
    p.add_argument(
        "--window-on",
        action="store_true",
        help="set 4 window streams before each batch, as a lone request's window run leaves "
        "them (else the batch gets what the lone request's last step chose)",
    )
    a = p.parse_args()
    preload_iomp_and_reexec()

    from vllm import SamplingParams

    from vllm_specstream.machine import describe_machine

    llm, proposer, prompts = adaptive_engine_here(
        a, a.batch_size + 1, max_num_seqs=a.batch_size, disable_log_stats=False
    )
    alone, batch = prompts[:1], prompts[1 : a.batch_size + 1]
    model = proposer.target
    rules = {"streams chosen before": None, "at the forward's size": proposer.window_streams_at}
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    for _ in range(2):  # warm-up: the policy times its steps at both sizes
        llm.generate(alone, params, use_tqdm=False)
        llm.generate(batch, params, use_tqdm=False)
    ttft: dict[str, list[float]] = {name: [] for name in rules}
    wall: dict[str, list[float]] = {name: [] for name in rules}
    outputs: dict[str, list] = {}
    for trial in range(a.trials):
        for name in list(rules)[:: 1 if trial % 2 == 0 else -1]:
            model.window_streams_at = rules[name]
            llm.generate(alone, params, use_tqdm=False)
            ran = model.window_streams
            if a.window_on:  # as if the lone request's last step chose 4 window drafts
                model.window_streams, model.window_streams_batch = 4, 1
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            wall[name].append(time.perf_counter() - start)
            ttft[name].append(1e3 * statistics.median(o.metrics.first_token_latency for o in outs))
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            if outputs.setdefault(name, tokens) != tokens:
                raise SystemExit("outputs differ between trials")
            if trial == 0:
                print(f"{name}: the lone request left {ran} window streams", flush=True)
    model.window_streams_at = proposer.window_streams_at
    if len({json.dumps(t) for t in outputs.values()}) != 1:
        raise SystemExit("the two rules' outputs differ")
    print(f"\n{describe_machine()}; {a.task}, batch {a.batch_size}, {a.trials} trials")
    for name in rules:
        print(
            f"  {name:24s} median TTFT {statistics.median(ttft[name]):7.1f} ms "
            f"{[round(v) for v in ttft[name]]}; batch {statistics.median(wall[name]):.2f} s"
        )
    print("RESULT " + json.dumps({"ttft_ms": ttft, "wall_s": wall}))


if __name__ == "__main__":
    main()
