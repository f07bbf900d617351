"""Cost of a specstream decode step relative to a plain one, by batch size and draft length.

One plain engine and one speculating engine per draft length k (a fixed schedule: every
decode step drafts k) live in this process; each group of ``b`` prompts is decoded by every
engine in turn, the order rotated from group to group, so that the VM's drift (a plain step
here varies by +-10% from one minute to the next) falls on every engine alike. A step is one
``execute_model`` + ``sample_tokens`` of an engine; kept are its decode steps of exactly
``b`` requests (for k > 0, those that verified drafts). A cell is the median step time of
k over plain's at the same batch size. With ``--idle`` a speculating engine whose schedule
drafts nothing runs too: its decode steps (the proposer, the stash and the policy's
bookkeeping run, no streams) over plain's are what speculation costs a step that does not
draft. The draft-length ratios are what ``vllm_specstream.step_cost``
keeps per CPU class: the adaptive policy weighs them against the tokens a step is expected
to yield.

    .venv/bin/python benchmarks/step_cost.py CKPT [--ks 1,2,3,4] [--batch-sizes 1,4,16,32]
        [--task sql --data FILE] [--placement window] [--out benchmarks/results/step-cost]

The engines compute on one core unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise (the
tables' setting; ``nobind``: both cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")

from profile_step import preload_iomp_and_reexec  # noqa: E402

from vllm_specstream.machine import cpu_class, describe_machine  # noqa: E402

#: Each engine's KV cache: several engines share the machine's memory.
KV_CACHE_BYTES = 1 << 30


class StepClock:
    """Wall time of each engine's steps, from vLLM's model-runner calls: a step runs from
    one ``execute_model`` to the end of its ``sample_tokens`` (which runs the proposer).
    Engines run one at a time in this process: each step is filed under :attr:`engine`."""

    def __init__(self) -> None:
        #: engine -> [(requests, most tokens of one request, verified drafts?, seconds)]
        self.steps: dict[int | str, list[tuple[int, int, bool, float]]] = {}
        self.engine: int | str = 0
        self._open: list | None = None

    def install(self, runner_cls) -> None:
        execute, sample = runner_cls.execute_model, runner_cls.sample_tokens
        clock = self

        def execute_model(runner, scheduler_output, *a, **kw):
            per_req = list(scheduler_output.num_scheduled_tokens.values())
            drafted = any(scheduler_output.scheduled_spec_decode_tokens.values())
            start = time.perf_counter()
            out = execute(runner, scheduler_output, *a, **kw)
            clock._open = [
                len(per_req),
                max(per_req, default=0),
                drafted,
                time.perf_counter() - start,
            ]
            return out

        def sample_tokens(runner, *a, **kw):
            start = time.perf_counter()
            out = sample(runner, *a, **kw)
            step, clock._open = clock._open, None
            if step is not None:
                step[3] += time.perf_counter() - start
                clock.steps.setdefault(clock.engine, []).append(tuple(step))
            return out

        runner_cls.execute_model = execute_model
        runner_cls.sample_tokens = sample_tokens

    def median_ms(self, engine: int | str, batch_size: int) -> tuple[float | None, int]:
        """Median ms of ``engine``'s decode steps of ``batch_size`` requests, and their
        count: with ``k`` drafts (an int), the steps that verified drafts; plain (0) and idle,
        the steps of one token per request."""
        k = engine if isinstance(engine, int) else 0
        times = [
            t
            for n, most, drafted, t in self.steps.get(engine, [])
            if n == batch_size and most == k + 1 and drafted == (k > 0)
        ]
        return (statistics.median(times) * 1e3 if times else None), len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("checkpoint", help="merged specstream checkpoint")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("-n", type=int, default=6, help="groups of prompts per batch size")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--task", default="sql")
    ap.add_argument("--data", help="task file whose validation split gives the prompts")
    ap.add_argument("--placement", help="window or accepted (default: the proposer's)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--idle",
        action="store_true",
        help="also a speculating engine that drafts nothing (what speculation costs a step)",
    )
    ap.add_argument("--out", default="benchmarks/results/step-cost")
    args = ap.parse_args()
    preload_iomp_and_reexec()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.v1.worker import gpu_model_runner as gmr

    from vllm_specstream import speculative_config
    from vllm_specstream.cpu_env import cpu_engine_kwargs
    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks import build_task, load_task_data, select_split, to_example
    from vllm_specstream.training.tasks.holdout import DEFAULT_VAL_FRACTION

    ks = [int(k) for k in args.ks.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    clock = StepClock()
    clock.install(gmr.GPUModelRunner)
    kw = cpu_engine_kwargs(dtype=args.dtype, kv_cache_memory_bytes=KV_CACHE_BYTES)
    engines = {0: LLM(model=args.checkpoint, **kw)}
    for k in ks:
        spec = speculative_config(k, placement=args.placement, adaptive=False)
        engines[k] = LLM(model=args.checkpoint, speculative_config=spec, **kw)
    if args.idle:
        never = {"num_speculative_tokens_per_batch_size": [(1, 1 << 16, 0)]}
        spec = speculative_config(max(ks), placement=args.placement, **never)
        engines["idle"] = LLM(model=args.checkpoint, speculative_config=spec, **kw)

    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    need = 1 + args.n * max(sizes)
    if args.data:
        records = select_split(load_task_data(args.task, args.data), "val", DEFAULT_VAL_FRACTION)
        messages = [r.messages for r in records]
    else:
        messages = [
            to_example(args.task, r).messages for r in build_task(args.task, "test", n=need)
        ]
    messages = (messages * -(-need // len(messages)))[:need]
    prompts = [prompt_text(tok, m) for m in messages]
    # Fixed lengths keep every batch full: the cost is per batch size.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    order = list(engines)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:1], params, use_tqdm=False)
    clock.steps.clear()
    for b in sizes:
        for i in range(args.n):
            group = prompts[1 + i * b : 1 + (i + 1) * b]
            turn = order[i % len(order) :] + order[: i % len(order)]
            for k in turn:
                clock.engine = k
                engines[k].generate(group, params, use_tqdm=False)

    medians = {k: {b: clock.median_ms(k, b) for b in sizes} for k in engines}
    ratios = {
        k: [round(medians[k][b][0] / medians[0][b][0], 3) for b in sizes]
        if all(medians[k][b][0] and medians[0][b][0] for b in sizes)
        else None
        for k in engines
        if k != 0
    }
    report = {
        "machine": describe_machine(),
        "cpu_class": cpu_class(),
        "placement": args.placement or "default",
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "checkpoint": args.checkpoint,
        "prompts": f"{args.task} {args.data or 'synthetic'}",
        "batch_sizes": sizes,
        "median_ms": {k: {b: round(m[b][0] or 0.0, 2) for b in sizes} for k, m in medians.items()},
        "steps": {k: {b: m[b][1] for b in sizes} for k, m in medians.items()},
        "ratios": ratios,
    }
    print(f"{report['machine']} ({report['cpu_class']}), placement {report['placement']}")
    print("plain ms/step: " + ", ".join(f"b{b}: {report['median_ms'][0][b]}" for b in sizes))
    print("step cost / plain, by batch size: " + " ".join(f"{b:>6d}" for b in sizes))
    for k in ratios:
        row = ratios[k] or [float("nan")] * len(sizes)
        label = f"k = {k}" if isinstance(k, int) else "drafting nothing"
        print(f"  {label:36s}" + " ".join(f"{r:6.2f}" for r in row))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.placement}" if args.placement else ""
    path = Path(args.out) / f"{report['cpu_class']}{suffix}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
