"""A streams-only checkpoint on real vLLM engines: its drafts are the training wrapper's
(stream LoRA included, both placements) and its outputs are the base model's."""

import pytest
from engine_child import run_child
from test_specstream_engine import _stash_rows_and_training_drafts, make_requests

from vllm_specstream.options import ENV_STREAM_DTYPE

pytestmark = [pytest.mark.engine, pytest.mark.model]


@pytest.mark.parametrize("placement", ["window", "accepted"])
def test_drafts_equal_the_training_implementation(tiny_streams_only, placement):
    from vllm_specstream.training.checkpoint import load_merged

    _, merged = tiny_streams_only
    result, out = run_child(
        "probe",
        env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", ENV_STREAM_DTYPE: "model"},
        ckpt=str(merged),
        max_tokens=[9],
        prompts=[r["prompt"] for r in make_requests(3, seed=1)],
        placement=placement,
    )
    model = load_merged(merged)
    checked = 0
    for probe in result["probes"]:
        for row, want in _stash_rows_and_training_drafts(model, probe):
            assert row == want, (row, want)
            checked += 1
    assert checked >= 3, result["probes"]


def test_outputs_are_the_base_models(tiny_streams_only):
    """Greedy outputs with speculation equal the *base* checkpoint's served plainly."""
    base, merged = tiny_streams_only
    requests = make_requests(12, seed=4)
    plain = run_child("generate", ckpt=str(base), k=0, engine={}, requests=requests)[0]
    spec = run_child("generate", ckpt=str(merged), k=3, engine={}, requests=requests)[0]
    assert spec["tokens"] == plain["tokens"]
    assert spec["metrics"]["vllm:spec_decode_num_drafts"] > 0


def test_cli_distils_with_vllm_once_and_trains(tiny_streams_only, tmp_path):
    """`specstream train --objective streams-only` writes the base model's replies to every
    prompt (train and held out) with vLLM, trains on them, and reuses them when run again."""
    import json
    import subprocess

    from helpers import venv_script

    base, _ = tiny_streams_only
    out = tmp_path / "run"
    cmd = [
        venv_script("specstream"),
        "train",
        "--objective",
        "streams-only",
        "--base",
        str(base),
        "--out",
        str(out),
        "--num-train",
        "6",
        "--num-eval",
        "2",
        "--num-streams",
        "2",
        "--num-msa-layers",
        "2",
        "--stream-lora-rank",
        "2",
        "--distill-max-tokens",
        "12",
        "--batch-size",
        "2",
        "--max-length",
        "128",
        "--dtype",
        "fp32",
    ]
    first = subprocess.run([*cmd, "--steps", "1"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    records = [json.loads(x) for x in (out / "self_distill.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(r["messages"][-1]["role"] == "user" for r in records)
    assert all(r["completion"] for r in records)  # 12 tokens of a random model: never empty
    again = subprocess.run([*cmd, "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "has a reply for each of the prompts" in again.stdout + again.stderr
    assert len((out / "self_distill.jsonl").read_text().splitlines()) == 8
