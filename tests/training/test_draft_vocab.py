"""The draft vocabulary: how it is chosen, stored, checked and drafted from."""

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_llama

from vllm_specstream.checkpoint.config import ConfigError, SpecStreamConfig
from vllm_specstream.checkpoint.draft_vocab import draft_vocab_ids, draft_vocab_mask, mask_token_ids
from vllm_specstream.training.checkpoint import (
    STREAM_FILE,
    LoraSettings,
    build_model,
    export_merged,
    load_adapter,
    load_merged,
    save_adapter,
)
from vllm_specstream.training.draft_vocab import add_draft_vocab, write_draft_vocab
from vllm_specstream.training.model import SpecStreamModel
from vllm_specstream.training.reference_decoder import plain_greedy, speculative_generate


def test_ids_rank_replies_then_prompts_then_low_ids():
    replies = Counter({50: 3, 40: 3, 60: 1})
    prompts = Counter({70: 9, 50: 5})
    # Always first, replies by count (ties: lower id), prompts, then the lowest ids.
    assert draft_vocab_ids(replies, prompts, 100, 6, always=[99]) == sorted([99, 40, 50, 60, 70, 0])
    assert draft_vocab_ids(replies, prompts, 100, 2, always=[99]) == [40, 99]
    assert draft_vocab_ids(Counter({500: 1}), Counter(), 100, 2) == [0, 1]  # out of range
    with pytest.raises(ValueError, match="size must be in"):
        draft_vocab_ids(replies, prompts, 100, 0)


def test_mask_round_trip_and_checks():
    mask = draft_vocab_mask([3, 1, 7], 10)
    assert mask.tolist() == [0, 1, 0, 1, 0, 0, 0, 1, 0, 0]
    assert mask_token_ids(mask, 3, "here").tolist() == [1, 3, 7]
    with pytest.raises(ConfigError, match="here: draft_vocab_mask marks 3 tokens but"):
        mask_token_ids(mask, 4, "here")
    with pytest.raises(ConfigError, match="only 0 and 1"):
        mask_token_ids(mask * 0.5, 3, "here")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    tiny_llama().save_pretrained(d)
    return d


def _adapter(base_dir, out):
    torch.manual_seed(0)
    model = build_model(
        base_dir, SpecStreamConfig(num_streams=3, num_msa_layers=2), LoraSettings(rank=4)
    )
    with torch.no_grad():
        model.stream_embeddings.normal_(0, 1.0)
    return save_adapter(model, out)


def test_streams_draft_only_from_the_vocabulary_and_outputs_do_not_change(base_dir, tmp_path):
    adapter = _adapter(base_dir, tmp_path / "adapter")
    plain_model = load_adapter(adapter)
    keep = list(range(0, 128, 3))
    write_draft_vocab(adapter, keep, 128)
    assert SpecStreamConfig.load(adapter).draft_vocab_size == len(keep)
    merged = export_merged(adapter, tmp_path / "merged", dtype=torch.float32)
    assert "specstream.draft_vocab_mask" in load_file(str(merged / STREAM_FILE))
    assert json.loads((merged / "config.json").read_text())["specstream"]["draft_vocab_size"] == 43
    for model in (load_adapter(adapter), load_merged(merged)):
        assert not model.draft_vocab_mask.requires_grad  # data, never trained
        with torch.no_grad():
            out = model(torch.tensor([[5, 9, 17, 33, 4]]), anchors=torch.tensor([[1, 2, 3, 4]]))
            drafts = model.stream_logits(out.stream_hidden).argmax(-1)
            whole = model.lm_head(out.stream_hidden).argmax(-1)
        assert set(drafts.flatten().tolist()) <= set(keep)
        assert (drafts != whole).any()  # the vocabulary mattered here
    prompt = [5, 9, 17, 33, 4, 8]
    want = plain_greedy(plain_model, prompt, 24, None)
    restricted = load_merged(merged)
    assert speculative_generate(restricted, prompt, 24).tokens == want
    assert speculative_generate(restricted, prompt, 24, top_k=2).tokens == want


def test_a_model_without_a_vocabulary_drafts_from_all_tokens(base_dir, tmp_path):
    model = load_adapter(_adapter(base_dir, tmp_path / "adapter"))
    assert model.draft_vocab_mask is None
    hidden = torch.randn(2, 64)
    torch.testing.assert_close(model.stream_logits(hidden), model.lm_head(hidden))


def test_a_mask_that_disagrees_with_the_config_is_refused(base_dir, tmp_path):
    adapter = _adapter(base_dir, tmp_path / "adapter")
    write_draft_vocab(adapter, [1, 2, 3], 128)
    config = json.loads((adapter / "specstream_config.json").read_text())
    config["draft_vocab_size"] = 0
    (adapter / "specstream_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unexpected tensor.*draft_vocab_mask"):
        load_adapter(adapter)


def test_add_draft_vocab_from_a_task_file(base_model_dir, tmp_path):
    """From the training split of an E2E file: every token of its replies is in, and the
    end-of-turn token."""
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import end_of_turn_id

    rows = ["mr,ref"] + [
        f'"name[Place {i}], food[Thai]","Place {i} serves Thai food."' for i in range(12)
    ]
    rows.append('"name[Zyzzyva], food[Quokka]","Zyzzyva serves quokka."')
    data = tmp_path / "e2e.csv"
    data.write_text("\n".join(rows) + "\n")
    tok = AutoTokenizer.from_pretrained(base_model_dir)
    model = SpecStreamModel(
        tiny_llama(vocab=len(tok)), SpecStreamConfig(num_streams=2, num_msa_layers=2)
    )
    model.lm.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    adapter = save_adapter(model, tmp_path / "adapter")
    summary = add_draft_vocab(
        adapter, "e2e", data, size=64, val_fraction=0.1, base=tmp_path / "base"
    )
    assert summary.size == 64 and summary.reply_coverage == 1.0
    ids = set(
        mask_token_ids(load_file(str(adapter / STREAM_FILE))["draft_vocab_mask"], 64, "x").tolist()
    )
    thai = tok(" serves Thai food.", add_special_tokens=False)["input_ids"]
    assert end_of_turn_id(tok) in ids and set(thai) <= ids
