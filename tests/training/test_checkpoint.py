"""Adapter save/load/merge round trip, and every malformed checkpoint gets a clear error."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_llama

from vllm_specstream.checkpoint.config import ConfigError, PruneConfig, SpecStreamConfig
from vllm_specstream.training.checkpoint import (
    STREAM_FILE,
    LoraSettings,
    build_model,
    export_merged,
    load_adapter,
    load_merged,
    save_adapter,
)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    tiny_llama().save_pretrained(d)
    return d


def trained(base_dir, **cfg):
    config = SpecStreamConfig(
        num_streams=3, num_msa_layers=2, init_rank=2, prune=PruneConfig(enabled=True, rank=4), **cfg
    )
    torch.manual_seed(0)
    model = build_model(base_dir, config, LoraSettings(rank=4), stream_init_std=0.5)
    with torch.no_grad():  # pretend training moved everything away from its init
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def outputs(model, ids):
    with torch.no_grad():
        out = model(ids, anchors=torch.tensor([[2, 5, 7]]))
        return (
            model.lm_head(out.main_hidden),
            model.lm_head(out.stream_hidden),
            model.prune_logits(out.prune_input),
        )


def test_only_trainable_parameters_get_gradients(base_dir):
    model = trained(base_dir)
    model.train()
    ids = torch.randint(3, 128, (2, 10))
    from vllm_specstream.training.loss import specstream_loss

    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "labels_mask": torch.tensor([[False] * 4 + [True] * 6] * 2),
    }
    loss, metrics = specstream_loss(model, batch)
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"stream_embeddings", "init_a", "init_b", "prune_a", "prune_b"} <= trainable
    assert all(
        "lora_" in n
        for n in trainable - {"stream_embeddings", "init_a", "init_b", "prune_a", "prune_b"}
    )
    assert {"loss_stream1", "top1_stream3", "loss_prune"} <= set(metrics)


def test_save_load_merge_round_trip(base_dir, tmp_path):
    model = trained(base_dir)
    ids = torch.randint(3, 128, (1, 9))
    want = outputs(model, ids)
    save_adapter(model, tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {
        "specstream_config.json",
        "adapter_config.json",
        "adapter_model.safetensors",
        STREAM_FILE,
    } <= files
    loaded = load_adapter(tmp_path / "adapter")
    for a, b in zip(outputs(loaded, ids), want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    merged_dir = export_merged(tmp_path / "adapter", tmp_path / "merged", dtype=torch.float32)
    config = json.loads((merged_dir / "config.json").read_text())
    assert config["architectures"] == ["SpecStreamForCausalLM"]
    assert config["specstream"]["base_architectures"] == ["LlamaForCausalLM"]
    assert config["specstream"]["num_streams"] == 3
    assert set(load_file(str(merged_dir / STREAM_FILE))) == {
        "specstream.stream_embeddings",
        "specstream.init_a",
        "specstream.init_b",
        "specstream.prune_a",
        "specstream.prune_b",
    }
    merged = load_merged(merged_dir)
    for a, b in zip(outputs(merged, ids), want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # Served without streams, the merged checkpoint is the fine-tuned model.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, want[0], atol=1e-4, rtol=1e-4)


def test_suffix_drafts_default_travels_from_adapter_to_merged_config(base_dir, tmp_path):
    """The adapter's serving default reaches config.json; export's argument replaces or
    clears it; an adapter without one writes no field (older readers refuse unknown ones)."""
    save_adapter(trained(base_dir, suffix_drafts="on"), tmp_path / "adapter")
    assert SpecStreamConfig.load(tmp_path / "adapter").suffix_drafts == "on"

    def section(**kw):
        out = export_merged(tmp_path / "adapter", tmp_path / "m", dtype=torch.float32, **kw)
        return json.loads((out / "config.json").read_text())["specstream"]

    assert section()["suffix_drafts"] == "on"
    assert section(suffix_drafts=" 1.5 ")["suffix_drafts"] == "1.5"
    assert "suffix_drafts" not in section(suffix_drafts="off")
    with pytest.raises(
        ConfigError, match=r"--suffix-drafts: suffix_drafts must be 'on' \(suffix drafts where"
    ):
        section(suffix_drafts="always")
    save_adapter(trained(base_dir), tmp_path / "plain")
    assert "suffix_drafts" not in json.loads(
        (tmp_path / "plain" / "specstream_config.json").read_text()
    )


@pytest.mark.parametrize("bad", ["sometimes", "-1", 3])
def test_suffix_drafts_field_is_checked(bad):
    says = "a string or null, got 3" if bad == 3 else r"'on' \(suffix drafts where"
    with pytest.raises(ConfigError, match=rf"x.json: suffix_drafts must be {says}"):
        SpecStreamConfig.from_dict({"suffix_drafts": bad}, where="x.json")


@pytest.fixture
def merged_dir(base_dir, tmp_path):
    save_adapter(trained(base_dir), tmp_path / "adapter")
    return export_merged(tmp_path / "adapter", tmp_path / "merged", dtype=torch.float32)


def edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_streams(d, fn):
    tensors = load_file(str(d / STREAM_FILE))
    fn(tensors)
    save_file(tensors, str(d / STREAM_FILE))


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            lambda d: edit_streams(
                d, lambda t: t.update({"specstream.stream_embeddings": torch.zeros(3, 32)})
            ),
            r"stream_embeddings has shape \[3, 32\], expected \[3, 64\]",
        ),
        (
            lambda d: edit_streams(d, lambda t: t.pop("specstream.stream_embeddings")),
            r"missing stream tensor\(s\) \['stream_embeddings'\]",
        ),
        (lambda d: (d / STREAM_FILE).unlink(), "specstream.safetensors: missing"),
        (
            lambda d: edit_config(d, lambda c: c["specstream"].update(format_version=99)),
            "format_version is 99, newer than",
        ),
        (lambda d: edit_config(d, lambda c: c.pop("specstream")), "no 'specstream' section"),
        (
            lambda d: edit_config(d, lambda c: c["specstream"].update(num_streams=5)),
            r"stream_embeddings has shape \[3, 64\], expected \[5, 64\]",
        ),
        (
            lambda d: edit_config(d, lambda c: c["specstream"].update(bogus=1)),
            r"unknown field\(s\) \['bogus'\]",
        ),
        (
            lambda d: edit_config(d, lambda c: c["specstream"].pop("base_architectures")),
            "base_architectures is missing",
        ),
    ],
)
def test_malformed_merged_checkpoint(merged_dir, damage, message):
    damage(merged_dir)
    with pytest.raises(ConfigError, match=message) as err:
        load_merged(merged_dir)
    assert str(merged_dir) in str(err.value)


def test_malformed_adapter(base_dir, tmp_path):
    d = save_adapter(trained(base_dir), tmp_path / "adapter")
    cfg = json.loads((d / "specstream_config.json").read_text())
    cfg["num_msa_layers"] = 0
    (d / "specstream_config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConfigError, match=r"specstream_config.json: num_msa_layers must be an integer >= 1"
    ):
        load_adapter(d)
    (d / "specstream_config.json").unlink()
    with pytest.raises(ConfigError, match="specstream_config.json: missing"):
        load_adapter(d)


def test_unsupported_base_architecture(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=2, vocab_size=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"config.json: model_type 'gpt2' is not supported"):
        build_model(tmp_path, SpecStreamConfig(num_msa_layers=1), None)


# --- Nothing lost: export writes beside its target and replaces only an earlier export ---


@pytest.fixture
def adapter(base_dir, tmp_path):
    return save_adapter(trained(base_dir), tmp_path / "adapter")


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("where", ["user_dir", "adapter", "file", "holds_adapter"])
def test_export_refuses_a_target_it_would_destroy(adapter, tmp_path, where):
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    (tmp_path / "a-file").write_text("keep me too")
    out = {
        "user_dir": user_dir,
        "adapter": adapter,
        "file": tmp_path / "a-file",
        "holds_adapter": tmp_path,
    }[where]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    message = {
        "user_dir": "holds 'notes.txt' and is not an earlier specstream export; nothing was",
        "adapter": "which export reads",
        "file": "is a file, not a directory",
        "holds_adapter": "which export reads",
    }[where]
    with pytest.raises(ConfigError, match=message) as e:
        export_merged(adapter, out, dtype=torch.float32)
    assert str(e.value).startswith(f"{out}: ")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_export_replaces_an_earlier_export_but_not_a_file_added_to_it(adapter, tmp_path):
    out = tmp_path / "merged"
    export_merged(adapter, out, dtype=torch.float32)
    first = listing(out)
    assert "specstream.safetensors" in first and "config.json" in first
    export_merged(adapter, out, dtype=torch.float32)  # an earlier export: replaced
    assert listing(out) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged"]  # nothing beside
    (out / "README.md").write_text("my model card")
    with pytest.raises(ConfigError, match="it also holds 'README.md', which export does not"):
        export_merged(adapter, out, dtype=torch.float32)
    assert (out / "README.md").read_text() == "my model card"


def test_a_failed_export_leaves_the_earlier_one_whole(adapter, tmp_path, monkeypatch):
    import vllm_specstream.training.checkpoint as checkpoint

    out = tmp_path / "merged"
    export_merged(adapter, out, dtype=torch.float32)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_merged(adapter, out, dtype=torch.float32)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged"]


def test_a_failed_adapter_save_leaves_the_earlier_files(base_dir, adapter, monkeypatch):
    import vllm_specstream.training.checkpoint as checkpoint

    (adapter / "train_log.jsonl").write_text("{}\n")  # a run's record beside the files
    before = {p.name: p.read_bytes() for p in adapter.iterdir()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_adapter(trained(base_dir, suffix_drafts="on"), adapter)
    assert {p.name: p.read_bytes() for p in adapter.iterdir()} == before
    assert sorted(p.name for p in adapter.parent.iterdir()) == ["adapter"]
