"""EAGLE-3 drafters: the unroll's mask, the draft vocabulary maps, training and its checkpoint."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_train import args_for, tiny_base  # noqa: F401 (fixture)
from tiny import tiny_llama

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.training.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    answer_token_counts,
    d2t_t2d,
    default_aux_layer_ids,
    draft_vocab_ids,
    target_ids_of,
    ttt_attention_mask,
)
from vllm_specstream.training.train import train


def test_the_unroll_mask_sees_the_prefix_then_only_its_own_chain():
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    first = ttt_attention_mask(valid, 0)
    assert first.shape == (2, 4, 4)
    assert torch.equal(first[0], torch.ones(4, 4, dtype=torch.bool).tril())
    # A padding key is seen by no one but itself.
    assert first[1, :, 3].tolist() == [False, False, False, True]
    mask = ttt_attention_mask(valid, 2)
    assert mask.shape == (2, 4, 12)
    assert torch.equal(mask[:, :, :4], first)
    for step in (1, 2):
        later = mask[0, :, 4 * step : 4 * (step + 1)]
        assert torch.equal(later, torch.eye(4, dtype=torch.bool))  # the diagonal alone


def test_draft_vocab_is_the_most_frequent_answer_tokens_sorted_by_id():
    encoded = [
        {
            "input_ids": [9, 9, 9, 5, 5, 7, 3],
            "labels_mask": [False, True, True, True, True, True, True],
        },
        {"input_ids": [7, 3, 3], "labels_mask": [True, True, True]},
    ]
    counts = answer_token_counts(encoded)
    assert counts == {3: 3, 9: 2, 5: 2, 7: 2}  # the prompt's 9 is not counted
    assert draft_vocab_ids(counts, 16, 3).tolist() == [3, 5, 7]  # 9 loses the tie to 5 and 7
    # Too few distinct tokens: filled up with the lowest unused ids.
    assert draft_vocab_ids(counts, 16, 6).tolist() == [0, 1, 3, 5, 7, 9]
    with pytest.raises(ConfigError, match="draft_vocab_size 17: must be in 1..16"):
        draft_vocab_ids(counts, 16, 17)


def test_d2t_maps_draft_ids_to_target_ids_as_vllm_does():
    ids = torch.tensor([0, 4, 5, 11])
    d2t, t2d = d2t_t2d(ids, 12)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [0, 3, 3, 8]
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    assert target_ids_of(d2t).tolist() == ids.tolist()
    # vLLM's compute_logits: draft logits scattered to ``arange + d2t``, -inf elsewhere.
    logits = torch.tensor([[0.5, 2.0, -1.0, 3.0]])
    full = logits.new_full((1, 12), float("-inf"))
    full[:, torch.arange(4) + d2t] = logits
    assert int(full.argmax()) == 11 and torch.isinf(full[0, ~t2d]).all()


def test_default_aux_layers_are_vllms():
    assert default_aux_layer_ids(30) == (2, 15, 27)  # SmolLM2-135M
    assert default_aux_layer_ids(4) == (1, 2)
    assert Eagle3Config().resolved_aux_layer_ids(30) == (2, 15, 27)
    assert Eagle3Config(aux_layer_ids=(27, 2, 15)).resolved_aux_layer_ids(30) == (2, 15, 27)
    with pytest.raises(ConfigError, match=r"0 <= id < 30"):
        Eagle3Config(aux_layer_ids=(2, 30)).resolved_aux_layer_ids(30)


def _drafter(seed: int = 0, **settings) -> Eagle3Drafter:
    lm = tiny_llama(layers=4, vocab=128, seed=seed)
    config = Eagle3Config(draft_vocab_size=48, **settings)
    drafter = Eagle3Drafter(lm, config, torch.arange(0, 96, 2))
    with torch.no_grad():  # norms away from 1, so that a misplaced norm shows
        for p in drafter.trainable().values():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize(
    "settings", [{}, {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}]
)
@torch.no_grad()
def test_the_unroll_is_what_drafting_one_token_at_a_time_computes(settings):
    """Step ``k`` at slot ``j`` of the training unroll equals vLLM's way of drafting: the
    prefix ``0..j`` run once (its keys cached), then one token at a time at positions
    ``j+1, j+2, ...``, each seeing the prefix's keys and its own chain's."""
    drafter = _drafter(**settings).eval()
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (1, 12))
    valid = torch.ones_like(ids, dtype=torch.bool)
    aux = drafter.target_features(ids, valid)[..., : drafter.fc.in_features]
    unrolled = drafter.unroll(aux, ids, valid)
    layer, embed = drafter.midlayer, drafter.lm.get_input_embeddings()

    def step(token_ids, hidden, positions, cache, mask):
        rope = drafter.rotary(hidden, positions[None])
        out = layer(embed(token_ids), hidden, rope, cache, mask)
        normed = drafter.norm(out)
        return drafter.lm_head(normed), normed if settings else out

    for j in (0, 4, 8):
        h = aux[:, : j + 1]
        h = drafter.fc(drafter.input_norm(h) if settings else h)
        cache: list = []
        causal = torch.ones(1, j + 1, j + 1, dtype=torch.bool).tril()
        logits, hidden = step(ids[:, 1 : j + 2], h, torch.arange(j + 1), cache, causal)
        torch.testing.assert_close(logits[:, j], unrolled[0][:, j])
        hidden = hidden[:, j : j + 1]
        for k in (1, 2):
            see = torch.ones(1, 1, j + 1 + k, dtype=torch.bool)
            token = ids[:, j + 1 + k : j + 2 + k]
            logits, hidden = step(token, hidden, torch.tensor([j + k]), cache, see)
            torch.testing.assert_close(logits[:, 0], unrolled[k][:, j], rtol=1e-4, atol=1e-5)


def test_training_reduces_the_loss_on_a_tiny_model():
    drafter = _drafter()
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (4, 20))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 15:] = False
    labels = valid.clone()
    labels[:, :6] = False  # the prompt
    batch = {"input_ids": ids, "attention_mask": valid, "labels_mask": labels}
    optimizer = torch.optim.AdamW(list(drafter.trainable().values()), lr=3e-3)
    losses = []
    for _ in range(12):
        loss, metrics = drafter.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(metrics["loss"])
    assert {"loss_step1", "loss_step3", "top1_step1", "top1_step3"} <= set(metrics)
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(not p.requires_grad for p in drafter.lm.parameters())


#: What vLLM 0.32's ``llama_eagle3.py`` builds for a Llama drafter of one layer, by its own
#: names (``Eagle3LlamaForCausalLM``: ``model.*`` and ``lm_head``), and the checkpoint names
#: that its ``load_weights`` maps onto each: ``midlayer.`` -> ``layers.0.``, q/k/v stacked
#: into ``qkv_proj``, gate/up into ``gate_up_proj``, ``d2t`` -> ``draft_id_to_target_id``,
#: ``t2d`` skipped, ``embed_tokens`` optional (shared with the target when absent),
#: ``input_norm`` only with ``norm_before_fc``.
VLLM_PARAMS = {
    "model.fc.weight": (["fc.weight"], lambda h, i, q, kv, n, dv, v: (h, n * h)),
    "model.layers.0.self_attn.qkv_proj.weight": (
        [f"midlayer.self_attn.{x}_proj.weight" for x in "qkv"],
        lambda h, i, q, kv, n, dv, v: (q + 2 * kv, 2 * h),
    ),
    "model.layers.0.self_attn.o_proj.weight": (
        ["midlayer.self_attn.o_proj.weight"],
        lambda h, i, q, kv, n, dv, v: (h, q),
    ),
    "model.layers.0.mlp.gate_up_proj.weight": (
        ["midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"],
        lambda h, i, q, kv, n, dv, v: (2 * i, h),
    ),
    "model.layers.0.mlp.down_proj.weight": (
        ["midlayer.mlp.down_proj.weight"],
        lambda h, i, q, kv, n, dv, v: (h, i),
    ),
    **{
        f"model.layers.0.{norm}.weight": ([f"midlayer.{norm}.weight"], lambda *a: (a[0],))
        for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm")
    },
    "model.norm.weight": (["norm.weight"], lambda *a: (a[0],)),
    "lm_head.weight": (["lm_head.weight"], lambda h, i, q, kv, n, dv, v: (dv, h)),
    "draft_id_to_target_id": (["d2t"], lambda h, i, q, kv, n, dv, v: (dv,)),
}


def check_vllm_names_and_shapes(tensors: dict, config: dict, target_config: dict) -> None:
    """``tensors`` (a drafter's ``model.safetensors``) fill every parameter vLLM's
    ``Eagle3LlamaForCausalLM`` builds from ``config`` (a plain Llama target of
    ``target_config``), each with the shape that parameter's part has, and nothing else."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    n = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    dv, v = config["draft_vocab_size"], target_config["vocab_size"]
    dims = (h, i, q, kv, n, dv, v)
    expected: dict[str, tuple] = {}
    for vllm_name, (names, shape) in VLLM_PARAMS.items():
        whole = shape(*dims)
        if len(names) == 1:
            expected[names[0]] = whole
        elif vllm_name.endswith("qkv_proj.weight"):
            expected.update(zip(names, [(q, whole[1]), (kv, whole[1]), (kv, whole[1])]))
        else:  # gate_up: two halves
            expected.update((name, (whole[0] // 2, whole[1])) for name in names)
    expected["t2d"] = (v,)
    if config.get("norm_before_fc"):
        expected["input_norm.weight"] = (n * h,)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == dv
    assert config["target_hidden_size"] == target_config["hidden_size"]


def test_saved_drafter_has_vllms_names_shapes_and_flags(tmp_path):
    drafter = _drafter(norm_before_fc=True)
    out = drafter.save(tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 2],
        "use_aux_hidden_state": True,
    }
    for flag in ("norm_before_residual", "fc_norm", "norm_output"):
        assert config[flag] is False  # written, not left to vLLM's defaults
    assert config["norm_before_fc"] is True
    tensors = load_file(str(out / "model.safetensors"))
    check_vllm_names_and_shapes(tensors, config, drafter.lm.config.to_dict())
    assert target_ids_of(tensors["d2t"]).tolist() == list(range(0, 96, 2))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    # Loaded back (resume, --init-from): the same weights and vocabulary.
    other = _drafter(seed=1, norm_before_fc=True)
    other.draft_ids.copy_(torch.arange(48))
    other.load_trainable(out)
    assert torch.equal(other.draft_ids, drafter.draft_ids)
    for name, p in drafter.trainable().items():
        assert torch.equal(other.trainable()[name], p)


@pytest.mark.model
def test_eagle3_objective_trains_saves_and_resumes(tiny_base, tmp_path):  # noqa: F811
    """``specstream train --objective eagle3`` through the shared loop: the drafter's
    checkpoint in OUT (vLLM's names and shapes), the per-step losses in the log, resume."""
    base = tiny_base
    args = args_for(base, tmp_path / "eagle3", steps=2, lr=1e-3)
    args.objective = "eagle3"
    args.eagle3 = Eagle3Config(draft_vocab_size=256, ttt_steps=2)
    out = train(args, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # 3 layers
    tensors = load_file(str(out / "model.safetensors"))
    check_vllm_names_and_shapes(tensors, config, json.loads((base / "config.json").read_text()))
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert {"loss_step1", "loss_step2", "top1_step2", "eval_loss"} <= set(log[-1])
    args.steps = 3  # resumes from OUT/checkpoint
    assert train(args, progress=False) == out
    assert [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]
    again = args_for(base, tmp_path / "again", steps=1, init_from=str(out))
    again.objective, again.eagle3 = "eagle3", Eagle3Config(draft_vocab_size=128)
    with pytest.raises(ConfigError, match="draft_vocab_size is 256, this run's 128"):
        train(again, progress=False)


def test_cached_target_states_give_the_same_loss():
    """The target's states computed once per example (the frozen-base cache of the training
    loop) give the loss computed from the target at every step."""
    from vllm_specstream.training.batches import collate
    from vllm_specstream.training.fast_batches import pad_rows

    drafter = _drafter().eval()
    torch.manual_seed(2)
    encoded = [
        {
            "input_ids": torch.randint(3, 128, (n,)).tolist(),
            "labels_mask": [False] * 4 + [True] * (n - 4),
        }
        for n in (9, 14, 11)
    ]
    batch = collate(encoded)
    with torch.no_grad():
        fresh, _ = drafter.loss(batch)
        rows = drafter.final_hidden(encoded, batch_size=2)
        assert [r.shape for r in rows] == [(n, drafter.feature_width) for n in (9, 14, 11)]
        cached, _ = drafter.loss({**batch, "hidden": pad_rows(rows)})
    torch.testing.assert_close(cached, fresh)
