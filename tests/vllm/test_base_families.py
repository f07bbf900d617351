"""Qwen3 and Phi-3 bases end to end on real engines: an adapter trained for a few steps
exports, loads and serves; its streams draft in vLLM exactly as in training; speculation
changes no output (both placements, chunked prefill); per-adapter streams under multi-LoRA.
(The Llama family's tests are test_specstream_engine.py and test_lora_serving.py.)"""

from pathlib import Path

import pytest
from conftest import make_tiny_base
from engine_child import run_child
from helpers import SAME_DRAFTS
from test_lora_serving import INSPECT, assert_drafts_are_the_training_models
from test_specstream_engine import ENGINES, make_requests

from vllm_specstream.checkpoint.config import SpecStreamConfig
from vllm_specstream.training.args import TrainArgs
from vllm_specstream.training.checkpoint import LoraSettings, export_merged, load_merged
from vllm_specstream.training.train import train

pytestmark = [pytest.mark.engine, pytest.mark.model]

#: The families beside Llama's, with the config fields that make them what users bring:
#: Qwen3's per-head q/k norms; Phi-3's fused projections, with partial rotary (Phi-4-mini's
#: layout) so that the rotary of the streams is checked where it differs from Llama's.
FAMILIES = {
    "qwen3": {},
    "phi3": {"partial_rotary_factor": 0.5},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, base_model_dir, tmp_path_factory) -> dict:
    """A tiny base of the family, a specstream adapter trained on it for 3 steps (LoRA on
    the family's own projections, its default targets) and the adapter merged."""
    import torch

    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_base(
        base_model_dir, root / "base", model_type=request.param, **FAMILIES[request.param]
    )
    args = TrainArgs(
        base=str(base),
        out=str(root / "adapter"),
        task="sql",
        steps=3,
        batch_size=2,
        lr=5e-2,  # a few steps that change the model
        spec=SpecStreamConfig(num_streams=3, num_msa_layers=2),
        lora=LoraSettings(rank=4),
        num_train=16,
        num_eval=2,
        eval_every=0,
        warmup_steps=1,
        max_length=96,
        dtype="fp32",
    )
    adapter = train(args, progress=False)
    merged = export_merged(adapter, root / "merged", dtype=torch.float32)
    return {"name": request.param, "base": base, "adapter": adapter, "merged": merged}


def test_lora_targets_are_the_familys_projections(family):
    import json

    targets = set(
        json.loads((family["adapter"] / "adapter_config.json").read_text())["target_modules"]
    )
    fused = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    split = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert targets == (fused if family["name"] == "phi3" else split)
    config = json.loads((family["merged"] / "config.json").read_text())
    want = {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}[family["name"]]
    assert config["specstream"]["base_architectures"] == [want]


def test_speculation_is_lossless_in_both_placements(family):
    """Chunked prefill over a small KV cache (preemptions), one batch of 16 requests."""
    requests = make_requests(16, seed=7)
    engine = ENGINES["chunked"]
    plain = run_child(
        "generate", ckpt=str(family["merged"]), k=0, engine=engine, requests=requests
    )[0]
    for placement in ("window", "accepted"):
        spec = run_child(
            "generate",
            ckpt=str(family["merged"]),
            k=3,
            engine=engine,
            requests=requests,
            placement=placement,
        )[0]
        assert spec["tokens"] == plain["tokens"], placement
        assert spec["metrics"]["vllm:spec_decode_num_drafts"] > 0, placement


def test_stream_drafts_equal_the_training_implementation(family):
    """The streams over vLLM's paged cache (the family's vLLM layers: q/k norms, fused
    projections, partial rotary) give the training wrapper's top-1 tokens at every anchor
    of a prefill's last token and of a decode window."""
    from test_specstream_engine import _stash_rows_and_training_drafts

    prompts = [r["prompt"] for r in make_requests(3, seed=1)]
    result, _ = run_child(
        "probe",
        env=INSPECT,
        fields={"stream_dtype": "model"},
        ckpt=str(family["merged"]),
        max_tokens=[1, 9],
        prompts=prompts,
        placement="window",
    )
    model = load_merged(family["merged"])
    checked = 0
    for probe in result["probes"]:
        for row, want, _ in _stash_rows_and_training_drafts(model, probe):
            assert row == want, (probe["max_tokens"], row, want)
            checked += 1
    assert checked >= 7, checked


def test_adapter_drafts_with_its_own_streams_on_a_base_deployment(family):
    """The base served for the adapter (multi-LoRA, `specstream deploy`): a request with the
    adapter drafts as the training wrapper on the adapter merged; one without drafts
    nothing."""
    from vllm_specstream.checkpoint.deployment import plan_deployment

    plan = plan_deployment(family["base"], {"task": str(family["adapter"])})
    engine = {
        "max_model_len": 512,
        "enable_lora": True,
        "max_loras": 1,
        "max_lora_rank": plan.max_lora_rank,
        "hf_overrides": plan.overrides(),
        "fields": SAME_DRAFTS,
    }
    prompt = make_requests(1, seed=2)[0]["prompt"]
    requests = [
        {"prompt": prompt, "max_tokens": 9, "lora": str(family["adapter"])},
        {"prompt": prompt, "max_tokens": 9, "lora": None},
    ]
    served = run_child(
        "lora_stash", ckpt=str(family["base"]), k=3, engine=engine, requests=requests, env=INSPECT
    )[0]
    assert_drafts_are_the_training_models(served[0], load_merged(Path(family["merged"])))
    assert all(t < 0 for row in served[1]["stash"]["table"] for t in row)


def test_a_fine_tune_given_as_a_peft_lora_gets_streams_and_keeps_its_outputs(
    base_model_dir, tmp_path
):
    """Bring your own fine-tune (docs/base-models.md): a Qwen3 base + the user's PEFT LoRA.
    `specstream train --objective streams-only --base LORA` merges the LoRA into its base,
    writes that model's replies with vLLM and trains streams on them; `specstream
    export` keeps every weight of the fine-tune, so the served outputs are its own (here
    equal to its plain greedy decoding) and the drafts are the training wrapper's."""
    import subprocess

    from helpers import venv_script
    from safetensors.torch import load_file
    from test_lora_serving import random_peft_adapter

    from vllm_specstream.training.reference_decoder import plain_greedy

    base = make_tiny_base(base_model_dir, tmp_path / "base", model_type="qwen3")
    lora = random_peft_adapter(base, tmp_path / "my-lora", targets=("q_proj", "v_proj"))
    run, merged = tmp_path / "run", tmp_path / "served"
    specstream = venv_script("specstream")
    train_cmd = [
        *(specstream, "train", "--objective", "streams-only", "--base", str(lora)),
        *("--out", str(run), "--task", "sql", "--num-train", "6", "--num-eval", "2"),
        *("--num-streams", "3", "--num-msa-layers", "2", "--distill-max-tokens", "12"),
        *("--batch-size", "2", "--max-length", "128", "--steps", "2", "--dtype", "fp32"),
    ]
    export_cmd = [specstream, "export", str(run), str(merged), "--dtype", "float32"]
    for cmd in (train_cmd, export_cmd):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
    fine_tune = load_file(str(run / "fine-tune" / "model.safetensors"))
    served = load_file(str(merged / "model.safetensors"))
    assert fine_tune.keys() == served.keys()
    assert all(bool((served[k] == v).all()) for k, v in fine_tune.items())
    prompts = [r["prompt"] for r in make_requests(2, seed=5)]
    out = run_child(
        "lora_stash",
        ckpt=str(merged),
        k=3,
        engine={"max_model_len": 512, "fields": SAME_DRAFTS},
        requests=[{"prompt": p, "max_tokens": 9} for p in prompts],
        env=INSPECT,
    )[0]
    model = load_merged(merged)
    for got in out:
        prompt, tokens = got["prompt_ids"][0], got["tokens"][0]
        assert plain_greedy(model, prompt, len(tokens), eos_token_id=-1) == tokens
        assert_drafts_are_the_training_models(got, model)
