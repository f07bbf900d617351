"""Fixes vLLM 0.32's CPU LoRA ops (``vllm.lora.ops.torch_ops``) for tokens without an adapter.

The ops pick each token's adapter with ``weights[indices]``; a token of a request without an
adapter has index -1, which torch reads as the *last* slot. So under ``enable_lora`` a
base-model request batched (or served after) a LoRA request silently runs another task's
adapter. The ops also copy every token's adapter weights (``[tokens, out, in]``) before one
batched product. The replacements group the tokens by adapter: one matmul per adapter
present, nothing added for -1. Same contract otherwise (shapes, ``add_inputs``, slices,
``scaling``). See docs/upstream-issues.md.
"""

from __future__ import annotations

import torch

from vllm_specstream.patches import Patch

TARGET = "vllm.lora.ops.torch_ops.lora_ops.bgmv_{shrink,expand,expand_slice}"


def lora_matmul(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[rows, out]``: row ``r`` is ``weights[indices[r]] @ inputs[r]`` in ``dtype``; zero
    where ``indices[r] < 0`` (no adapter). ``weights``: ``[slots, out, in]`` or
    ``[slots, 1, out, in]``; a single input row or index broadcasts over the other."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    rows = max(inputs.shape[0], indices.shape[0])
    inputs = inputs.expand(rows, -1)
    indices = indices.expand(rows)
    out = inputs.new_zeros(rows, weights.shape[1])
    for slot in torch.unique(indices).tolist():
        if slot < 0:
            continue
        weight = weights[slot].to(dtype)
        mine = indices == slot
        if bool(mine.all()):
            out = inputs @ weight.T
        else:
            where = mine.nonzero().squeeze(1)
            out.index_copy_(0, where, inputs.index_select(0, where) @ weight.T)
    return out


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    outputs = lora_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1  # vLLM's contract: a single row lands in the first output row only
    # The adapter and the model may pad the output dimension differently.
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs,
    lora_b_weights,
    output_tensor,
    lora_indices_tensor,
    slice_offset,
    slice_size,
    add_inputs=True,
):
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


REPLACEMENTS = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
}


def _apply() -> None:
    # lora_ops' own sgmv_* call its module globals; the package and the CPU punica wrapper
    # imported the names themselves.
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, torch_ops, punica_cpu):
        for name, fn in REPLACEMENTS.items():
            setattr(module, name, fn)


CPU_LORA_OPS = Patch(
    name="cpu-lora-no-adapter-rows",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="CPU LoRA ops give tokens without an adapter (index -1) the last slot's adapter",
    apply=_apply,
)
