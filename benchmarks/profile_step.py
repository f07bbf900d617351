"""Where a specstream decode step spends its time on CPU (batch 1, greedy).

Runs the engine in this process, wraps the plugin's pieces and vLLM's model-runner phases in
``torch.profiler.record_function`` ranges, decodes ``-n`` prompts one at a time and prints
the time per decode step of each range (median-free: totals / steps), then the top
operators by self time. Compare ``--k 0`` (plain) with ``--k 4``.

    .venv/bin/python benchmarks/profile_step.py CKPT [--k 4] [-n 4] [--dtype float32]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


TIMES: dict[str, list[float]] = {}


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
        TIMES[label][0] += time.perf_counter() - start
        TIMES[label][1] += 1
        return out

    setattr(obj, name, wrapped)


def preload_iomp_and_reexec() -> None:
    """The engine runs in this process, so Intel OpenMP must be preloaded into it (as vLLM's
    spawned workers get it from the plugin); without it spec decoding on CPU is far slower."""
    import sys

    from vllm_specstream.cpu_env import find_iomp, iomp_preload_value

    iomp = find_iomp()
    value = iomp and iomp_preload_value(os.environ.get("LD_PRELOAD", ""), iomp)
    if value:
        os.environ["LD_PRELOAD"] = value
        os.execv(sys.executable, [sys.executable, *sys.argv])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("-n", type=int, default=4, help="prompts profiled (after one warm-up)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ops", action="store_true", help="also run torch.profiler: operator table")
    ap.add_argument("--rows", type=int, default=25, help="operator rows printed with --ops")
    args = ap.parse_args()
    preload_iomp_and_reexec()

    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_specstream import speculative_config
    from vllm_specstream.cpu_env import cpu_engine_kwargs
    from vllm_specstream.model_executor import specstream as ss
    from vllm_specstream.model_executor import stream_forward as sf
    from vllm_specstream.proposer import SpecStreamProposer
    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks import build_task, to_example

    wrap(ss.SpecStreamMixin, "forward", "model.forward (main + hook)")
    wrap(ss.SpecStreamMixin, "_run_streams", "streams: total")
    wrap(sf.StreamRunner, "__call__", "streams: layers")
    wrap(sf.StreamRunner, "_main_kv", "streams: KV gather")
    wrap(ss.SpecStreamLlamaForCausalLM, "compute_logits", "compute_logits (main + streams)")
    wrap(SpecStreamProposer, "propose", "proposer.propose")
    from vllm.v1.worker import gpu_model_runner as gmr

    runner_cls = gmr.GPUModelRunner
    for name in ("execute_model", "sample_tokens", "_prepare_inputs", "propose_draft_token_ids"):
        if hasattr(runner_cls, name):
            wrap(runner_cls, name, f"runner.{name}")

    tok = AutoTokenizer.from_pretrained(args.ckpt)
    prompts = [
        prompt_text(tok, to_example("sql", r).messages)
        for r in build_task("sql", "test", n=args.n + 1)
    ]
    kw = cpu_engine_kwargs(dtype=args.dtype)
    if args.k:
        kw["speculative_config"] = speculative_config(args.k, adaptive=False)
    llm = LLM(model=args.ckpt, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], params, use_tqdm=False)
    steps = {"n": 0}
    orig = runner_cls.execute_model

    def counted(self, *a, **kw):
        steps["n"] += 1
        return orig(self, *a, **kw)

    runner_cls.execute_model = counted
    for t in TIMES.values():
        t[:] = [0.0, 0]
    tokens = 0
    prof = profile(activities=[ProfilerActivity.CPU]) if args.ops else contextlib.nullcontext()
    start = time.perf_counter()
    with prof:
        for p in prompts[1:]:
            out = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
            tokens += len(out.token_ids)
    wall = time.perf_counter() - start
    n = max(steps["n"], 1)
    print(
        f"\n{tokens} tokens, {n} steps ({tokens / n:.2f} tokens/step), k={args.k}, "
        f"{wall:.2f} s, {tokens / wall:.2f} tok/s{' (under the profiler)' if args.ops else ''}"
    )
    print(f"{'range':40s} {'ms/step':>9s} {'calls/step':>10s}")
    for label, (total, calls) in sorted(TIMES.items(), key=lambda kv: -kv[1][0]):
        print(f"{label:40s} {total * 1e3 / n:9.2f} {calls / n:10.2f}")
    if args.ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
