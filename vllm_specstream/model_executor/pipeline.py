"""Pipeline parallelism: where the streams' input crosses a rank boundary (vLLM touch point).

The streams start from the residual stream entering the first MSA layer, which the decoder
returns as an EAGLE-3 auxiliary hidden state (``set_aux_hidden_state_layers``). Where that
layer is the first of a rank's, the rank before computes the state and sends it in the
pipeline's intermediate tensors under vLLM's ``aux_hidden_states_<i>`` keys. vLLM 0.32's V1
model runner (every CPU engine's) makes the receiving buffers with the model's
``make_empty_intermediate_tensors``, which lists only ``hidden_states`` and ``residual``: the
decoder then fails with ``Missing aux_hidden_states_0 from PP intermediate tensors``, even
without speculation. (vLLM's V2 runner reserves the slots itself.) The streams run on the
last rank, which must hold every MSA layer (``speculation/preflight.py`` checks the split);
the runner's own gaps under speculation: ``patches/pipeline_speculation.py``.
"""

from __future__ import annotations

import torch


def reserve_aux_slots(model) -> None:
    """Give ``model.make_empty_intermediate_tensors`` a slot for each auxiliary hidden state
    this rank receives from the ranks before it (none on the first rank or without PP)."""
    decoder = model.model
    received = getattr(decoder, "_aux_slot_base_cached", 0)
    if received == 0:
        return
    key, hidden_size = decoder.AUX_HIDDEN_STATE_KEY, decoder.config.hidden_size
    make_empty = model.make_empty_intermediate_tensors

    def make_empty_with_aux(batch_size: int, dtype: torch.dtype, device: torch.device):
        tensors = make_empty(batch_size, dtype, device)
        for i in range(received):
            tensors[f"{key}{i}"] = torch.zeros(
                (batch_size, hidden_size), dtype=dtype, device=device
            )
        return tensors

    model.make_empty_intermediate_tensors = make_empty_with_aux
