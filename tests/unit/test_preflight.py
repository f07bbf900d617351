"""The front-end checks of a specstream setup: checkpoint headers, speculative config,
platform (no engine; the hook into vLLM is tested in tests/vllm/test_patches.py)."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from vllm_specstream import PROPOSER
from vllm_specstream.checkpoint.config import ConfigError, SpecStreamConfig
from vllm_specstream.patches.engine_config_check import check_settings, last_rank_start_of
from vllm_specstream.speculation.preflight import check_platform, check_setup

HIDDEN = 8
CPU = SimpleNamespace(is_cpu=lambda: True, device_name="cpu")
CUDA = SimpleNamespace(is_cpu=lambda: False, device_name="cuda")


def make_checkpoint(tmp_path: Path, streams_shape=(3, HIDDEN), **section) -> Path:
    """A merged checkpoint's config.json and specstream.safetensors (no model weights:
    the checks read headers only)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    spec = {
        **SpecStreamConfig(num_streams=3, num_msa_layers=2).to_dict(),
        "base_architectures": ["LlamaForCausalLM"],
        **section,
    }
    spec.pop("loss")
    config = {
        "architectures": ["SpecStreamForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "specstream": spec,
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    if streams_shape is not None:
        embeddings = np.zeros(streams_shape, dtype=np.float32)
        save_file(
            {"specstream.stream_embeddings": embeddings}, str(ckpt / "specstream.safetensors")
        )
    return ckpt


def check(
    ckpt: Path,
    k: int | None = 2,
    platform=CPU,
    method="custom_class",
    model=PROPOSER,
    lora=False,
    tp=1,
    pp=1,
    **fields,
):
    """``check_setup`` of ``ckpt`` served with ``k`` drafts, with the engine's settings as
    the front-end reads them from ``additional_config["specstream"]`` = ``fields``."""
    config = json.loads((ckpt / "config.json").read_text())
    settings = None
    if fields:
        vllm_config = engine_config(ckpt, num_speculative_tokens=k, **fields)
        vllm_config.speculative_config.method = method
        vllm_config.speculative_config.model = model
        settings = check_settings(vllm_config, environ={})
    check_setup(
        model=str(ckpt),
        hf_config=SimpleNamespace(**config),
        spec_method=method if k else None,
        spec_model=model if k else None,
        num_speculative_tokens=k,
        platform=platform,
        lora_enabled=lora,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        last_rank_start=last_rank_start_of(SimpleNamespace(**config), pp),
        settings=settings,
    )


def test_a_good_setup_passes(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    check(ckpt, k=3)
    check(ckpt, k=None)  # served as a plain model


@pytest.mark.parametrize(
    ("change", "k", "message"),
    [
        (
            {"streams_shape": None},
            2,
            r"ckpt/specstream.safetensors: missing stream tensor\(s\) "
            r"\['specstream.stream_embeddings'\] \(the file does not exist\).*specstream export",
        ),
        (
            {},
            5,
            r"num_speculative_tokens=5 exceeds the checkpoint's num_streams=3 .*--spec-tokens 3",
        ),
        (
            {"format_version": 99},
            2,
            r"ckpt/config.json \(specstream\): format_version is 99.*upgrade vllm-specstream",
        ),
        (
            {"suffix_drafts": "always"},
            2,
            r"ckpt/config.json \(specstream\): suffix_drafts must be 'on' \(suffix drafts "
            r"where .*, a score threshold >= 0, or 'off', got 'always'",
        ),
        (
            {"streams_shape": (3, HIDDEN // 2)},
            2,
            r"specstream.safetensors: tensor specstream.stream_embeddings has shape \[3, 4\], "
            r"expected \[3, 8\] .*hidden_size=8",
        ),
    ],
)
def test_broken_checkpoint_names_file_field_and_fix(tmp_path, change, k, message):
    shape = change.pop("streams_shape", (3, HIDDEN))
    with pytest.raises(ConfigError, match=message):
        check(make_checkpoint(tmp_path, streams_shape=shape, **change), k=k)


def test_broken_checkpoint_fails_without_speculation_too(tmp_path):
    """Served as a plain model the model class still needs a readable section and its
    stream tensors, so the front-end says so too."""
    with pytest.raises(ConfigError, match="format_version is 99"):
        check(make_checkpoint(tmp_path, format_version=99), k=None)


def test_plain_model_under_the_proposer(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    del config["specstream"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="needs a SpecStreamForCausalLM checkpoint.*without"):
        check(ckpt)
    check(ckpt, k=None)  # plain serving of a plain model: not our business
    check(ckpt, method="ngram", model=None)  # another speculative method: neither


def test_stream_file_left_out_of_the_index(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(ckpt / "model-00001.safetensors"))
    index = {"weight_map": {"w": "model-00001.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="not listed in .*model.safetensors.index.json"):
        check(ckpt)
    index["weight_map"]["specstream.stream_embeddings"] = "specstream.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    check(ckpt)


def test_speculation_is_refused_off_cpu(tmp_path):
    with pytest.raises(ConfigError) as e:
        check_platform(CUDA)
    assert str(e.value) == (
        "vllm-specstream's stream pass runs on vLLM's CPU backend only (verified on vLLM 0.32 "
        "CPU); platform cuda is not supported yet: serve without --spec-model (LLM(...) "
        "without speculative_config) to run the checkpoint as a plain model"
    )
    ckpt = make_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="platform cuda is not supported yet"):
        check(ckpt, platform=CUDA)
    check(ckpt, k=None, platform=CUDA)  # plain serving is not refused
    check_platform(CPU)


def engine_config(ckpt: Path, num_speculative_tokens=2, **fields) -> SimpleNamespace:
    """What the front-end hook reads of vLLM's engine config: ``ckpt`` speculating
    ``num_speculative_tokens`` drafts with the specstream proposer, the plugin's ``fields``
    in ``additional_config``."""
    config = json.loads((ckpt / "config.json").read_text())
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(ckpt), hf_config=SimpleNamespace(**config)),
        speculative_config=SimpleNamespace(
            method="custom_class",
            model=PROPOSER,
            num_speculative_tokens=num_speculative_tokens,
            num_speculative_tokens_per_batch_size=None,
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        load_config=SimpleNamespace(load_format="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, world_size=1),
        additional_config={"specstream": fields},
    )


@pytest.fixture
def hook():
    """vLLM's front-end hook; the worker threads' binding it may set in this process's
    environment is put back after the test."""
    pytest.importorskip("vllm")
    import os

    from vllm_specstream.patches.cpu_env import ENV_OMP_BIND
    from vllm_specstream.patches.engine_config_check import check_vllm_config

    saved = os.environ.get(ENV_OMP_BIND)
    yield check_vllm_config
    if saved is None:
        os.environ.pop(ENV_OMP_BIND, None)
    else:
        os.environ[ENV_OMP_BIND] = saved


def test_the_vllm_hook_reads_the_current_platform(tmp_path, monkeypatch, hook):
    """The front-end hook passes vLLM's ``current_platform``: a CUDA platform (patched in)
    is refused before any engine starts."""
    import vllm.platforms

    check_vllm_config = hook
    vllm_config = engine_config(make_checkpoint(tmp_path))
    monkeypatch.setattr(vllm.platforms, "_current_platform", CUDA)
    with pytest.raises(ConfigError, match="platform cuda is not supported yet"):
        check_vllm_config(vllm_config)
    monkeypatch.setattr(vllm.platforms, "_current_platform", CPU)
    check_vllm_config(vllm_config)


@pytest.mark.parametrize(
    "fields, schedule, message",
    [
        ({"stream_dtype": "fp8"}, None, "['stream_dtype']='fp8': expected one of"),
        ({"draft_min_prob": 2}, None, "['draft_min_prob']=2: expected"),
        ({"tree_top_k": 2}, None, None),
        ({}, [(1, 2)], "speculative_config num_speculative_tokens_per_batch_size=[(1, 2)]"),
        ({}, [(2, 8, 2)], "num_speculative_tokens_per_batch_size=[(2, 8, 2)]"),
        ({}, [(1, 4, 2), (5, 8, 0)], None),
    ],
)
def test_the_vllm_hook_reads_the_engines_fields(tmp_path, hook, fields, schedule, message):
    """Bad fields of ``additional_config["specstream"]`` and a schedule vLLM's validator
    refuses are refused in the front-end, before any engine starts (the worker would read
    the same options)."""
    check_vllm_config = hook
    vllm_config = engine_config(make_checkpoint(tmp_path), **fields)
    vllm_config.speculative_config.num_speculative_tokens_per_batch_size = schedule
    if message is None:
        check_vllm_config(vllm_config)
        return
    with pytest.raises(ConfigError) as refused:
        check_vllm_config(vllm_config)
    assert message in str(refused.value)


def test_stream_params_follow_the_config_shapes():
    """The model's parameters and the front-end's check share one definition."""
    pytest.importorskip("torch")
    from vllm_specstream.model_executor.stream_forward import StreamParams

    config = SpecStreamConfig(num_streams=3, init_rank=2)
    config.prune.enabled = True
    params = {n: tuple(p.shape) for n, p in StreamParams(config, HIDDEN).named_parameters()}
    assert params == config.stream_tensor_shapes(HIDDEN)
    assert set(params) == {"stream_embeddings", "init_a", "init_b", "prune_a", "prune_b"}


@pytest.mark.parametrize(
    ("resolved", "requested", "cls", "dtype", "words"),
    [
        ("bfloat16", "auto", "avx2", "float32", "serving the bf16 checkpoint in float32"),
        ("bfloat16", "auto", "avx512", "float32", "this CPU (avx512) has no native bf16"),
        ("bfloat16", "bfloat16", "avx2", None, "pass --dtype float32"),
        ("bfloat16", "auto", "avx512_bf16", None, ""),
        ("bfloat16", "bfloat16", "amx", None, ""),
        ("float32", "auto", "avx2", None, ""),
    ],
)
def test_dtype_advice_on_cpus_without_native_bf16(resolved, requested, cls, dtype, words):
    from vllm_specstream.speculation.preflight import dtype_advice

    got, message = dtype_advice(resolved, requested, cls)
    assert got == dtype
    assert (words in message) if words else message == ""


def test_the_vllm_hook_serves_a_bf16_checkpoint_in_fp32_where_bf16_is_slow(tmp_path):
    """``--dtype auto`` and a bf16 specstream checkpoint: float32 on a CPU without native
    bf16 (this one, or a flag set that says so), unchanged where the CPU has it; other
    models and an explicit dtype are left alone."""
    pytest.importorskip("vllm")
    from vllm_specstream.machine import native_bf16
    from vllm_specstream.patches.engine_config_check import _advise_dtype

    ckpt = make_checkpoint(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    args = SimpleNamespace(model=str(ckpt), dtype="auto", speculative_config=None)
    _advise_dtype(args)
    assert args.dtype == ("auto" if native_bf16() else "float32")
    explicit = SimpleNamespace(model=str(ckpt), dtype="bfloat16", speculative_config=None)
    _advise_dtype(explicit)
    assert explicit.dtype == "bfloat16"
    (ckpt / "config.json").write_text(
        json.dumps({**config, "torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]})
    )
    other = SimpleNamespace(model=str(ckpt), dtype="auto", speculative_config=None)
    _advise_dtype(other)
    assert other.dtype == "auto"


def test_a_base_served_for_adapters_needs_lora_and_no_stream_tensors(tmp_path):
    ckpt = make_checkpoint(tmp_path, streams_shape=None, adapter_streams_only=True)
    check(ckpt, lora=True)  # no specstream.safetensors needed: the adapters carry the streams
    check(ckpt, k=None)  # served without speculation: nothing to draft with, nothing to check
    with pytest.raises(ConfigError, match="adapter_streams_only.*--enable-lora"):
        check(ckpt, lora=False)
    with pytest.raises(ConfigError, match="per-adapter streams .* pipeline_parallel_size 1 only"):
        check(ckpt, lora=True, pp=2)


def test_lora_under_tensor_parallelism_passes_and_streams_only_limits(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    args = dict(
        model=str(ckpt),
        hf_config=SimpleNamespace(**config),
        spec_method="custom_class",
        spec_model=PROPOSER,
        num_speculative_tokens=2,
        platform=CPU,
    )
    check_setup(**args, lora_enabled=True, tensor_parallel_size=1)
    check_setup(**args, lora_enabled=False, tensor_parallel_size=3)
    check_setup(**args, lora_enabled=True, tensor_parallel_size=3)
    # A streams-only checkpoint: its stream LoRA works without adapters (on any number of
    # ranks: test_tree_verification.py, trees at tensor parallel 3).
    config["specstream"]["stream_lora_rank"] = 2
    args["hf_config"] = SimpleNamespace(**config)
    with pytest.raises(ConfigError, match="stream_lora_rank > 0.*without --enable-lora"):
        check_setup(**args, lora_enabled=True, tensor_parallel_size=1)


def test_tree_pruning_needs_a_pruning_adapter(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    check(ckpt, k=4, tree_top_k=2)  # the checkpoint's threshold: none, no adapter needed
    check(ckpt, k=4, tree_top_k=2, tree_prune="off")
    with pytest.raises(
        ConfigError,
        match=r"field tree_prune=0.05: the checkpoint has no pruning adapter "
        r"\(.*ckpt/config.json: specstream.prune.enabled is false\).*--objective prune",
    ):
        check(ckpt, k=4, tree_top_k=2, tree_prune=0.05)


def test_draft_trees_need_a_tree_that_fills_the_drafts(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    check(ckpt, k=5, tree_top_k=2)  # more drafts than streams: a tree's nodes
    check(ckpt, k=5, tp=2, tree_top_k=2)  # trees under tensor parallelism
    check(ckpt, k=2, tp=2)  # chains under tensor parallelism
    with pytest.raises(ConfigError, match=r"num_speculative_tokens=20 exceeds the 14 nodes"):
        check(ckpt, k=20, tree_top_k=2)


def test_pipeline_parallelism_speculates_with_chains_when_the_last_rank_holds_the_msa_layers(
    tmp_path, monkeypatch
):
    ckpt = make_checkpoint(tmp_path)  # 4 layers, the top 2 MSA: the last of 2 ranks holds 2-3
    check(ckpt, k=2, pp=2)
    check(ckpt, k=None, pp=2)  # and serves plainly
    with pytest.raises(ConfigError, match=r"draft trees .* pipeline_parallel_size 1 only, got 2"):
        check(ckpt, k=5, pp=2, tree_top_k=2)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    with pytest.raises(
        ConfigError,
        match=r"config.json: specstream.num_msa_layers=2 puts the MSA layers at 2-3, but at "
        r"pipeline_parallel_size 2 the last rank holds layers 3-3.*VLLM_PP_LAYER_PARTITION, "
        r"e.g. 2,2\)",
    ):
        check(ckpt, k=2, pp=2)
    check(ckpt, k=None, pp=2)  # plain serving splits the layers as it likes


def test_a_retired_proposer_class_is_refused_naming_its_placement(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="placement='accepted'"):
        check(ckpt, model="vllm_specstream.proposer.AcceptedSpecStreamProposer")


@pytest.mark.parametrize(
    ("marked", "size", "message"),
    [
        (3, 3, None),
        (3, 4, r"draft_vocab_mask marks 3 tokens but draft_vocab_size is 4"),
        (0, 2, r"draft_vocab_mask marks 0 tokens"),
    ],
)
def test_the_draft_vocabulary_is_checked_before_the_engine_starts(tmp_path, marked, size, message):
    ckpt = make_checkpoint(tmp_path, draft_vocab_size=size)
    config = json.loads((ckpt / "config.json").read_text())
    config["vocab_size"] = 10
    (ckpt / "config.json").write_text(json.dumps(config))
    mask = np.zeros(10, dtype=np.float32)
    mask[:marked] = 1
    save_file(
        {
            "specstream.stream_embeddings": np.zeros((3, HIDDEN), dtype=np.float32),
            "specstream.draft_vocab_mask": mask,
        },
        str(ckpt / "specstream.safetensors"),
    )
    if message is None:
        check(ckpt, k=3)
    else:
        with pytest.raises(ConfigError, match=message):
            check(ckpt, k=3)


def test_suffix_drafts_need_arctic_inference_and_chains(tmp_path, monkeypatch):
    import builtins

    ckpt = make_checkpoint(tmp_path)
    real_import = builtins.__import__

    def without_arctic(name, *args, **kwargs):
        if name.startswith("arctic_inference"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_arctic)
    with pytest.raises(
        ConfigError,
        match=r"suffix drafts \(field suffix_drafts\) need arctic-inference.*"
        r"make suffix-decoding",
    ):
        check(ckpt, k=2, suffix_drafts="on")
    check(ckpt, k=None, suffix_drafts="on")  # not speculating: nothing to draft with
    check(ckpt, k=2, suffix_drafts="off")
    # A checkpoint's default is no error without arctic-inference (the engine says why).
    (tmp_path / "default").mkdir()
    default = make_checkpoint(tmp_path / "default", suffix_drafts="on")
    check(default, k=2)
    check(default, k=2, stream_dtype="auto")  # read from the engine config as well
    with pytest.raises(ConfigError, match="drafts chains beside the streams, not trees"):
        check(ckpt, k=2, suffix_drafts="on", tree_top_k=2)
