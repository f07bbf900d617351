"""End-to-end speed of the adaptive specstream engine against plain vLLM, interleaved.

``specstream bench`` runs each method in its own engine process, one after the other; on
the 2-core VMs here a round's ratios then carry the machine's drift between those minutes
(a second plain engine ranged 0.92-1.22x plain over three rounds). This script keeps a
plain engine, a second plain engine (the control: the run's noise floor) and the default
adaptive specstream engine (as served: its policy, probes and timings) in one process and
serves each group of ``b`` prompts with every engine in turn, the order rotated (and
reversed every other cycle) from group to group, so that drift falls on all three alike.
A group's ratio is plain's wall time over the engine's (prefill and decoding, the same
tokens: outputs are checked identical); a cell is the median over the groups. The same
ratio is also given for the time in steps that prefill (any request new in the step) and in
decoding steps alone, from vLLM's model-runner calls. The
specstream engine keeps its policy's state from group to group, as a serving engine does.

    .venv/bin/python benchmarks/interleaved_speed.py CKPT --task e2e --data FILE
        [--batch-sizes 1,4,16] [-n 8] [--max-tokens 64] [--out DIR]

``--forecast`` also sets, per batch-size bucket, the policy's forecast speedup of its
drafting steps against what they gave (:mod:`policy_forecast`).

Engines compute on both cores (``VLLM_CPU_OMP_THREADS_BIND=nobind``, the bench's setting)
unless the variable says otherwise. Measure with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from bs1_child import keep_proposers, rotated  # noqa: E402
from policy_forecast import ForecastLog, describe, forecast_by_bucket  # noqa: E402
from profile_step import preload_iomp_and_reexec, task_prompts_cycled  # noqa: E402

from vllm_specstream.machine import cpu_class, describe_machine  # noqa: E402

#: Each engine's KV cache: three engines share the machine's memory.
KV_CACHE_BYTES = 1 << 30


class PhaseClock:
    """Wall time of the running engine's prefill steps (any request new in the step) and
    decode steps, from vLLM's model-runner calls: a step runs from one ``execute_model``
    call to the next, or to the end of the ``generate`` call (:meth:`close`)."""

    def __init__(self) -> None:
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self._open: tuple[float, str] | None = None

    def install(self, runner_cls) -> None:
        execute = runner_cls.execute_model
        clock = self

        def execute_model(runner, scheduler_output, *a, **kw):
            clock.close()
            kind = "prefill" if scheduler_output.scheduled_new_reqs else "decode"
            clock._open = (time.perf_counter(), kind)
            return execute(runner, scheduler_output, *a, **kw)

        runner_cls.execute_model = execute_model

    def close(self) -> None:
        if self._open is not None:
            start, kind = self._open
            self.seconds[kind] += time.perf_counter() - start
            self._open = None

    def take(self) -> dict[str, float]:
        self.close()
        out, self.seconds = self.seconds, {"prefill": 0.0, "decode": 0.0}
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("checkpoint", help="merged specstream checkpoint")
    ap.add_argument("--task", default="e2e")
    ap.add_argument("--data", help="task file whose validation split gives the prompts")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("-n", type=int, default=8, help="timed groups of prompts per batch size")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="benchmarks/results/interleaved-speed")
    ap.add_argument(
        "--forecast",
        action="store_true",
        help="also the policy's forecast for its drafting steps against what they gave",
    )
    args = ap.parse_args()
    preload_iomp_and_reexec()

    from vllm import LLM, SamplingParams
    from vllm.v1.worker import gpu_model_runner as gmr

    from vllm_specstream import speculative_config
    from vllm_specstream.cpu_env import cpu_engine_kwargs
    from vllm_specstream.policy import choice_label

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    proposers = keep_proposers()
    clock = PhaseClock()
    clock.install(gmr.GPUModelRunner)
    kw = cpu_engine_kwargs(dtype=args.dtype, kv_cache_memory_bytes=KV_CACHE_BYTES)
    engines = {
        "plain": LLM(model=args.checkpoint, **kw),
        "control": LLM(model=args.checkpoint, **kw),
        "specstream": LLM(model=args.checkpoint, speculative_config=speculative_config(4), **kw),
    }
    policy = proposers[-1].policy
    forecast = ForecastLog(policy) if args.forecast else None
    prompts = task_prompts_cycled(
        args.checkpoint, args.task, args.data, "val", (1 + args.n) * sum(sizes)
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    order, turns, used = list(engines), 0, 0
    cells, mismatches = {}, 0
    for b in sizes:
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        phases: dict[str, list[dict]] = {name: [] for name in engines}
        tokens = 0
        before = dict(policy.decisions)
        # The first group of each batch size warms every engine up (not kept).
        for i in range(1 + args.n):
            if i == 1 and forecast is not None:
                forecast.take()  # the warm-up group's steps are not kept
            group = prompts[used : used + b]
            used += b
            outputs = {}
            for name in rotated(order, turns):
                clock.take()
                start = time.perf_counter()
                out = engines[name].generate(group, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                outputs[name] = [list(o.outputs[0].token_ids) for o in out]
                if i:
                    seconds[name].append(elapsed)
                    phases[name].append(clock.take())
            turns += i > 0
            mismatches += sum(outputs[name] != outputs["plain"] for name in engines)
            if i:
                tokens += sum(len(t) for t in outputs["plain"])
        steps = {
            choice_label(k): n - before.get(k, 0)
            for k, n in policy.decisions.items()
            if n > before.get(k, 0)
        }
        cells[b] = {
            "plain_tok_s": round(tokens / sum(seconds["plain"]), 2),
            "output_tokens": tokens,
            "ratios": {
                name: [round(p / t, 3) for p, t in zip(seconds["plain"], seconds[name])]
                for name in engines
                if name != "plain"
            },
            "policy_steps": steps,
            # Plain's time in each phase over the engine's, per group.
            "phase_ratios": {
                name: {
                    kind: [
                        round(p[kind] / q[kind], 3) if q[kind] else None
                        for p, q in zip(phases["plain"], phases[name])
                    ]
                    for kind in ("prefill", "decode")
                }
                for name in engines
                if name != "plain"
            },
            "plain_phase_seconds": [
                {k: round(v, 3) for k, v in p.items()} for p in phases["plain"]
            ],
        }
        if forecast is not None:
            cells[b]["forecast"] = forecast_by_bucket(forecast.take())
            # what the policy then knows at this size: acceptance, costs, timed steps
            cells[b]["policy_summary"] = policy.summary(b)
        cells[b]["median"] = {
            name: round(statistics.median(r), 3) for name, r in cells[b]["ratios"].items()
        }
    report = {
        "machine": describe_machine(),
        "cpu_class": cpu_class(),
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "checkpoint": args.checkpoint,
        "prompts": f"{args.task} {args.data or 'synthetic'} (val split)",
        "max_tokens": args.max_tokens,
        "timed_groups": args.n,
        "identical_outputs": mismatches == 0,
        "cells": cells,
    }
    print(f"{report['machine']} ({report['cpu_class']}); outputs identical: {mismatches == 0}")
    print("speed / plain (median over groups)   " + " ".join(f"{'b' + str(b):>7s}" for b in sizes))
    for name in ("control", "specstream"):
        row = " ".join(f"{cells[b]['median'][name]:7.3f}" for b in sizes)
        print(f"  {name:35s}{row}")
    for b in sizes:
        phase = {
            name: {
                kind: statistics.median(r for r in rows if r is not None)
                for kind, rows in by_kind.items()
            }
            for name, by_kind in cells[b]["phase_ratios"].items()
        }
        cells[b]["phase_median"] = phase
        print(
            f"  b{b}: prefill / decoding steps, plain's time over the engine's: "
            + "; ".join(
                f"{name} {p['prefill']:.3f} / {p['decode']:.3f}" for name, p in phase.items()
            )
        )
        print(f"  b{b}: specstream's steps by choice {cells[b]['policy_steps']}")
        if "forecast" in cells[b]:
            print(
                f"  b{b}: drafting steps, realized against forecast: {describe(cells[b]['forecast'])}"
            )
            print(f"  b{b}: policy at the cell's end: {cells[b]['policy_summary']}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{report['cpu_class']}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
