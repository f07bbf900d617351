"""Speculation under pipeline parallelism: two gaps of vLLM 0.32's V1 engine (applied in a
specstream engine's processes).

* **Drafts for requests still in flight.** vLLM keeps ``pipeline_parallel_size`` batches in
  flight and, scheduling synchronously (the CPU backend always does), takes the drafts after
  each batch it *schedules* (``EngineCore.post_step``), before that batch's tokens come back.
  A request then gets drafts while its step is in flight, is scheduled again on them, and
  its next step misses the token it waits for: greedy output leaves plain decoding's within
  a few tokens. A speculating engine keeps one batch in flight (:func:`batches_in_flight`),
  so each step's drafts follow its own output, as without pipeline parallelism. The
  pipeline then overlaps no micro-batches: on CPUs it serves models too large for one
  socket, not throughput.
* **A drafter on the last rank only.** The runner makes its drafter there but reads it on
  every rank when it builds attention metadata (``AttributeError: 'CPUModelRunner' object
  has no attribute 'drafter'``): the other ranks get ``drafter = None``, which that code
  reads as "no drafter of its own".

(Upstream: vLLM issues #52071 and #44697 describe the same family of faults on GPUs.)
"""

from __future__ import annotations

import functools

from vllm_specstream.patches import Patch, wrap_once

TARGET = "vllm.config.VllmConfig.max_concurrent_batches"
_MARK = "__specstream_pp__"


def batches_in_flight(vllm_config, vllms: int) -> int:
    """How many batches the engine keeps in flight: one where a synchronously scheduled
    engine speculates under pipeline parallelism, else vLLM's ``vllms``."""
    pipelined = vllm_config.parallel_config.pipeline_parallel_size > 1
    sync = not vllm_config.scheduler_config.async_scheduling
    return 1 if pipelined and sync and vllm_config.speculative_config is not None else vllms


def _wrap_load_model(load_model):
    @functools.wraps(load_model)
    def _load_model(self, *args, **kwargs):
        out = load_model(self, *args, **kwargs)
        if self.speculative_config is not None and not hasattr(self, "drafter"):
            self.drafter = None  # a rank before the last: the drafter lives on the last
        return out

    return _load_model


def _apply() -> None:
    from vllm.config import VllmConfig
    from vllm.v1.worker import cpu_model_runner

    vllms = VllmConfig.__dict__["max_concurrent_batches"].fget
    if not getattr(vllms, _MARK, False):
        fget = functools.wraps(vllms)(lambda self: batches_in_flight(self, vllms(self)))
        setattr(fget, _MARK, True)
        VllmConfig.max_concurrent_batches = property(fget)
    wrap_once(cpu_model_runner.CPUModelRunner, "load_model", _wrap_load_model, _MARK)


PIPELINE_SPECULATION = Patch(
    name="pipeline-speculation",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="under pipeline parallelism the engine drafts for requests whose step is still in "
    "flight, and the ranks before the last read a drafter they lack",
    apply=_apply,
)
