"""Time to first token of a batch of prefills in a window engine: the window streams at one
anchor per prefill (``last_window_anchors``) against ``k + 1`` anchor columns per request of
which all but the last are padding (the anchors before that change), in one engine.

The engine drafts 4 at every step (so the streams ride along every prefill); each trial
serves one short request (which leaves the window streams on) and then the batch, once with
each anchor rule, the order alternating between trials: the two rules are compared seconds
apart, on the same engine. Prints the median TTFT over the batch's requests per trial and
the median over trials.

    .venv/bin/python benchmarks/prefill_anchors.py CKPT --task e2e --data FILE [--split val]
        [--batch-size 16] [--trials 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bs1_child import add_task_data_args, task_data_fields

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the rule is swapped in-process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def padded_anchors(batch, max_anchors: int):
    """The rule before: a prefill keeps its last anchor in the last of ``max_anchors``
    columns, the others padding (each padded anchor still ran its stream rows)."""
    from vllm_specstream.model_executor.stream_forward import window_anchors

    anchors = window_anchors(batch, max_anchors)
    qsl = batch.query_start_loc
    long = (qsl[1:] - qsl[:-1]) > max_anchors
    if anchors.numel() and bool(long.any()):
        anchors[long, :-1] = -1
    return anchors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_task_data_args(p)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--trials", type=int, default=6)
    a = p.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_specstream import speculative_config
    from vllm_specstream.bench import BenchConfig, load_prompts
    from vllm_specstream.cpu_env import cpu_engine_kwargs
    from vllm_specstream.machine import describe_machine
    from vllm_specstream.model_executor import specstream
    from vllm_specstream.model_executor.stream_forward import last_window_anchors

    cfg = BenchConfig(**task_data_fields(a), num_prompts=a.batch_size, methods=("plain",))
    prompts = load_prompts(cfg, AutoTokenizer.from_pretrained(a.checkpoint))
    kw = cpu_engine_kwargs(dtype="float32", max_num_seqs=a.batch_size)
    kw["speculative_config"] = speculative_config(4, adaptive=False)
    llm = LLM(model=a.checkpoint, disable_log_stats=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    llm.generate(prompts[:2], params, use_tqdm=False)
    rules = {"padded": padded_anchors, "one per prefill": last_window_anchors}
    ttft: dict[str, list[float]] = {name: [] for name in rules}
    for trial in range(a.trials):
        for name in list(rules)[:: 1 if trial % 2 == 0 else -1]:
            specstream.last_window_anchors = rules[name]
            llm.generate(prompts[:1], params, use_tqdm=False)
            time.sleep(0.3)
            outs = llm.generate(prompts, params, use_tqdm=False)
            ttft[name].append(1e3 * statistics.median(o.metrics.first_token_latency for o in outs))
    specstream.last_window_anchors = last_window_anchors
    print(f"\n{describe_machine()}; batch {a.batch_size}, {a.trials} trials")
    for name, values in ttft.items():
        print(
            f"  {name:16s} median TTFT {statistics.median(values):7.1f} ms  trials "
            f"{[round(v) for v in values]}"
        )
    print("RESULT " + json.dumps({k: [round(x, 1) for x in v] for k, v in ttft.items()}))


if __name__ == "__main__":
    main()
