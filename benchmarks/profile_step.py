"""Where a specstream decode step spends its time on CPU (batch 1, greedy).

Runs the engine in this process, wraps the plugin's pieces and vLLM's model-runner phases in
``torch.profiler.record_function`` ranges, decodes ``-n`` prompts one at a time and prints,
for decode steps only (prefill steps are left out; ``--prefill``: those alone), the median
time per step of each range, of the whole step (``execute_model`` + ``sample_tokens``,
which runs the proposer) and of the step period (one step's start to the next's: with what
the engine core and scheduler do between steps), then with ``--ops`` the top operators by
self time. Compare
``--k 0`` (plain) with ``--k 4``, and with vLLM's own method at the same ``k``
(``--vllm-method suffix``). With ``--lora NAME=DIR`` (repeatable) CKPT is a base served with
those adapters (vLLM multi-LoRA, request ``i`` on adapter ``i mod A``), and the
LoRA ops, the per-step adapter mapping and vLLM's punica metadata update are ranges of their
own: against the adapters' merged checkpoint, what vLLM's CPU LoRA path costs a step.

    .venv/bin/python benchmarks/profile_step.py CKPT [--k 4] [-n 4] [--dtype float32]
        [--task sql --data FILE --split val] [--lora NAME=DIR ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


TIMES: dict[str, list[float]] = {}
#: Label of a step's wall time from its start to the next step's start.
PERIOD = "step period (start to next start)"
#: Time of each range in the current step (reset when a step starts).
STEP: dict[str, float] = {}


def wrap(obj, name: str, label: str) -> None:
    """Time ``obj.name`` (wall clock, and as a profiler range when the profiler runs)."""
    import functools
    import time

    from torch.profiler import record_function

    fn = getattr(obj, name)
    TIMES[label] = [0.0, 0]

    @functools.wraps(fn)
    def wrapped(*a, **kw):
        start = time.perf_counter()
        with record_function(label):
            out = fn(*a, **kw)
        took = time.perf_counter() - start
        TIMES[label][0] += took
        TIMES[label][1] += 1
        STEP[label] = STEP.get(label, 0.0) + took
        return out

    setattr(obj, name, wrapped)


def preload_iomp_and_reexec() -> None:
    """The engine runs in this process, so Intel OpenMP must be preloaded into it (as vLLM's
    spawned workers get it from the plugin); without it spec decoding on CPU is far slower."""
    import sys

    from vllm_specstream.patches.cpu_env import find_iomp, iomp_preload_value

    iomp = find_iomp()
    value = iomp and iomp_preload_value(os.environ.get("LD_PRELOAD", ""), iomp)
    if value:
        os.environ["LD_PRELOAD"] = value
        os.execv(sys.executable, [sys.executable, *sys.argv])


def task_prompts_cycled(ckpt: str, task: str, data: str | None, split: str, need: int):
    """``need`` prompts in ``ckpt``'s chat format: the ``split`` side of the task file
    ``data`` (else the built-in task's test examples), repeated as often as needed."""
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks import build_task, load_task_data, select_split, to_example
    from vllm_specstream.training.tasks.holdout import DEFAULT_VAL_FRACTION

    if data:
        records = select_split(load_task_data(task, data), split, DEFAULT_VAL_FRACTION)
        messages = [r.messages for r in records]
    else:
        messages = [to_example(task, r).messages for r in build_task(task, "test", n=need)]
    messages = (messages * -(-need // len(messages)))[:need]
    tok = AutoTokenizer.from_pretrained(ckpt)
    return [prompt_text(tok, m) for m in messages]


def profiled_ranges() -> list[tuple[object, str, str]]:
    """``(object, attribute, label)`` of the plugin's pieces timed as ranges of their own."""
    from vllm_specstream.model_executor import specstream as ss
    from vllm_specstream.model_executor import stream_forward as sf
    from vllm_specstream.model_executor.proposer import SpecStreamProposer
    from vllm_specstream.model_executor.stream_head import StreamHead
    from vllm_specstream.model_executor.stream_pass import StreamPass
    from vllm_specstream.model_executor.trees import attention as ta
    from vllm_specstream.model_executor.trees import model_forward as tf
    from vllm_specstream.model_executor.trees import sampler as ts

    return [
        (ss.SpecStreamMixin, "forward", "model.forward (main + hook)"),
        (StreamPass, "_run_streams", "streams: total"),
        (sf.StreamRunner, "__call__", "streams: layers"),
        (StreamHead, "project", "streams: LM head at the anchors"),
        (ss.SpecStreamLlamaForCausalLM, "compute_logits", "compute_logits (main + streams)"),
        (SpecStreamProposer, "propose", "proposer.propose"),
        # draft trees (field tree_top_k): node rows redone per layer, acceptance and KV
        # moves, early-exit pruning
        (ta, "redo_tree_rows", "trees: node rows redone (all layers)"),
        (ts.TreeRejectionSampler, "forward", "trees: sampler (accept + KV move)"),
        (tf, "_prune", "trees: pruning head"),
    ]


def json_field(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--field``: VALUE as JSON where it parses, else the string."""
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("-n", type=int, default=4, help="batches per batch size (after one warm-up)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ops", action="store_true", help="also run torch.profiler: operator table")
    ap.add_argument("--rows", type=int, default=25, help="operator rows printed with --ops")
    ap.add_argument("--task", default="sql", help="task of the prompts (sql, e2e, dialogsum)")
    ap.add_argument("--data", help="task file whose --split gives the prompts (else synthetic)")
    ap.add_argument("--split", default="val", help="all, train or val side of --data")
    ap.add_argument(
        "--batch-sizes",
        default="1",
        help="requests decoded together, comma-separated (> 1: fixed lengths, ignore_eos)",
    )
    ap.add_argument("--json", help="write the medians per batch size here")
    ap.add_argument("--placement", help="window or accepted (default: the proposer's)")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="vLLM's default compiled decoder (as `LLM(model=...)` runs it) instead of eager",
    )
    ap.add_argument(
        "--vllm-method",
        choices=("ngram", "suffix"),
        help="with --k: vLLM's own speculative method instead of specstream (its step beside "
        "specstream's; suffix needs arctic-inference on PYTHONPATH, `make suffix-decoding`)",
    )
    ap.add_argument(
        "--adaptive",
        action="store_true",
        help="the default adaptive policy (else every step drafts k): with --k, a speculating "
        "engine's steps that draft nothing show what speculation costs a plain step",
    )
    ap.add_argument(
        "--never-draft",
        action="store_true",
        help="with --k: a speculating engine whose schedule drafts 0 at every batch size "
        "(what speculation costs a step that verifies nothing)",
    )
    ap.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve CKPT (a base) with this LoRA adapter (repeatable)",
    )
    ap.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine field of additional_config['specstream'] (repeatable; VALUE as JSON "
        "where it parses), e.g. stream_dtype=int8",
    )
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="the steps that prefilled a prompt instead of the decode steps (time to first "
        "token: with --k, the streams at the prompt's last token)",
    )
    args = ap.parse_args()
    preload_iomp_and_reexec()

    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    from vllm_specstream import speculative_config
    from vllm_specstream.patches.cpu_env import cpu_engine_kwargs

    for obj, name, label in profiled_ranges():
        wrap(obj, name, label)
    from vllm.v1.worker import gpu_model_runner as gmr

    runner_cls = gmr.GPUModelRunner
    for name in (
        "execute_model",
        "sample_tokens",
        "_prepare_inputs",
        "propose_draft_token_ids",
        "_sample",
        "_bookkeeping_sync",
        "_update_states_after_model_execute",
    ):
        if hasattr(runner_cls, name):
            wrap(runner_cls, name, f"runner.{name}")
    if args.lora:
        from vllm.lora.punica_wrapper import punica_cpu

        cpu = punica_cpu.PunicaWrapperCPU
        wrap(cpu, "add_lora_linear", "lora: linear layers (shrink + expand)")
        wrap(cpu, "add_lora_logits", "lora: LM head")
        wrap(cpu, "update_metadata", "lora: punica metadata update")
        wrap(runner_cls, "set_active_loras", "lora: runner.set_active_loras (mapping)")

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    prompts = task_prompts_cycled(
        args.ckpt, args.task, args.data, args.split, 1 + args.n * max(sizes)
    )
    kw = cpu_engine_kwargs(dtype=args.dtype)
    if args.compile:
        kw.pop("enforce_eager")
    loras = []
    if args.lora:
        from vllm.lora.request import LoRARequest

        for i, spec in enumerate(args.lora, start=1):
            name, _, path = spec.partition("=")
            loras.append(LoRARequest(name, i, path))
        configs = [Path(r.lora_path) / "adapter_config.json" for r in loras]
        rank = max(json.loads(c.read_text())["r"] for c in configs)
        kw.update(enable_lora=True, max_loras=len(loras), max_lora_rank=rank)
    if args.k and args.vllm_method:
        kw["speculative_config"] = {"method": args.vllm_method, "num_speculative_tokens": args.k}
    elif args.k:
        never = {"num_speculative_tokens_per_batch_size": [(1, 1 << 16, 0)]}
        kw["speculative_config"] = speculative_config(
            args.k, adaptive=args.adaptive, **(never if args.never_draft else {})
        )
        fields = dict(json_field(f) for f in args.field)
        if args.placement:
            fields["placement"] = args.placement
        if fields:
            kw["additional_config"] = {"specstream": fields}
    llm = LLM(model=args.ckpt, **kw)
    # Fixed lengths (ignore_eos) keep the batch full: the step cost is per batch size.
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.batch_sizes != "1"
    )

    def lora_of(group_start: int, n: int):
        return [loras[(group_start + j) % len(loras)] for j in range(n)] if loras else None

    llm.generate(prompts[:1], params, use_tqdm=False, lora_request=lora_of(0, 1))
    # (requests, decode?, verified drafts?, ranges)
    steps: list[tuple[int, bool, bool, dict[str, float]]] = []
    current: dict = {}
    orig = runner_cls.execute_model

    def counted(self, scheduler_output, *a, **kw):
        # A step runs from here to the next step's start (it ends in sample_tokens); the
        # time between starts adds what the engine core and scheduler do between steps.
        now = time.perf_counter()
        if current:
            STEP[PERIOD] = now - current["start"]
            steps.append((current["reqs"], current["decode"], current["drafts"], dict(STEP)))
        STEP.clear()
        current["start"] = now
        per_req = list(scheduler_output.num_scheduled_tokens.values())
        current.update(
            reqs=len(per_req),
            decode=bool(per_req) and max(per_req) <= args.k + 1,
            drafts=any(scheduler_output.scheduled_spec_decode_tokens.values()),
        )
        return orig(self, scheduler_output, *a, **kw)

    runner_cls.execute_model = counted
    for t in TIMES.values():
        t[:] = [0.0, 0]
    report = {"k": args.k, "checkpoint": args.ckpt, "batch_sizes": {}}
    prof = profile(activities=[ProfilerActivity.CPU]) if args.ops else contextlib.nullcontext()
    with prof:
        for b in sizes:
            steps.clear()
            current.clear()
            tokens = 0
            start = time.perf_counter()
            for i in range(args.n):
                group = prompts[1 + i * b : 1 + (i + 1) * b]
                outs = llm.generate(
                    group, params, use_tqdm=False, lora_request=lora_of(i * b, len(group))
                )
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            wall = time.perf_counter() - start
            if current:
                # The group's last step has no next start: no period.
                steps.append((current["reqs"], current["decode"], current["drafts"], dict(STEP)))
                current.clear()
            report["batch_sizes"][b] = summarize(steps, b, tokens, wall, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def summarize(steps, b: int, tokens: int, wall: float, args) -> dict:
    """Median ms per decode step of each range over the steps that ran ``b`` requests (with
    ``--adaptive``, separately for steps that verified drafts and steps that did not)."""
    report = _summarize(steps, b, tokens, wall, args, None)
    if args.adaptive:
        for drafted in (True, False):
            report["verified drafts" if drafted else "no drafts"] = _summarize(
                steps, b, tokens, wall, args, drafted
            )
    return report


def _summarize(steps, b: int, tokens: int, wall: float, args, drafted: bool | None) -> dict:
    step_key = ("runner.execute_model", "runner.sample_tokens")
    full = [
        ranges
        for reqs, decode, has_drafts, ranges in steps
        if decode != args.prefill and reqs == b and (drafted is None or has_drafts == drafted)
    ]
    if not full:
        return {}
    for d in full:
        d["decode step (execute_model + sample_tokens)"] = sum(d.get(k, 0.0) for k in step_key)
    labels = {k for d in full for k in d}
    medians = {k: statistics.median(d.get(k, 0.0) for d in full) * 1e3 for k in labels}
    print(
        f"\nbatch {b}, k={args.k}: {tokens} tokens, {len(steps)} steps "
        f"({tokens / max(1, len(steps)) / b:.2f} tokens/step per request), {wall:.2f} s, "
        f"{tokens / wall:.2f} tok/s{' (under the profiler)' if args.ops else ''}"
    )
    which = {None: "", True: ", verified drafts", False: ", no drafts"}[drafted]
    kind = "prefill" if args.prefill else "decode"
    print(f"{len(full)} {kind} steps with {b} requests{which}; median ms per step (absent: 0)")
    for label, ms in sorted(medians.items(), key=lambda kv: -kv[1]):
        print(f"  {label:45s} {ms:9.2f}")
    return {
        "tokens": tokens,
        "steps": len(steps),
        "wall_s": wall,
        "decode_steps": len(full),
        "median_ms": medians,
    }


if __name__ == "__main__":
    main()
