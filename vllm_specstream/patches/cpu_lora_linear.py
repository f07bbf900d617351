"""vLLM 0.32's CPU LoRA linear layers, one pass per adapter group.

``PunicaWrapperCPU.add_lora_linear`` runs, for every output slice of every LoRA layer, a
shrink and an expand op through several Python layers (a float32 buffer, views, the
prefill/decode dispatch), and each op sorts the tokens by adapter again. On an AVX2 CPU that
is 74 ms of a 145 ms decode step at batch 1 with two adapters (a plain step of the same base:
49 ms; ``docs/benchmarks.md``, "Many adapters on one server"). The replacement groups the
step's tokens by adapter once (again only when vLLM rewrites its token index tensor) and adds
each slice's ``(x @ A^T * scale) @ B^T`` per group with two matmuls; tokens without an adapter
(index -1) get nothing, as ``patches/cpu_lora_ops.py`` makes the ops do. The arithmetic is
the ops': the shrink in float32 (vLLM's buffer dtype), the expand in the output's dtype.
Calls this does not cover (token counts that do not match the index tensor, an explicit
buffer or other options) go to vLLM's own method.
"""

from __future__ import annotations

import torch

from vllm_specstream.patches import Patch

TARGET = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU.add_lora_linear"

#: ``(slot, rows)`` per adapter present in a step; ``rows`` None: every token.
Groups = list[tuple[int, torch.Tensor | None]]


def token_groups(indices: torch.Tensor) -> Groups:
    """Tokens by adapter slot (``indices[t]``: token ``t``'s slot, -1 none)."""
    slots = torch.unique(indices).tolist()
    if len(slots) == 1:
        return [] if slots[0] < 0 else [(int(slots[0]), None)]
    return [(int(s), (indices == s).nonzero().squeeze(1)) for s in slots if s >= 0]


def _slot(weights: torch.Tensor, slot: int) -> torch.Tensor:
    """``[out, in]`` weight of ``slot`` from ``[slots, out, in]`` or ``[slots, 1, out, in]``."""
    return weights[slot, 0] if weights.dim() == 4 else weights[slot]


def grouped_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    lora_b: tuple[torch.Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    groups: Groups,
) -> None:
    """``y[:, slice i] += (x @ A_i[slot]^T * scale) @ B_i[slot]^T`` for each token's slot
    (``y``: ``[tokens, sum(output_slices)]``, in place)."""
    offset = 0
    for a, b, size in zip(lora_a, lora_b, output_slices):
        for slot, rows in groups:
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = (xs.float() @ _slot(a, slot).float().T) * scale
            delta = shrunk.to(y.dtype) @ _slot(b, slot).to(y.dtype).T
            if rows is None:
                y[:, offset : offset + size] += delta
            else:
                y[:, offset : offset + size].index_add_(0, rows, delta)
        offset += size


def _cached_groups(wrapper, indices: torch.Tensor) -> Groups:
    # vLLM rewrites the index tensor in place once per step: its version counter (shared
    # by the slices of one buffer) says when the grouping is stale.
    key = (indices.data_ptr(), indices.shape[0], indices._version)
    cached = getattr(wrapper, "_specstream_groups", None)
    if cached is None or cached[0] != key:
        cached = (key, token_groups(indices))
        wrapper._specstream_groups = cached
    return cached[1]


def _wrap(original):
    import functools

    @functools.wraps(original)
    def add_lora_linear(
        self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kw
    ):
        indices = self.token_lora_indices
        y2, x2 = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        if buffer is not None or kw or x2.shape[0] != indices.shape[0]:
            return original(
                self,
                y,
                x,
                lora_a_stacked,
                lora_b_stacked,
                scale,
                output_slices,
                buffer=buffer,
                **kw,
            )
        groups = _cached_groups(self, indices)
        grouped_lora_linear(y2, x2, lora_a_stacked, lora_b_stacked, scale, output_slices, groups)
        return None

    add_lora_linear.__specstream_grouped__ = True
    return add_lora_linear


def _apply() -> None:
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    PunicaWrapperCPU.add_lora_linear = _wrap(PunicaWrapperCPU.add_lora_linear)


CPU_LORA_LINEAR = Patch(
    name="cpu-lora-linear-grouped",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="CPU LoRA linear layers regroup every token by adapter in each of two ops per slice",
    apply=_apply,
)
