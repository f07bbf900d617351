"""Pipeline parallelism: the receiving slots of the streams' input (the engine test:
tests/vllm/test_engine_checkpoints.py)."""

from types import SimpleNamespace

import torch

from vllm_specstream.model_executor.pipeline import reserve_aux_slots


def model_receiving(received: int):
    decoder = SimpleNamespace(
        _aux_slot_base_cached=received,
        AUX_HIDDEN_STATE_KEY="aux_hidden_states_",
        config=SimpleNamespace(hidden_size=8),
    )

    def make_empty(batch_size, dtype, device):
        return {"hidden_states": torch.zeros(batch_size, 8, dtype=dtype, device=device)}

    return SimpleNamespace(model=decoder, make_empty_intermediate_tensors=make_empty)


def test_a_rank_that_receives_the_streams_input_gets_its_slot():
    model = model_receiving(1)
    reserve_aux_slots(model)
    tensors = model.make_empty_intermediate_tensors(5, torch.float32, "cpu")
    assert sorted(tensors) == ["aux_hidden_states_0", "hidden_states"]
    assert tensors["aux_hidden_states_0"].shape == (5, 8)


def test_a_rank_that_receives_nothing_keeps_vllms_buffers():
    model = model_receiving(0)
    before = model.make_empty_intermediate_tensors
    reserve_aux_slots(model)
    assert model.make_empty_intermediate_tensors is before
