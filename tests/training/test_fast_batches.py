"""Packed rows and the cached frozen prefix give the padded batch's loss and gradients."""

import json
import logging
import random

import pytest
import torch
from test_train import args_for, tiny_base  # noqa: F401 (fixture)
from tiny import tiny_llama

from vllm_specstream.checkpoint.config import PruneConfig, SpecStreamConfig
from vllm_specstream.training.batches import collate
from vllm_specstream.training.fast_batches import (
    first_trainable_layer,
    pack_batch,
    pack_rows,
    prefix_hidden,
)
from vllm_specstream.training.loss import select_anchors, specstream_loss
from vllm_specstream.training.model import SpecStreamModel, attention_blocks
from vllm_specstream.training.train import train


def lora_model(layers: list[int], prune: bool = False) -> SpecStreamModel:
    from peft import LoraConfig, get_peft_model

    lm = tiny_llama(layers=6)
    for p in lm.parameters():
        p.requires_grad_(False)
    lm = get_peft_model(
        lm,
        LoraConfig(
            r=4, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=layers
        ),
    )
    torch.manual_seed(1)
    for name, p in lm.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)  # non-zero, so LoRA changes the forward
    config = SpecStreamConfig(num_streams=3, num_msa_layers=3, prune=PruneConfig(enabled=prune))
    return SpecStreamModel(lm, config, stream_init_std=1.0).train()


def examples(n: int, seed: int = 0) -> list[dict]:
    """Chat-like examples: an unlabelled prompt, then a labelled completion."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(5, 30), rng.randint(1, 12)
        ids = [rng.randrange(3, 128) for _ in range(p + c)]
        out.append({"input_ids": ids, "labels_mask": [False] * p + [True] * c})
    return out


def loss_and_grads(model, batch, objective="specstream"):
    """Loss, metrics and the gradient of every parameter the objective trains."""
    model.zero_grad()
    loss, metrics = specstream_loss(model, batch, objective)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


@pytest.mark.parametrize("prune", [False, True])
def test_packed_and_cached_batches_equal_the_padded_batch(prune):
    model = lora_model([3, 4, 5], prune=prune)
    batch = examples(7)
    start = first_trainable_layer(model)
    assert start == 3
    hidden = prefix_hidden(model, batch, start, batch_size=3)
    want_loss, want_metrics, want_grads = loss_and_grads(model, collate(batch))
    assert want_grads.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for cached in (None, hidden):
        packed = pack_batch(batch, 64, 3, cached, start)
        assert packed.input_ids.shape[0] < len(batch)  # examples really share rows
        loss, metrics, grads = loss_and_grads(model, packed.as_dict())
        assert grads.keys() == want_grads.keys()
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        assert metrics.keys() == want_metrics.keys()
        for k in metrics:
            assert metrics[k] == pytest.approx(want_metrics[k], rel=1e-4, abs=1e-5), k
        for name, g in want_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


def projected_rows(model, batch, objective):
    """The loss and gradients of ``batch``, and how many rows the last layer's q and o
    projections saw (main and stream rows together)."""
    layer = model.decoder.layers[-1].self_attn
    seen = {"q": 0, "o": 0}

    def count(name):
        def hook(module, args):
            seen[name] += args[0].shape[:-1].numel()

        return hook

    hooks = [layer.q_proj.register_forward_pre_hook(count("q"))]
    hooks.append(layer.o_proj.register_forward_pre_hook(count("o")))
    try:
        loss, _, grads = loss_and_grads(model, batch, objective)
    finally:
        for h in hooks:
            h.remove()
    return loss, grads, seen


@pytest.mark.parametrize("objective", ["specstream", "ntp", "streams-only"])
def test_packed_pass_projects_only_the_rows_a_loss_reads(objective):
    """Padding positions, padding anchors' streams and the last layer's unread outputs cost
    no projection, and the loss and gradients are those of the full pass."""
    model = lora_model([3, 4, 5])
    packed = pack_batch(examples(7, seed=3), 64, 3).as_dict()
    full = dict(packed, skip_unread=False)
    want_loss, want_grads, full_rows = projected_rows(model, full, objective)
    loss, grads, rows = projected_rows(model, packed, objective)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)

    labels, real = packed["labels_mask"], packed["attention_mask"]
    r, t = labels.shape
    assert r < 7  # rows hold several examples, whose streams attend per example
    anchors = select_anchors(labels, 3) if objective != "ntp" else torch.empty(r, 0)
    stream_rows, all_stream_rows = int((anchors >= 0).sum()) * 3, anchors.numel() * 3
    read = 0 if objective == "streams-only" else int(labels[:, 1:].sum())
    if objective != "ntp":
        assert all_stream_rows > stream_rows  # the batch has padding anchors, and padding
    assert r * t > int(real.sum())
    assert full_rows == {"q": r * t + all_stream_rows, "o": r * t + all_stream_rows}
    assert rows == {"q": int(real.sum()) + stream_rows, "o": read + stream_rows}


def test_attention_blocks_are_runs_of_anchors_of_one_example():
    def sees(p0, p1, width=10):
        return [p0 <= p < p1 for p in range(width)]

    mask = torch.tensor(
        [
            [sees(0, 3), sees(0, 4), sees(5, 7), sees(5, 8), sees(0, 0)],
            [sees(0, 2), sees(0, 9), sees(0, 0), sees(0, 0), sees(0, 0)],
        ]
    )
    assert attention_blocks(mask) == [[(0, 2, 0, 4), (2, 4, 5, 8)], [(0, 2, 0, 9)]]


def test_cross_example_attention_would_change_the_loss():
    """The block-diagonal mask matters: the same rows with one causal mask over the whole
    row give another loss (so the equality above is not vacuous)."""
    model = lora_model([3, 4, 5])
    batch = examples(6, seed=2)
    packed = pack_batch(batch, 64, 3).as_dict()
    want, _, _ = loss_and_grads(model, packed)
    t = packed["input_ids"].shape[1]
    packed["new_mask"] = torch.ones(t, t, dtype=torch.bool).tril().expand_as(packed["new_mask"])
    leaked, _, _ = loss_and_grads(model, packed)
    assert abs(float(leaked) - float(want)) > 1e-3


def test_first_trainable_layer_follows_lora_and_the_streams():
    assert first_trainable_layer(lora_model([4, 5])) == 3  # capped by L0 = 6 - 3
    assert first_trainable_layer(lora_model([1, 5])) == 1
    model = lora_model([4, 5])
    model.decoder.embed_tokens.weight.requires_grad_(True)
    assert first_trainable_layer(model) == 0


def test_pack_rows_first_fit_and_examples_starting_with_targets_stay_alone():
    assert pack_rows([30, 30, 10, 40, 5], 64) == [[0, 1], [2, 3, 4]]
    assert pack_rows([100, 10], 64) == [[0], [1]]
    batch = examples(3)
    batch[1]["labels_mask"][:2] = [True, True]  # a target within num_streams + 1 tokens
    packed = pack_batch(batch, 256, 3)
    assert packed.input_ids.shape[0] == 2
    lengths = sorted(int(m.sum()) for m in packed.attention_mask)
    assert lengths == sorted([len(batch[0]["input_ids"]) + len(batch[2]["input_ids"]),
                              len(batch[1]["input_ids"])])  # fmt: skip


def test_fast_training_path_logs_the_same_losses(tiny_base, tmp_path, caplog):  # noqa: F811
    """`specstream train` with packing and the frozen-prefix cache (the default) against
    padded batches recomputed every step: the same loss at every step."""
    logs = {}
    for fast in (False, True):
        out = tmp_path / f"fast-{fast}"
        # 8 steps x 2 see every training example: long enough for the cache to be built.
        args = args_for(tiny_base, out, steps=8, pack=fast, frozen_prefix=fast)
        vllm_logger = logging.getLogger("vllm")  # may not propagate once vLLM configured it
        vllm_logger.addHandler(caplog.handler)
        try:
            with caplog.at_level(logging.INFO, logger="vllm"):
                train(args, progress=False)
        finally:
            vllm_logger.removeHandler(caplog.handler)
        assert ("output for" in caplog.text) == fast  # the cache was built (fast path only)
        caplog.clear()
        assert not (out / "frozen_prefix.pt").exists()  # a finished run drops its cache
        logs[fast] = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    for slow, fast in zip(logs[False], logs[True], strict=True):
        for k in ("loss", "loss_main", "loss_stream1", "eval_loss"):
            if k in slow:
                assert fast[k] == pytest.approx(slow[k], rel=1e-4), (slow["step"], k)


def test_medusa_heads_on_cached_final_hidden_states_give_the_same_loss():
    from vllm_specstream.training.fast_batches import pad_rows
    from vllm_specstream.training.medusa import MedusaHeads

    heads = MedusaHeads(tiny_llama(layers=3), num_heads=3)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.normal_(0, 0.1)
    batch = examples(5, seed=3)
    padded = collate(batch)
    want, want_metrics = heads.loss(padded)
    cached = {**padded, "hidden": pad_rows(heads.final_hidden(batch, batch_size=2))}
    got, metrics = heads.loss(cached)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert metrics == pytest.approx(want_metrics, rel=1e-4)


def test_the_cache_file_is_reused_only_for_the_same_examples(tmp_path):
    from vllm_specstream.training.fast_batches import cache_key, load_or_compute

    batch = examples(3)
    calls = []

    def compute():
        calls.append(1)
        return [torch.full((len(e["input_ids"]), 2), float(len(calls))) for e in batch]

    path = tmp_path / "frozen_prefix.pt"
    first = load_or_compute(path, cache_key("base", 3, encoded=batch), compute)
    again = load_or_compute(path, cache_key("base", 3, encoded=batch), compute)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(first, again))
    batch[0]["input_ids"][0] += 1  # another data set: computed again
    load_or_compute(path, cache_key("base", 3, encoded=batch), compute)
    assert len(calls) == 2


def test_frozen_weights_cast_once_give_the_autocast_loss_and_gradients():
    """bf16 training stores the frozen linear weights in bf16 once instead of autocast
    casting them at every call: the same loss and gradients; a tied LM head gets its own
    copy, so the embedding stays fp32."""
    from vllm_specstream.training.device import cast_frozen_linears

    model = lora_model([3, 4, 5])
    lm = model.causal_lm
    lm.lm_head.weight = lm.model.embed_tokens.weight  # tied, as SmolLM2's
    batch = pack_batch(examples(5), 64, 3).as_dict()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, _, want_grads = loss_and_grads(model, batch)
    assert cast_frozen_linears(model, torch.bfloat16) > 0
    assert lm.model.embed_tokens.weight.dtype == torch.float32
    assert lm.lm_head.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, grads = loss_and_grads(model, batch)
    assert loss == want_loss
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)
