"""The multi-stream wrapper: main stream == HF model, streams see only what docs/method.md allows."""

import pytest
import torch
from tiny import tiny_llama

from vllm_specstream.checkpoint.config import ConfigError, SpecStreamConfig
from vllm_specstream.training.model import SpecStreamModel


def make(model_type="llama", overrides=None, **cfg):
    lm = tiny_llama(model_type, **(overrides or {}))
    config = SpecStreamConfig(num_streams=3, num_msa_layers=2, **cfg)
    torch.manual_seed(1)
    return SpecStreamModel(lm, config, stream_init_std=1.0).eval()


#: Every supported family, and Phi-3 with partial rotary (Phi-4-mini's layout).
FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_main_stream_equals_hf(family):
    model = make(*FAMILIES[family])
    ids = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        out = model(ids, anchors=torch.tensor([[3, 11], [0, 5]]))
        ref = model.lm(ids).logits
    torch.testing.assert_close(model.lm_head(out.main_hidden), ref, atol=1e-4, rtol=1e-4)
    assert out.stream_hidden.shape == (2, 2, 3, 64)


def test_main_stream_never_sees_streams():
    model = make()
    ids = torch.randint(3, 128, (1, 10))
    with torch.no_grad():
        a = model(ids, anchors=torch.tensor([[2, 6]])).main_hidden
        model.stream_embeddings.add_(5.0)
        b = model(ids, anchors=torch.tensor([[2, 6]])).main_hidden
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_streams_see_nothing_after_anchor():
    model = make()
    ids = torch.randint(3, 128, (1, 12))
    ids2 = ids.clone()
    ids2[0, 6:] = torch.randint(3, 128, (6,))
    anchors = torch.tensor([[5]])
    with torch.no_grad():
        s1 = model(ids, anchors).stream_hidden
        s2 = model(ids2, anchors).stream_hidden
    torch.testing.assert_close(s1, s2, atol=0, rtol=0)


def test_stream_j_sees_no_later_stream():
    model = make()
    ids = torch.randint(3, 128, (1, 8))
    anchors = torch.tensor([[4]])
    with torch.no_grad():
        s1 = model(ids, anchors).stream_hidden
        model.stream_embeddings[2].add_(3.0)  # stream 3 changes
        s2 = model(ids, anchors).stream_hidden
    torch.testing.assert_close(s1[..., :2, :], s2[..., :2, :], atol=0, rtol=0)
    assert not torch.allclose(s1[..., 2, :], s2[..., 2, :])


def naive_streams(model, ids, t):
    """Streams at anchor t, computed by running the sequence x[0..t] alone: no other anchors,
    no tokens after t, one anchor per forward."""
    with torch.no_grad():
        return model(ids[:, : t + 1], anchors=torch.tensor([[t]])).stream_hidden[:, 0]


@pytest.mark.parametrize("stream_position", ["shifted", "anchor"])
def test_batched_anchors_equal_one_anchor_at_a_time(stream_position):
    model = make(stream_position=stream_position, init_rank=4)
    with torch.no_grad():
        model.init_b.normal_(0, 0.1)
    ids = torch.randint(3, 128, (1, 11))
    anchors = torch.arange(11)[None]
    with torch.no_grad():
        batched = model(ids, anchors).stream_hidden[0]
    for t in range(11):
        torch.testing.assert_close(
            batched[t], naive_streams(model, ids, t)[0], atol=1e-5, rtol=1e-5
        )


def test_right_padding_does_not_change_results():
    model = make()
    ids = torch.randint(3, 128, (1, 7))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1] * 7 + [0] * 3])
    with torch.no_grad():
        a = model(ids, torch.tensor([[2, 6]]))
        b = model(padded, torch.tensor([[2, 6]]), attention_mask=mask)
    torch.testing.assert_close(a.stream_hidden, b.stream_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.main_hidden, b.main_hidden[:, :7], atol=1e-5, rtol=1e-5)


def test_cache_continuation_equals_full_forward():
    model = make()
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        full = model(ids, anchors=torch.tensor([[8, 11]]))
        first = model(ids[:, :7], use_cache=True)
        rest = model(ids[:, 7:], anchors=torch.tensor([[1, 4]]), cache=first.cache)
    torch.testing.assert_close(rest.main_hidden, full.main_hidden[:, 7:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest.stream_hidden, full.stream_hidden, atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=2, vocab_size=64)
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        SpecStreamModel(AutoModelForCausalLM.from_config(cfg), SpecStreamConfig(num_msa_layers=1))


def test_too_many_msa_layers_is_refused():
    with pytest.raises(ConfigError, match="num_msa_layers is 9 but the model has only 4"):
        SpecStreamModel(tiny_llama(), SpecStreamConfig(num_msa_layers=9))


@pytest.mark.parametrize(("init_rank", "prune"), [(0, False), (4, False), (4, True)])
def test_stream_tensors_are_the_configs(init_rank, prune):
    """Names and shapes come from ``SpecStreamConfig.stream_tensor_shapes`` (as in checkpoints
    and in vLLM); the adapters start as the identity (B = 0), absent ones read as None."""
    from vllm_specstream.checkpoint.config import PruneConfig

    config = SpecStreamConfig(
        num_streams=3, num_msa_layers=2, init_rank=init_rank, prune=PruneConfig(enabled=prune)
    )
    model = SpecStreamModel(tiny_llama(), config)
    params = model.stream_parameters()
    assert {n: tuple(p.shape) for n, p in params.items()} == config.stream_tensor_shapes(64)
    assert all(p.requires_grad for p in params.values())
    for name in ("init_a", "init_b", "prune_a", "prune_b"):
        assert (getattr(model, name) is None) == (name not in params)
    for name in ("init_b", "prune_b"):
        if name in params:
            assert not params[name].any() and params[name.replace("_b", "_a")].any()
