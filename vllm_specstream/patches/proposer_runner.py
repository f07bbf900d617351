"""Hands the model runner to the specstream proposer (applied by a proposer with suffix
drafts, field ``suffix_drafts`` or the checkpoint's ``specstream.suffix_drafts``).

vLLM 0.32 calls a ``custom_class`` proposer with the sampled tokens and the token table only,
while its own ``suffix`` proposer gets the input batch: suffix trees are kept per request and
started from its prompt, so they need the batch's request ids and prompt lengths. The runner's
``load_model`` (the CPU runner's own, and the GPU runner's) is wrapped: once it has loaded the
drafter, a drafter with ``bind_runner`` is given the runner.
"""

from __future__ import annotations

import functools

from vllm_specstream.patches import Patch, wrap_once

TARGET = "vllm.v1.worker.cpu_model_runner.CPUModelRunner.load_model"


def _wrap_load_model(load_model):
    @functools.wraps(load_model)
    def wrapped(self, *args, **kwargs):
        out = load_model(self, *args, **kwargs)
        bind = getattr(getattr(self, "drafter", None), "bind_runner", None)
        if bind is not None:
            bind(self)
        return out

    return wrapped


def _apply() -> None:
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    for runner in (cpu_model_runner.CPUModelRunner, gpu_model_runner.GPUModelRunner):
        # The CPU runner defines its own load_model: wrap each class's own.
        if "load_model" in vars(runner):
            wrap_once(runner, "load_model", _wrap_load_model, "__specstream_runner__")


PROPOSER_RUNNER = Patch(
    name="proposer-runner",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="a custom_class proposer is not given the input batch (request ids, prompt lengths) "
    "that suffix trees are kept by",
    apply=_apply,
)
