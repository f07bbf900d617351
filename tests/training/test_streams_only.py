"""Streams-only adapters: the main stream stays the frozen base; a LoRA on the stream rows
only; trained on the base model's own replies; exported with the base's weights unchanged."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_llama

from vllm_specstream.checkpoint.config import (
    STREAM_LORA_STAGES,
    ConfigError,
    SpecStreamConfig,
    projection_dims,
    stream_lora_name,
)
from vllm_specstream.training.checkpoint import (
    STREAM_FILE,
    build_model,
    export_merged,
    load_adapter,
    load_base_lm,
    load_merged,
    save_adapter,
)
from vllm_specstream.training.data import (
    ChatExample,
    prompt_key,
    read_replies,
    user_example,
    with_replies,
)
from vllm_specstream.training.loss import specstream_loss

CONFIG = dict(num_streams=3, num_msa_layers=2, stream_lora_rank=4)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    tiny_llama().save_pretrained(d)
    return d


def streams_only(base_dir, seed=0):
    torch.manual_seed(seed)
    model = build_model(base_dir, SpecStreamConfig(**CONFIG), None, stream_init_std=0.5)
    with torch.no_grad():  # as if trained: the stream LoRA's B away from its zero init
        for p in model.stream_parameters().values():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def batch_of(ids):
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "labels_mask": torch.tensor([[False] * 4 + [True] * 6] * ids.shape[0]),
    }


def test_stream_lora_shapes_follow_vllms_merged_projections(base_dir):
    model = streams_only(base_dir)
    dims = projection_dims(model.causal_lm.config)
    # 4 heads x 16 + 2 x 2 kv heads x 16; gate and up of 128 each.
    assert dims == {"qkv": (64, 128), "o": (64, 64), "gate_up": (64, 256), "down": (128, 64)}
    params = {n: tuple(p.shape) for n, p in model.stream_parameters().items()}
    for i in range(2):
        for stage in STREAM_LORA_STAGES:
            d_in, d_out = dims[stage]
            assert params[stream_lora_name(i, stage, "a")] == (4, d_in)
            assert params[stream_lora_name(i, stage, "b")] == (d_out, 4)
    with pytest.raises(ConfigError, match="the model.s config"):
        SpecStreamConfig(**CONFIG).stream_tensor_shapes(64)  # no model config


def test_main_stream_is_the_base_and_only_stream_tensors_train(base_dir):
    """The main logits equal the base model's exactly; the loss has the streams' terms only
    and its gradient reaches every stream tensor, each stream LoRA among them."""
    model = streams_only(base_dir)
    model.train()
    base = tiny_llama()
    ids = torch.randint(3, 128, (2, 10))
    with torch.no_grad():
        want = base(ids).logits
    out = model(ids, anchors=torch.tensor([[3, 5], [4, -1]]))
    assert torch.equal(model.lm_head(out.main_hidden), want)
    assert not out.main_hidden.requires_grad  # the main stream ran without autograd
    loss, metrics = specstream_loss(model, batch_of(ids), "streams-only")
    assert "loss_main" not in metrics and {"loss_stream1", "top1_stream3"} <= set(metrics)
    loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(model.stream_parameters())
    for name in trainable:
        assert model.get_parameter(name).grad.abs().sum() > 0, name


def test_stream_lora_changes_the_streams_only(base_dir):
    """Zeroing the stream LoRA changes the stream logits and leaves the main ones."""
    model = streams_only(base_dir).eval()
    ids = torch.randint(3, 128, (1, 9))
    anchors = torch.tensor([[2, 6]])
    with torch.no_grad():
        before = model(ids, anchors=anchors)
        for i in range(2):
            for stage in STREAM_LORA_STAGES:
                model.get_parameter(stream_lora_name(i, stage, "b")).zero_()
        after = model(ids, anchors=anchors)
    assert torch.equal(before.main_hidden, after.main_hidden)
    assert not torch.allclose(before.stream_hidden, after.stream_hidden)


def test_export_keeps_the_base_weights_and_round_trips(base_dir, tmp_path):
    model = streams_only(base_dir).eval()
    adapter = save_adapter(model, tmp_path / "adapter")
    # Its PEFT files (for vLLM multi-LoRA) are a LoRA that PEFT loads and that changes nothing.
    from peft import PeftModel

    lm = load_base_lm(base_dir)
    ids = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        plain = lm(ids).logits
        with_null = PeftModel.from_pretrained(lm, str(adapter))
        assert len(with_null.peft_config["default"].target_modules) == 1
        assert torch.equal(with_null(ids).logits, plain)
    merged = export_merged(adapter, tmp_path / "merged", dtype=torch.float32)
    base = load_file(str(base_dir / "model.safetensors"))
    weights = load_file(str(merged / "model.safetensors"))
    assert set(weights) == set(base) and all(torch.equal(weights[k], base[k]) for k in base)
    section = json.loads((merged / "config.json").read_text())["specstream"]
    assert section["stream_lora_rank"] == 4
    streams = load_file(str(merged / STREAM_FILE))
    assert f"specstream.{stream_lora_name(1, 'down', 'b')}" in streams
    anchors = torch.tensor([[2, 6]])
    with torch.no_grad():
        want = model(ids, anchors=anchors).stream_hidden
        for loaded in (load_adapter(adapter, base=base_dir), load_merged(merged)):
            assert torch.equal(loaded(ids, anchors=anchors).stream_hidden, want)


def test_replies_replace_completions_once_per_prompt(tmp_path):
    a, b = user_example("q1", "ref 1"), user_example("q2", "ref 2")
    again = ChatExample(messages=a.messages, completion="ref 1, another reference")
    path = tmp_path / "self_distill.jsonl"
    path.write_text(
        "".join(
            json.dumps({"messages": e.messages, "completion": f"model says {i}"}) + "\n"
            for i, e in enumerate((a, b))
        )
    )
    replies = read_replies(path)
    assert replies[prompt_key(b.messages)] == "model says 1"
    out = with_replies([a, again, b], replies, str(path))
    assert [e.completion for e in out] == ["model says 0", "model says 1"]
    with pytest.raises(ValueError, match="no reply"):
        with_replies([user_example("q3", "x")], replies, str(path))
    path.write_text('{"completion": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"self_distill.jsonl:1.*messages"):
        read_replies(path)


def test_two_stage_streams_on_a_merged_fine_tune_learn_as_on_its_adapter(base_dir, tmp_path):
    """The two-stage objective's second stage: streams on the next-token adapter merged into
    its base (a checkpoint `specstream export` wrote, loaded as --base) have the loss and
    gradients of the same streams on the unmerged adapter with its LoRA frozen; the cached
    frozen prefix gives them too."""
    from peft import set_peft_model_state_dict

    from vllm_specstream.training.checkpoint import PEFT_WEIGHTS_FILE, LoraSettings
    from vllm_specstream.training.fast_batches import pack_batch, prefix_hidden

    torch.manual_seed(0)
    lora = LoraSettings(rank=4, layers="all", target_modules=["q_proj", "v_proj", "down_proj"])
    ntp = build_model(base_dir, SpecStreamConfig(num_streams=3, num_msa_layers=2), lora)
    with torch.no_grad():  # as if trained: LoRA changes the model
        for name, p in ntp.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    adapter = save_adapter(ntp, tmp_path / "ntp")
    merged = export_merged(adapter, tmp_path / "ntp-merged", dtype=torch.float32)

    two_stage = build_model(merged, SpecStreamConfig(**CONFIG), None, stream_init_std=0.5)
    plain = build_model(base_dir, SpecStreamConfig(**CONFIG), lora, stream_init_std=0.5)
    set_peft_model_state_dict(plain.lm, load_file(str(adapter / PEFT_WEIGHTS_FILE)))
    for p in plain.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        for name, p in two_stage.stream_parameters().items():
            p.add_(torch.randn_like(p) * 0.1)  # the stream LoRA's B away from zero
            plain.get_parameter(name).copy_(p)
            plain.get_parameter(name).requires_grad_(True)

    ids = torch.randint(3, 128, (3, 10))
    batch = batch_of(ids)

    def loss_and_grads(model, b):
        model.zero_grad()
        loss, _ = specstream_loss(model, b, "streams-only")
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.stream_parameters().items()}

    want_loss, want_grads = loss_and_grads(plain, batch)
    loss, grads = loss_and_grads(two_stage, batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():  # the main stream is the fine-tune's, not the base's
        fine_tuned = two_stage.lm_head(two_stage(ids).main_hidden)
        assert not torch.allclose(fine_tuned, load_base_lm(base_dir)(ids).logits, atol=1e-3)

    encoded = [{"input_ids": r.tolist(), "labels_mask": [False] * 4 + [True] * 6} for r in ids]
    start = two_stage.first_msa_layer
    cached = prefix_hidden(two_stage, encoded, start, batch_size=2)
    packed = pack_batch(encoded, 64, 3, cached, start).as_dict()
    loss, grads = loss_and_grads(two_stage, packed)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_two_stage_adapter_exports_as_its_second_stage_on_the_first_merged(base_dir, tmp_path):
    """The two stages as one adapter (the first stage's LoRA, the second's streams) export to
    the same checkpoint as the second stage exported onto the first stage merged."""
    from vllm_specstream.training.checkpoint import (
        PEFT_WEIGHTS_FILE,
        LoraSettings,
        two_stage_adapter,
    )

    torch.manual_seed(0)
    ntp = build_model(base_dir, SpecStreamConfig(num_streams=3, num_msa_layers=2), LoraSettings(4))
    with torch.no_grad():
        for name, p in ntp.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: the LoRA would change nothing
                p.normal_(0, 0.2)
    first = save_adapter(ntp, tmp_path / "ntp")
    first_merged = export_merged(first, tmp_path / "ntp-merged", dtype=torch.float32)
    second = save_adapter(streams_only(first_merged), tmp_path / "streams")
    combined = two_stage_adapter(first, second, tmp_path / "two-stage")
    assert (combined / "first_stage").is_dir()
    a = export_merged(combined, tmp_path / "a", dtype=torch.float32)
    b = export_merged(second, tmp_path / "b", dtype=torch.float32)
    for name in ("model.safetensors", STREAM_FILE):
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        assert ta.keys() == tb.keys()
        assert all(torch.equal(ta[k], tb[k]) for k in ta), name
    base = load_file(str(tmp_path / "ntp-merged" / "model.safetensors"))
    assert any(
        not torch.equal(base[k], t)
        for k, t in load_file(str(base_dir / "model.safetensors")).items()
    )
    sections = [json.loads((d / "config.json").read_text())["specstream"] for d in (a, b)]
    assert sections[0].pop("base_model") == str(base_dir)  # the first stage's base
    sections[1].pop("base_model")
    assert sections[0] == sections[1]
    # Stored in bf16 (the committed task adapters): half the bytes, the same model but for
    # bf16's rounding of the LoRA and stream tensors.
    half = two_stage_adapter(first, second, tmp_path / "bf16", dtype=torch.bfloat16)
    for name in (PEFT_WEIGHTS_FILE, STREAM_FILE):
        size, full = ((d / name).stat().st_size for d in (half, combined))
        assert size < 0.55 * full, name
    c = export_merged(half, tmp_path / "c", dtype=torch.float32)
    for name in ("model.safetensors", STREAM_FILE):
        ta, tc = load_file(str(a / name)), load_file(str(c / name))
        for k in ta:
            torch.testing.assert_close(tc[k], ta[k], rtol=0.01, atol=0.01, msg=f"{name}: {k}")
