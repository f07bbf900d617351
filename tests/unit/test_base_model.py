"""The embedded model's converted cache: structure checks, corruption detection, repair."""

import json
import shutil

import pytest

from vllm_specstream import base_model as bm
from vllm_specstream.base_model import (
    MANIFEST,
    expected_llama_tensors,
    prepare_base,
    read_safetensors_shapes,
    verify_base_model,
)

pytestmark = pytest.mark.model


def test_prepared_model_is_verified_llama(base_model_dir):
    assert verify_base_model(base_model_dir) == []
    config = json.loads((base_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    shapes = read_safetensors_shapes(sorted(base_model_dir.glob("*.safetensors")))
    assert shapes == expected_llama_tensors(config)
    assert (base_model_dir / "chat_template.jinja").read_text().count("<|im_start|>") >= 2


def test_special_tokens_follow_the_gguf(base_model_dir):
    """The converted tokenizer's bos/eos/pad are the GGUF's, whatever a Transformers release
    reads from it (one read SmolLM2's eos as <|im_start|>)."""
    from transformers import PreTrainedTokenizerFast

    ids = bm.gguf_special_ids(bm.find_gguf())
    assert ids == {"bos": 1, "eos": 2, "pad": 2}
    tok = PreTrainedTokenizerFast.from_pretrained(base_model_dir)
    assert bm.match_special_tokens(tok, ids) == []
    tok.eos_token = "<|im_start|>"
    assert bm.match_special_tokens(tok, ids) == [
        "eos token '<|im_start|>' (id 1) -> '<|im_end|>' (id 2)"
    ]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2


def test_tokenizer_and_chat_template(base_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2


@pytest.fixture
def cache_copy(base_model_dir, tmp_path):
    dst = bm.base_model_dir(tmp_path)
    shutil.copytree(base_model_dir, dst)
    return tmp_path, dst


@pytest.mark.parametrize(
    "damage",
    ["truncate_weights", "flip_byte", "no_manifest", "no_tokenizer", "bad_config"],
)
def test_damage_is_detected(cache_copy, damage):
    _, d = cache_copy
    weights = d / "model.safetensors"
    if damage == "truncate_weights":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif damage == "flip_byte":
        with open(weights, "r+b") as f:
            f.seek(weights.stat().st_size - 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    elif damage == "no_manifest":
        (d / MANIFEST).unlink()
    elif damage == "no_tokenizer":
        (d / "tokenizer.json").unlink()
    elif damage == "bad_config":
        cfg = json.loads((d / "config.json").read_text())
        cfg["hidden_size"] = 512
        (d / "config.json").write_text(json.dumps(cfg))
    problems = verify_base_model(d)
    assert problems, damage
    assert str(d) in str(problems[0])


def test_broken_cache_is_rebuilt(cache_copy):
    home, d = cache_copy
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    leftover = d.with_name(f".{d.name}.0123456789ab.partial")  # of an interrupted conversion
    leftover.mkdir()
    assert prepare_base(home=home, progress=False) == d
    assert verify_base_model(d) == []
    assert sorted(p.name for p in d.parent.iterdir()) == [d.name]
