"""Cost of a specstream decode step relative to a plain one, by batch size and draft length.

One plain engine and one speculating engine per draft length k (a fixed schedule: every
decode step drafts k) live in this process; each group of ``b`` prompts is decoded by every
engine in turn, the order rotated (and reversed every other cycle) from group to group, so
that the VM's drift (a plain step here varies by +-10% from one minute to the next) falls
on every engine alike. A step runs from one ``execute_model`` call of an engine to its next
(the forward, sampling, the proposer, vLLM's scheduling); kept are the decode steps of
exactly ``b`` requests, none joining, each request verifying k drafts (plain: none). A cell
is the median, over the groups, of a group's median step time of k over plain's.
These ratios are what the adaptive policy's row model (``vllm_specstream.speculation.step_cost``)
starts from before an engine has timed its own steps.

``--idle`` adds the default adaptive engine with its policy told that nothing pays: every
step runs the proposer, the stash and the policy's bookkeeping and pricing and drafts
nothing (what speculation costs a step that does not draft). ``--control`` adds a second
plain engine: its "cost" is the run's noise floor. ``--all-stream-logits-fused`` adds, per
k, an engine whose window streams all go through the LM head with the main rows, over the
whole vocabulary (none left to the proposer to project at the anchors it reads);
``--whole-vocab-too``, for a checkpoint with a draft vocabulary, one drafting from the whole
vocabulary: what each choice costs beside the default's.

    .venv/bin/python benchmarks/step_cost.py CKPT [--ks 1,2,3,4] [--batch-sizes 1,4,16,32]
        [--task sql --data FILE] [--placement window] [--idle] [--control]
        [--out runs/step-cost]

The engines compute on one core unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise (the
tables' setting; ``nobind``: both cores). Measure with nothing else running: a busy second
core slows the steps unevenly (the weight reads of a plain step more than a speculative
step's extra rows), which no interleaving evens out.
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
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model

from profile_step import preload_iomp_and_reexec, task_prompts_cycled  # noqa: E402

from vllm_specstream.machine import cpu_class, describe_machine  # noqa: E402

#: Each engine's KV cache: several engines share the machine's memory.
KV_CACHE_BYTES = 1 << 30


def rotated(order: list[str], turn: int) -> list[str]:
    """The engines of ``order`` in the order of interleaved turn ``turn``: rotated by
    ``turn``, reversed every other full cycle, so that over two cycles each engine runs in
    each position, before and after each other engine, equally often."""
    r = turn % len(order)
    out = order[r:] + order[:r]
    return out[::-1] if (turn // len(order)) % 2 else out


def keep_proposers() -> list:
    """A list that every specstream proposer built in this process from now on joins once
    vLLM has loaded its model (to set its rules between requests)."""
    from vllm_specstream.model_executor.proposer import SpecStreamProposer

    proposers: list[SpecStreamProposer] = []
    load_model = SpecStreamProposer.load_model

    def keep(self, target_model):
        load_model(self, target_model)
        proposers.append(self)

    SpecStreamProposer.load_model = keep
    return proposers


class StepClock:
    """Wall time of each engine's steps, from vLLM's model-runner calls: a step runs from
    one ``execute_model`` call to the next of the same engine (one ``generate`` call at a
    time runs in this process; each step is filed under :attr:`engine` and :attr:`group`,
    and an engine's last step of a call, which no next call ends, is dropped)."""

    def __init__(self) -> None:
        #: (engine, batch size, group) -> seconds of the kept steps
        self.steps: dict[tuple[str, int, int], list[float]] = {}
        self.engine: str | None = None
        """Engine now decoding (None: warm-up, not kept)."""
        self.group = 0
        self.batch_size = 0
        self.drafts = 0
        """Drafts per request each kept step of :attr:`engine` verifies."""
        self._open: tuple[float, bool] | None = None

    def begin(self, engine: str | None, group: int, batch_size: int, drafts: int) -> None:
        self.engine, self.group, self.batch_size, self.drafts = engine, group, batch_size, drafts
        self._open = None

    def install(self, runner_cls) -> None:
        execute = runner_cls.execute_model
        clock = self

        def execute_model(runner, scheduler_output, *a, **kw):
            now = time.perf_counter()
            if clock._open is not None and clock.engine is not None:
                start, keep = clock._open
                if keep:
                    key = (clock.engine, clock.batch_size, clock.group)
                    clock.steps.setdefault(key, []).append(now - start)
            per_req = list(scheduler_output.num_scheduled_tokens.values())
            keep = (
                len(per_req) == clock.batch_size
                and not scheduler_output.scheduled_new_reqs  # a prefill (maybe one token)
                and min(per_req) == max(per_req) == clock.drafts + 1
                and any(scheduler_output.scheduled_spec_decode_tokens.values())
                == (clock.drafts > 0)
            )
            clock._open = (now, keep)
            return execute(runner, scheduler_output, *a, **kw)

        runner_cls.execute_model = execute_model

    def cell(
        self, engine: str, base: str, batch_size: int, groups: list[int]
    ) -> tuple[float | None, float | None]:
        """``(median ms per kept step of engine, median over groups of its group median
        over base's)`` at ``batch_size``; None where no group has kept steps of both."""

        def med(e, g):
            times = self.steps.get((e, batch_size, g))
            return statistics.median(times) if times else None

        pooled = [t for g in groups for t in self.steps.get((engine, batch_size, g), [])]
        ratios = [
            a / b for g in groups if (a := med(engine, g)) is not None and (b := med(base, g))
        ]
        return (
            round(statistics.median(pooled) * 1e3, 2) if pooled else None,
            round(statistics.median(ratios), 3) if ratios else None,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("checkpoint", help="merged specstream checkpoint")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("-n", type=int, default=10, help="timed groups of prompts per batch size")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--task", default="sql")
    ap.add_argument("--data", help="task file whose validation split gives the prompts")
    ap.add_argument("--placement", help="window or accepted (default: the proposer's)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--idle", action="store_true", help="also an engine that drafts nothing")
    ap.add_argument("--control", action="store_true", help="also a second plain engine")
    ap.add_argument(
        "--all-stream-logits-fused",
        action="store_true",
        help="also, per k, an engine projecting every window stream row with the main rows",
    )
    ap.add_argument(
        "--whole-vocab-too",
        action="store_true",
        help="also, per k, an engine ignoring the checkpoint's draft vocabulary",
    )
    ap.add_argument("--out", default="runs/step-cost", help="CLASS[-PLACEMENT].json goes here")
    args = ap.parse_args()
    preload_iomp_and_reexec()

    from vllm import LLM, SamplingParams
    from vllm.v1.worker import gpu_model_runner as gmr

    from vllm_specstream import speculative_config
    from vllm_specstream.model_executor.specstream import (
        fuse_all_stream_logits,
        whole_vocab_drafts,
    )
    from vllm_specstream.patches.cpu_env import cpu_engine_kwargs

    ks = [int(k) for k in args.ks.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    clock = StepClock()
    clock.install(gmr.GPUModelRunner)
    proposers = keep_proposers()
    kw = cpu_engine_kwargs(dtype=args.dtype, kv_cache_memory_bytes=KV_CACHE_BYTES)
    #: Engines per k beside the default, each with one setting of the model changed.
    variants = {
        name: setting
        for name, setting, wanted in (
            ("fused-logits", fuse_all_stream_logits, args.all_stream_logits_fused),
            ("whole-vocab", whole_vocab_drafts, args.whole_vocab_too),
        )
        if wanted
    }
    engines = {"plain": LLM(model=args.checkpoint, **kw)}
    drafts = {"plain": 0}
    if args.control:
        engines["control"], drafts["control"] = LLM(model=args.checkpoint, **kw), 0
    # The plugin's own fields go to additional_config, vLLM's to speculative_config.
    spec_kw = dict(kw)
    if args.placement:
        spec_kw["additional_config"] = {"specstream": {"placement": args.placement}}
    for k in ks:
        spec = speculative_config(k, adaptive=False)
        engines[f"k{k}"] = LLM(model=args.checkpoint, speculative_config=spec, **spec_kw)
        drafts[f"k{k}"] = k
        for name, setting in variants.items():
            llm = LLM(model=args.checkpoint, speculative_config=spec, **spec_kw)
            llm.apply_model(setting)
            engines[f"k{k}-{name}"], drafts[f"k{k}-{name}"] = llm, k
    if args.idle:
        spec = speculative_config(max(ks))
        engines["idle"] = LLM(model=args.checkpoint, speculative_config=spec, **spec_kw)
        drafts["idle"] = 0
        proposers[-1].policy.margin = float("inf")  # nothing pays: the policy drafts nothing

    prompts = task_prompts_cycled(
        args.checkpoint, args.task, args.data, "val", (1 + args.n) * max(sizes)
    )
    # Fixed lengths keep every batch full: the cost is per batch size.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    order = list(engines)
    turns = 0
    for b in sizes:
        # The first group of each batch size warms every engine up (not kept).
        for i in range(1 + args.n):
            group = prompts[i * b : (i + 1) * b]
            turn = rotated(order, turns)
            turns += i > 0
            for name in turn:
                clock.begin(name if i else None, i, b, drafts[name])
                engines[name].generate(group, params, use_tqdm=False)

    groups = list(range(1, 1 + args.n))
    cells = {name: {b: clock.cell(name, "plain", b, groups) for b in sizes} for name in engines}
    report = {
        "machine": describe_machine(),
        "cpu_class": cpu_class(),
        "placement": args.placement or "default",
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "checkpoint": args.checkpoint,
        "prompts": f"{args.task} {args.data or 'synthetic'}",
        "max_tokens": args.max_tokens,
        "timed_groups": args.n,
        "batch_sizes": sizes,
        "median_ms": {name: {b: c[b][0] for b in sizes} for name, c in cells.items()},
        "ratios": {name: [c[b][1] for b in sizes] for name, c in cells.items() if name != "plain"},
    }
    print(f"{report['machine']} ({report['cpu_class']}), placement {report['placement']}")
    print("plain ms/step: " + ", ".join(f"b{b}: {report['median_ms']['plain'][b]}" for b in sizes))
    print("step cost / plain, by batch size: " + " ".join(f"{b:>6d}" for b in sizes))
    for name, row in report["ratios"].items():
        cells_text = " ".join("   n/a" if r is None else f"{r:6.2f}" for r in row)
        print(f"  {name:32s}" + cells_text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.placement}" if args.placement else ""
    path = Path(args.out) / f"{report['cpu_class']}{suffix}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
