"""Stream rows' adapter deltas under vLLM multi-LoRA (model_executor/lora/vllm_lora_layers.py)."""

from types import SimpleNamespace

import torch
from torch import nn

from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.lora.vllm_lora_layers import (
    StreamLoRA,
    fused_lora_linear,
    is_lora_wrapped,
    request_slots,
    stream_delta,
)


class VllmLinear(nn.Linear):
    """vLLM's linear layers return ``(output, output_bias)``."""

    def forward(self, x):
        return super().forward(x), None


class FakeLoRALinear(nn.Module):
    """The attributes of a vLLM ``*WithLoRA`` linear the plugin reads: two output slices,
    three slots, rank 2 (B already scaled, as vLLM stores it)."""

    def __init__(self, main_slots):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base_layer = VllmLinear(6, 5, bias=False)
        self.output_slices = (3, 2)
        self.lora_a_stacked = tuple(torch.randn(3, 1, 2, 6, generator=g) for _ in range(2))
        self.lora_b_stacked = tuple(torch.randn(3, 1, w, 2, generator=g) for w in (3, 2))
        self.punica_wrapper = SimpleNamespace(token_lora_indices=main_slots)

    def delta(self, x, slots):
        rows = []
        for r, slot in enumerate(slots.tolist()):
            if slot < 0:
                rows.append(torch.zeros(5))
                continue
            parts = [
                b[slot, 0] @ (a[slot, 0] @ x[r])
                for a, b in zip(self.lora_a_stacked, self.lora_b_stacked)
            ]
            rows.append(torch.cat(parts))
        return torch.stack(rows)

    def _apply_lora_to_output(self, x, y):  # vLLM's main-row path
        y += self.delta(x, self.punica_wrapper.token_lora_indices)
        return y


def test_fused_call_gives_main_rows_the_wrapper_output_and_stream_rows_their_own_adapter():
    main_slots = torch.tensor([0, -1])
    module = FakeLoRALinear(main_slots)
    assert is_lora_wrapped(module) and not is_lora_wrapped(module.base_layer)
    x, s = torch.randn(2, 6), torch.randn(4, 6)
    stream_slots = torch.tensor([0, 0, -1, 2])
    with torch.no_grad():
        main, stream = fused_lora_linear(module, x, s, stream_slots)
        want_main = module.base_layer(x)[0] + module.delta(x, main_slots)
        want_stream = module.base_layer(s)[0] + module.delta(s, stream_slots)
    assert main[1] is None  # the wrapper's (output, output_bias)
    assert torch.allclose(main[0], want_main, atol=1e-5)
    assert torch.allclose(stream, want_stream, atol=1e-5)
    assert torch.allclose(stream[2], module.base_layer(s[2])[0], atol=1e-6)  # no adapter: base
    assert torch.allclose(
        stream_delta(module, s, stream_slots, torch.float32),
        module.delta(s, stream_slots),
        atol=1e-5,
    )


def test_stream_rows_take_the_slot_of_their_request():
    # requests of 1, 3 and 2 scheduled tokens; slot of each request's first token
    module = FakeLoRALinear(torch.tensor([1, 0, 0, 0, -1, -1]))
    batch = ForwardBatch(
        query_start_loc=torch.tensor([0, 1, 4, 6]),
        seq_lens=torch.tensor([5, 9, 7]),
        block_table=torch.zeros(3, 1, dtype=torch.int32),
        positions=torch.arange(6),
    )
    assert request_slots(module, batch).tolist() == [1, 0, -1]
    lora = StreamLoRA(module)
    lora.begin(batch, rows_per_request=2)
    assert lora.row_slots.tolist() == [1, 1, 0, 0, -1, -1]


def test_second_pass_weights_add_the_delta_to_the_base_layer():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            slots = torch.tensor([0])
            self.self_attn = SimpleNamespace(qkv_proj=FakeLoRALinear(slots), o_proj=nn.Identity())
            self.mlp = SimpleNamespace(gate_up_proj=nn.Identity(), down_proj=nn.Identity())

    layer = Layer()
    lora = StreamLoRA(layer.self_attn.qkv_proj)
    lora.row_slots = torch.tensor([2, -1])
    weights = lora.weights([layer], packed=None)
    s = torch.randn(2, 6)
    qkv = layer.self_attn.qkv_proj
    with torch.no_grad():
        got = weights.layers[0].qkv(s)
        want = qkv.base_layer(s)[0] + qkv.delta(s, lora.row_slots)
    assert torch.allclose(got, want, atol=1e-5)
