"""Fixes vLLM 0.32's CPU ``expand_kernel`` so that sampling with speculation is lossless.

``vllm.utils.cpu_triton_utils._expand_kernel_impl`` (the C++ stand-in for the Triton
``expand_kernel`` on CPUs) passes ``_ensure_int64(output)`` to the C++ op. For float32 and
int32 outputs that is a *copy*: the op fills the copy and ``expand_batch_to_tokens`` returns
the untouched ``new_empty`` tensor. The rejection sampler then scales target logits by
uninitialised per-token temperatures (and top-k/top-p), so every speculative method on CPU
(ngram included) samples from garbage at temperature > 0. The replacement below writes
into ``output`` itself. It must be in place before the worker calls
``CpuPlatform.register_triton_kernel_overrides()``, which reads the attribute; vLLM loads
plugins in the worker just before that call. See docs/upstream-issues.md.
"""

from __future__ import annotations

import torch

from vllm_specstream.patches import Patch

TARGET = "vllm.utils.cpu_triton_utils._expand_kernel_impl"


def expand_kernel_impl(
    output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None
):
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (with ``replace_from`` -> ``replace_to``),
    written into ``output`` whatever its dtype."""
    counts = torch.diff(
        cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long)
    )
    values = torch.where(
        input_val == replace_from, torch.full_like(input_val, replace_to), input_val
    )
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.shape[0]] = expanded.to(output.dtype)


def _apply() -> None:
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl


EXPAND_KERNEL = Patch(
    name="cpu-expand-kernel-in-place",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="the CPU expand kernel fills a copy, so spec-decode sampling at T>0 reads garbage",
    apply=_apply,
)
