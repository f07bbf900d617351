"""Tree verification hooks in vLLM 0.32's model runner (applied by the specstream proposer of
an engine that asks for draft trees, field ``tree_top_k``).

vLLM verifies drafts as chains only: its tree attention backend and tree sampler were
removed. Three hooks add trees without editing vLLM's files, all in the worker while the
runner is built (it builds its proposer before its rejection sampler and its model):

* ``GPUModelRunner._prepare_inputs`` (the CPU runner inherits it) is wrapped: once the step's
  inputs are prepared, the batch's request ids and scheduled drafts say which rows hold a
  tree the proposer filed (:mod:`vllm_specstream.model_executor.trees.step`);
* the runner builds its sampler from the module global ``RejectionSampler``, replaced by
  :class:`~vllm_specstream.model_executor.trees.sampler.TreeRejectionSampler`;
* the CPU attention backend is overridden through vLLM's public ``register_backend``
  (:mod:`vllm_specstream.model_executor.trees.attention`).
"""

from __future__ import annotations

import functools

from vllm_specstream.patches import Patch, wrap_once

TARGET = "vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs"


def _wrap_prepare_inputs(prepare):
    @functools.wraps(prepare)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        from vllm_specstream.model_executor.trees.step import WORKER_TREES

        out = prepare(self, scheduler_output, num_scheduled_tokens)
        batch = self.input_batch
        WORKER_TREES.prepare(
            self,
            batch.req_ids[: batch.num_reqs],
            scheduler_output.scheduled_spec_decode_tokens,
            batch.num_computed_tokens_cpu,
        )
        return out

    return _prepare_inputs


def _apply() -> None:
    from vllm.v1.worker import gpu_model_runner

    from vllm_specstream.model_executor.trees.attention import register_tree_attention
    from vllm_specstream.model_executor.trees.sampler import TreeRejectionSampler

    wrap_once(
        gpu_model_runner.GPUModelRunner,
        "_prepare_inputs",
        _wrap_prepare_inputs,
        "__specstream_tree__",
    )
    gpu_model_runner.RejectionSampler = TreeRejectionSampler
    register_tree_attention()


TREE_RUNNER = Patch(
    name="tree-verification",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="vLLM verifies drafts as chains only (tree attention and tree sampling were removed)",
    apply=_apply,
)
