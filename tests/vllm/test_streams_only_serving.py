"""A streams-only checkpoint on real vLLM engines: its drafts are the training wrapper's
(stream LoRA included, both placements), its outputs the base model's; and the CLI that
trains one writes the base model's replies with vLLM."""

import os

import pytest
from engine_child import run_child
from helpers import SAME_DRAFTS
from test_lora_serving import _deployment
from test_specstream_engine import _stash_rows_and_training_drafts, make_requests

pytestmark = [pytest.mark.engine, pytest.mark.model]


#: ``LLM.apply_model`` (the stash snapshot) sends a function to the engine process.
INSPECT = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
REQUESTS = [{"prompt": r["prompt"], "max_tokens": 16} for r in make_requests(3, seed=1)]
#: The CLI's replies engine with a KV cache of 1 GiB: vLLM's automatic size (a share of the
#: machine's memory) fails at start-up while other tests' engines hold memory.
SMALL_KV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def base_outputs(tiny_streams_only) -> list[list[int]]:
    """Greedy outputs of the *base* checkpoint served plainly, one request at a time."""
    base, _ = tiny_streams_only
    served = run_child("lora_stash", ckpt=str(base), k=0, engine={}, requests=REQUESTS)[0]
    return [r["tokens"] for r in served]


@pytest.mark.parametrize("placement", ["window", "accepted"])
def test_drafts_are_the_training_wrappers_and_outputs_the_base_models(
    tiny_streams_only, base_outputs, placement
):
    """Each request decoded alone with speculation: the drafts of its last forward equal the
    training wrapper's streams (stream LoRA included) and its output the base model's."""
    from vllm_specstream.training.checkpoint import load_merged

    _, merged = tiny_streams_only
    served = run_child(
        "lora_stash",
        ckpt=str(merged),
        k=3,
        engine={"placement": placement, "fields": SAME_DRAFTS},
        requests=REQUESTS,
        env=INSPECT,
    )[0]
    assert [r["tokens"] for r in served] == base_outputs
    model = load_merged(merged)
    checked = 0
    for probe in served:
        for row, want, _ in _stash_rows_and_training_drafts(model, probe):
            assert row == want, (row, want)
            checked += 1
    assert checked >= 3, served


def test_cli_distils_with_vllm_once_and_trains(tiny_streams_only, tmp_path):
    """`specstream train --objective streams-only` writes the base model's replies to every
    prompt (train and held out) with vLLM, trains on them, and reuses them when run again.
    A prompt longer than the model's context (2,048 tokens) keeps its last tokens."""
    import json
    import subprocess

    from helpers import venv_script

    base, _ = tiny_streams_only
    out = tmp_path / "run"
    records = [
        {"prompt": f"Question {i}: what is {i} plus {i}?", "completion": "x"} for i in range(8)
    ]
    records[3]["prompt"] = "a long schema " * 1000 + records[3]["prompt"]  # ~3,000 tokens
    for name, part in (("train", records[:6]), ("eval", records[6:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    cmd = [
        venv_script("specstream"),
        "train",
        "--objective",
        "streams-only",
        "--base",
        str(base),
        "--out",
        str(out),
        "--data",
        str(tmp_path / "train.jsonl"),
        "--eval-data",
        str(tmp_path / "eval.jsonl"),
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

    def run(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, capture_output=True, text=True, timeout=600, env={**os.environ, **SMALL_KV}
        )

    first = run([*cmd, "--steps", "1"])
    assert first.returncode == 0, first.stderr[-4000:]
    assert "(1 prompts longer than the model's context" in first.stdout + first.stderr
    records = [json.loads(x) for x in (out / "self_distill.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(r["messages"][-1]["role"] == "user" for r in records)
    assert all(r["completion"] for r in records)  # 12 tokens of a random model: never empty
    again = run([*cmd, "--steps", "2"])
    assert again.returncode == 0, again.stderr[-4000:]
    assert "has a reply for each of the prompts" in again.stdout + again.stderr
    assert len((out / "self_distill.jsonl").read_text().splitlines()) == 8
    cmd[cmd.index(str(out))] = str(tmp_path / "too-long")
    cmd[cmd.index("--distill-max-tokens") + 1] = "2048"
    refused = run(cmd)
    assert refused.returncode != 0
    assert "--distill-max-tokens 2048 leaves no room" in refused.stderr.strip().splitlines()[-1]


def assert_drafts_as_trained(served: dict, merged, tokens: list) -> None:
    """A ``lora_stash`` result: the base model's tokens, and at every anchor the drafts of
    the training wrapper on the adapter merged (``merged``)."""
    from vllm_specstream.training.checkpoint import load_merged

    assert served["tokens"] == tokens
    rows = list(_stash_rows_and_training_drafts(load_merged(merged), served))
    assert rows, served["stash"]
    for row, want, _ in rows:
        assert row == want


def test_a_streams_only_adapter_under_multi_lora_drafts_as_trained(
    tiny_streams_only, tiny_adapters, base_outputs
):
    """The streams-only adapter directory (null LoRA + streams) as a LoRA module on the base
    deployment, beside a task adapter: its requests' outputs are the base model's, and their
    drafts the training wrapper's (stream LoRA included) in the window placement; in a mixed
    batch (streams-only, task adapter, no adapter; accepted placement) the streams-only and
    the base requests still get the base model's tokens and the streams-only one drafts."""
    base, merged = tiny_streams_only
    adapter = merged.with_name("adapter")
    task = tiny_adapters[1][0][0]
    engine = _deployment(base, [(adapter, None), (task, None)])
    alone = [{**REQUESTS[0], "lora": str(adapter)}]
    served = run_child(
        "lora_stash",
        ckpt=str(base),
        k=3,
        engine={**engine, "placement": "window", "fields": SAME_DRAFTS},
        requests=alone,
        env=INSPECT,
    )[0]
    assert_drafts_as_trained(served[0], merged, base_outputs[0])
    loras = [str(adapter), str(task), None]
    mixed = [{**r, "lora": lora} for r, lora in zip(REQUESTS, loras)]
    spec, _ = run_child(
        "generate", ckpt=str(base), k=3, engine=engine, requests=mixed, placement="accepted"
    )
    assert [spec["tokens"][0]] == base_outputs[0] and [spec["tokens"][2]] == base_outputs[2]
    assert spec["per_request"][0]["num_spec_steps"] > 0, spec["per_request"]
    assert not spec["per_request"][2] or spec["per_request"][2]["num_spec_steps"] == 0


def test_a_streams_only_adapter_drafts_as_trained_at_tensor_parallel_2(
    tiny_streams_only, base_outputs
):
    """The same adapter on 2 ranks: each runs its shard of the adapter's stream LoRA (rows of
    B for sharded outputs; A x of sharded inputs summed over ranks), so its drafts are the
    training wrapper's as on one rank."""
    base, merged = tiny_streams_only
    adapter = merged.with_name("adapter")
    engine = {
        **_deployment(base, [(adapter, None)]),
        "placement": "window",
        "fields": SAME_DRAFTS,
        "tensor_parallel_size": 2,
        "kv_cache_memory_bytes": 64 << 20,
    }
    served = run_child(
        "lora_stash",
        ckpt=str(base),
        k=3,
        engine=engine,
        requests=[{**REQUESTS[0], "lora": str(adapter)}],
        env={**INSPECT, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )[0]
    assert_drafts_as_trained(served[0], merged, base_outputs[0])


def test_medusa_heads_learn_the_replies_written_with_or_without_vllm(base_model_dir, tmp_path):
    """`specstream train --objective medusa --distill FILE` writes the served model's greedy
    replies where FILE lacks them, then trains the heads on them; on a machine without vLLM
    (a GPU that trains) Transformers writes them, prompts of different lengths batched and
    left-padded together: the same replies, token for token decoded."""
    import json
    import subprocess

    from helpers import venv_script

    questions = ["What is 2 + 2?", "Name a colour.", "Write one short sentence about the sea " * 6]
    questions += [f"Count from {i} to {i + 5}." for i in range(5)]
    for name, part in (("train", questions[:6]), ("eval", questions[6:])):
        rows = [{"prompt": q, "completion": "x"} for q in part]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hidden = tmp_path / "no-vllm"
    hidden.mkdir()
    (hidden / "vllm.py").write_text("raise ImportError('no vLLM on this machine')\n")

    def train(out: str, env: dict | None = None) -> str:
        cmd = [venv_script("specstream"), "train", "--objective", "medusa"]
        cmd += ["--base", str(base_model_dir), "--out", str(tmp_path / out)]
        cmd += ["--distill", str(tmp_path / out / "self_distill.jsonl")]
        cmd += [
            "--data",
            str(tmp_path / "train.jsonl"),
            "--eval-data",
            str(tmp_path / "eval.jsonl"),
        ]
        cmd += ["--num-streams", "2", "--distill-max-tokens", "24", "--batch-size", "2"]
        cmd += ["--max-length", "128", "--dtype", "fp32", "--steps", "1"]
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **SMALL_KV, **(env or {})},
        )
        assert done.returncode == 0, done.stderr[-4000:]
        assert (tmp_path / out / "model.safetensors").is_file()
        return done.stdout + done.stderr

    assert "with vLLM" in train("with-vllm")
    assert "with Transformers (vLLM is not installed)" in train(
        "without", {"PYTHONPATH": str(hidden)}
    )

    def replies(out: str) -> dict:
        lines = (tmp_path / out / "self_distill.jsonl").read_text().splitlines()
        return {json.dumps(r["messages"]): r["completion"] for r in map(json.loads, lines)}

    written = replies("with-vllm")
    assert len(written) == len(questions) and all(written.values())
    assert replies("without") == written
