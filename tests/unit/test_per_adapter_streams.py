"""Per-adapter streams: reading an adapter's stream tensors, and each request's streams
from its LoRA slot."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from vllm_specstream.checkpoint.config import ConfigError, SpecStreamConfig
from vllm_specstream.checkpoint.deployment import (
    base_deployment_overrides,
    lora_rank_setting,
    plan_deployment,
)
from vllm_specstream.model_executor.lora.per_adapter_streams import (
    ATTRIBUTE,
    Deployment,
    group_requests,
    read_adapter_streams,
    request_streams,
)

H = 16
DEPLOYMENT = Deployment(
    num_msa_layers=2, hidden_size=H, num_hidden_layers=4, num_speculative_tokens=3
)


def write_adapter(path, num_streams=3, num_msa_layers=2, hidden=H, rank=8, drop=None):
    path.mkdir(parents=True)
    config = SpecStreamConfig(num_streams=num_streams, num_msa_layers=num_msa_layers, init_rank=4)
    config.save(path)
    tensors = {
        name: torch.randn(shape) for name, shape in config.stream_tensor_shapes(hidden).items()
    }
    tensors.pop(drop, None)
    save_file(tensors, str(path / "specstream.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": rank}))
    return path


def test_reads_an_adapters_streams(tmp_path):
    streams = read_adapter_streams(write_adapter(tmp_path / "sql"), "sql", DEPLOYMENT)
    assert streams.name == "sql" and streams.config.num_streams == 3
    assert streams.stream_embeddings.shape == (3, H) and streams.init_a.shape == (4, H)


def test_a_plain_lora_adapter_has_no_streams(tmp_path):
    (tmp_path / "plain").mkdir()
    assert read_adapter_streams(tmp_path / "plain", "plain", DEPLOYMENT) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_msa_layers": 3}, r"'bad'.*num_msa_layers=3.*last 2 layers"),
        ({"num_streams": 2}, r"'bad'.*num_streams=2, fewer than.*num_speculative_tokens=3"),
        ({"hidden": H * 2}, r"'bad'.*stream_embeddings has shape \[3, 32\].*hidden size is 16"),
        ({"drop": "init_b"}, r"'bad'.*missing stream tensor\(s\) \['init_b'\]"),
    ],
)
def test_adapters_that_do_not_fit_the_deployment_are_named(tmp_path, kwargs, match):
    path = write_adapter(tmp_path / "bad", **kwargs)
    with pytest.raises(ConfigError, match=match):
        read_adapter_streams(path, "bad", DEPLOYMENT)


def write_streams_only_adapter(path, lora_rank=2):
    """A streams-only adapter of a 4-layer model (hidden H, 4 heads, 2 key/value heads)."""
    path.mkdir(parents=True)
    config = SpecStreamConfig(num_streams=3, num_msa_layers=2, stream_lora_rank=lora_rank)
    config.save(path)
    shapes = config.stream_tensor_shapes(H, HF_CONFIG)
    save_file(
        {n: torch.randn(shape) for n, shape in shapes.items()}, str(path / "specstream.safetensors")
    )
    return path


HF_CONFIG = {
    "hidden_size": H,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "num_hidden_layers": 4,
}


def test_a_streams_only_adapter_brings_its_stream_lora(tmp_path):
    path = write_streams_only_adapter(tmp_path / "so")
    deployment = dataclasses.replace(DEPLOYMENT, hf_config=HF_CONFIG)
    streams = read_adapter_streams(path, "so", deployment)
    assert streams.stream_lora is not None and len(streams.stream_lora.layers) == 2
    a, b = streams.stream_lora.layers[1]["gate_up"]
    assert a.shape == (2, H) and b.shape == (2 * 24, 2)
    x = torch.randn(5, H)
    assert torch.allclose(streams.stream_lora.delta(1, "gate_up", x), x @ a.T @ b.T, atol=1e-6)
    assert (
        read_adapter_streams(write_adapter(tmp_path / "plain"), "p", deployment).stream_lora is None
    )
    # Under tensor parallelism it loads the same (each rank splits it when it first drafts).
    assert read_adapter_streams(path, "so", dataclasses.replace(deployment, tp_size=2)).stream_lora


def _manager(slot_ids: list, adapters: dict):
    objects = {i: SimpleNamespace(**{ATTRIBUTE: s}) for i, s in adapters.items()}
    return SimpleNamespace(
        lora_index_to_id=slot_ids, _registered_adapters=SimpleNamespace(cache=objects)
    )


def test_each_request_gets_its_slots_adapter_streams():
    sql, e2e, own = object(), object(), object()
    manager = _manager([5, None, 9], {5: sql, 9: e2e})
    # slot 0 -> adapter 5, slot 2 -> adapter 9, -1 -> the checkpoint's own, 1 -> a free slot
    assert request_streams(manager, [2, -1, 0, 1, 2], own) == [e2e, own, sql, None, e2e]
    assert request_streams(manager, [-1], None) == [None]
    # a plain LoRA adapter drafts with the checkpoint's streams (none on a base deployment)
    assert request_streams(_manager([3], {3: None}), [0, 0], own) == [own, own]
    assert request_streams(_manager([3], {3: None}), [0], None) == [None]


def test_requests_are_grouped_by_their_streams():
    a, b = object(), object()
    assert group_requests([a, None, b, a]) == [(a, [0, 3]), (b, [2])]
    assert group_requests([None]) == []


def test_deployment_plan_checks_the_adapters(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4})
    )
    sql = write_adapter(tmp_path / "sql", num_streams=4, rank=32)
    e2e = write_adapter(tmp_path / "e2e", num_streams=3, rank=4)
    plan = plan_deployment(base, {"sql": sql, "e2e": e2e})
    assert (plan.num_msa_layers, plan.num_streams, plan.max_lora_rank) == (2, 3, 32)
    section = plan.overrides()["specstream"]
    assert section["adapter_streams_only"] is True and section["num_streams"] == 3
    command = plan.serve_command()
    assert "--lora-modules" in command and f"sql={sql}" in command and "--spec-tokens 3" in command
    other = write_adapter(tmp_path / "other", num_msa_layers=3)
    with pytest.raises(ConfigError, match=r"num_msa_layers=2: \['sql'\]; num_msa_layers=3"):
        plan_deployment(base, {"sql": sql, "other": other})
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="'plain'.*not a specstream adapter"):
        plan_deployment(base, {"plain": tmp_path / "plain"})
    with pytest.raises(ConfigError, match="num_msa_layers"):
        base_deployment_overrides(base, num_msa_layers=9, num_streams=3)


def test_lora_rank_setting_is_one_vllm_accepts():
    assert [lora_rank_setting(r) for r in (1, 4, 8, 9, 32, 33)] == [1, 8, 8, 16, 32, 64]
    with pytest.raises(ConfigError):
        lora_rank_setting(1000)
