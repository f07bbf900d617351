"""Shared by the benchmark scripts: the task's test prompts and command-line arguments, one
engine per child process, and the child's single ``RESULT`` line back to the parent."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def add_task_data_args(parser, task: str = "e2e") -> None:
    """The checkpoint and the task file whose ``--split`` gives the prompts."""
    parser.add_argument("checkpoint")
    parser.add_argument("--task", default=task)
    parser.add_argument("--data", required=True)
    parser.add_argument("--split", default="val")


def task_data_fields(args) -> dict:
    """``BenchConfig`` fields of :func:`add_task_data_args`' arguments."""
    return dict(checkpoint=args.checkpoint, task=args.task, data=args.data, split=args.split)


def task_prompts(ckpt: str, task: str, n: int) -> list[str]:
    """The first ``n`` test prompts of a built-in task, in the checkpoint's chat format."""
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks import build_task, to_example

    tok = AutoTokenizer.from_pretrained(ckpt)
    return [prompt_text(tok, to_example(task, r).messages) for r in build_task(task, "test", n=n)]


def rotated(order: list[str], turn: int) -> list[str]:
    """The engines of ``order`` in the order of interleaved turn ``turn``: rotated by
    ``turn``, reversed every other full cycle, so that over two cycles each engine runs in
    each position, before and after each other engine, equally often."""
    r = turn % len(order)
    out = order[r:] + order[:r]
    return out[::-1] if (turn // len(order)) % 2 else out


def make_llm(ckpt: str, dtype: str, k: int, placement: str | None = None, **llm_kwargs):
    """A CPU engine for ``ckpt``: plain decoding with ``k = 0``, else specstream with k drafts."""
    from vllm import LLM

    from vllm_specstream import speculative_config
    from vllm_specstream.cpu_env import cpu_engine_kwargs

    kw = cpu_engine_kwargs(dtype=dtype)
    if k:
        kw["speculative_config"] = speculative_config(k)
        if placement:
            kw["additional_config"] = {"specstream": {"placement": placement}}
    return LLM(model=ckpt, **kw, **llm_kwargs)


def keep_proposers() -> list:
    """A list that every specstream proposer built in this process from now on joins once
    vLLM has loaded its model (to set its rules between requests)."""
    from vllm_specstream.proposer import SpecStreamProposer

    proposers: list[SpecStreamProposer] = []
    load_model = SpecStreamProposer.load_model

    def keep(self, target_model):
        load_model(self, target_model)
        proposers.append(self)

    SpecStreamProposer.load_model = keep
    return proposers


def adaptive_engine_here(args, num_prompts: int, **engine_kwargs):
    """The default adaptive specstream engine (4 drafts at most, fp32, ``engine_kwargs`` on
    top of :func:`~vllm_specstream.cpu_env.cpu_engine_kwargs`) in this process for
    the checkpoint of :func:`add_task_data_args`' ``args``, its proposer (to set its rules
    between requests) and the first ``num_prompts`` prompts of the task file's split:
    ``(llm, proposer, prompts)``."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from vllm_specstream import speculative_config
    from vllm_specstream.bench import BenchConfig, load_prompts
    from vllm_specstream.cpu_env import cpu_engine_kwargs

    proposers = keep_proposers()
    cfg = BenchConfig(**task_data_fields(args), num_prompts=num_prompts, methods=("plain",))
    prompts = load_prompts(cfg, AutoTokenizer.from_pretrained(args.checkpoint))
    kw = cpu_engine_kwargs(dtype="float32", **engine_kwargs)
    llm = LLM(model=args.checkpoint, speculative_config=speculative_config(4), **kw)
    return llm, proposers[0], prompts


def emit_result(result) -> None:
    # One write: vLLM's threads log to the same stdout.
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def run_child(script: str, argv: list[str]):
    """Run ``script argv`` (a fresh engine) and return what its child emitted."""
    out = subprocess.run(
        [sys.executable, script, *argv], capture_output=True, text=True, env=dict(os.environ)
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])
