"""Speculative streaming on real vLLM engines: lossless greedy, drafts flow, clear errors."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from engine_child import run_child

from vllm_specstream.bench.bench import has_suffix_decoding
from vllm_specstream.model_executor.stream_weights import bf16_gemm_available

pytestmark = [pytest.mark.engine, pytest.mark.model]

WORDS = [
    "select",
    "the",
    "name",
    "from",
    "table",
    "where",
    "id",
    "equals",
    "value",
    "order",
    "by",
    "count",
    "group",
    "limit",
]


def make_requests(n: int, seed: int) -> list[dict]:
    """Prompts of varied length (2 to ~300 tokens), some with stop strings or max_tokens 1."""
    import random

    rng = random.Random(seed)
    requests = []
    for i in range(n):
        length = rng.choice([1, 3, 8, 20, 60, 150])
        prompt = " ".join(rng.choice(WORDS) for _ in range(length))
        req = {"prompt": prompt, "max_tokens": rng.choice([1, 8, 24, 40])}
        if i % 5 == 0:
            req["stop"] = ["e", "a"]  # frequent letters: generation really stops on them
        requests.append(req)
    return requests


#: Engine settings of the lossless tests: defaults (prefix caching and chunked prefill on),
#: and tiny prefill chunks with a KV cache of 256 tokens, so that long prompts are split
#: over several steps, some steps hold only partial prefills, and requests are preempted
#: and recomputed mid-generation (3-5 times per run; with 416 tokens it was 0-1, and the
#: count depends on how fast requests reach the engine core).
ENGINES = {
    "default": {},
    "chunked": {
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        "enable_prefix_caching": True,
        "max_model_len": 224,
        "block_size": 32,
        "num_gpu_blocks_override": 8,
    },
}


def run_engine(ckpt, spec: int, engine: dict, requests: list[dict], placement=None, env=None, **kw):
    """``engine_child.generate`` (``kw``: its further arguments, e.g. ``trees`` or the
    plugin's ``fields``)."""
    result, out = run_child(
        "generate",
        env=env,
        ckpt=str(ckpt),
        k=spec,
        engine=engine,
        requests=requests,
        placement=placement,
        **kw,
    )
    # The proposer never met a stash of another step (the stash's anchor tokens are the
    # requests' last accepted tokens in every step of these runs).
    log = out.stdout + out.stderr
    assert "refused the model's stream stash" not in log, out.stderr[-6000:]
    result["suffix_drafted"] = "specstream drafts from the suffix trees" in log
    result["suffix_from_checkpoint"] = "(the checkpoint's specstream.suffix_drafts;" in log
    result["lookup_drafted"] = "specstream drafts by prompt lookup" in log
    chosen = re.search(r"specstream stream placement: (\w+) \(", log)
    result["default_placement"] = chosen and chosen.group(1)
    return result


PLACEMENTS = ("window", "accepted")
#: Placements run per engine setting (the default placement everywhere); "tree": draft
#: trees verified in vLLM (6 nodes, top-2 per stream; ``test_tree_verification.py``).
ENGINE_PLACEMENTS = {"default": PLACEMENTS, "chunked": ("window", "tree", "suffix")}
#: The engine fields of a "tree" run, and its environment (the tests read the worker's tree
#: counters through ``LLM.apply_model``).
TREE_FIELDS = {"tree_top_k": 2}
INSPECT_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
#: "suffix": chains with suffix-tree drafts wherever the trees have one (threshold 0, the
#: checkpoint's ``specstream.suffix_drafts`` default: :func:`suffix_checkpoint`), the
#: streams elsewhere; run where arctic-inference's suffix trees are built
#: (``make suffix-decoding``: the engine finds that build without PYTHONPATH), with
#: requests preempted and recomputed mid-generation.


def with_section(ckpt: Path, out: Path, **fields) -> Path:
    """A copy at ``out`` of merged checkpoint ``ckpt`` whose config.json ``specstream``
    section has ``fields``."""
    shutil.copytree(ckpt, out)
    config = json.loads((out / "config.json").read_text())
    config["specstream"].update(fields)
    (out / "config.json").write_text(json.dumps(config))
    return out


def suffix_checkpoint(ckpt: Path, out: Path, suffix_drafts: str) -> Path:
    """A copy of merged checkpoint ``ckpt`` whose config.json sets ``suffix_drafts``."""
    return with_section(ckpt, out, suffix_drafts=suffix_drafts)


PLACEMENT_NAMES = (*PLACEMENTS, "tree", "suffix")
#: Stream-pass matmuls per placement in the "default" setting, so that both paths of
#: ``stream_weights`` run whatever the CPU (the "chunked" setting takes the automatic one);
#: where the CPU has no bf16 GEMM, "bfloat16" runs the fallback to the model's dtype.
STREAM_DTYPES = {"window": "model", "accepted": "bfloat16"}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def runs(request, tiny_merged, tmp_path_factory):
    """Plain and speculative runs (both stream placements) of the same 32 requests (one
    batch: vLLM mixes prefill and decode rows, and rows move as requests finish)."""
    requests = make_requests(32, seed=len(request.param))
    engine = ENGINES[request.param]
    # The default setting's window run (the placement an eager engine takes) runs in the
    # user's process layout (front-end, engine core, worker), every other run with the
    # engine in one process (engine_child.IN_PROCESS_ENV): its outputs are the same, and it
    # starts without importing vLLM again.
    plain = run_engine(tiny_merged, 0, engine, requests)
    placements = ENGINE_PLACEMENTS[request.param]
    if not has_suffix_decoding():
        placements = tuple(p for p in placements if p != "suffix")
    spec = {
        p: run_engine(
            tiny_merged,
            6,
            engine,
            requests,
            env=INSPECT_ENV,
            # the tree's stream pass through the int8 copies (every x86 CPU has them)
            fields=TREE_FIELDS | {"stream_dtype": "int8"},
            trees=True,
        )
        if p == "tree"
        else run_engine(
            suffix_checkpoint(tiny_merged, tmp_path_factory.mktemp("suffix") / "ckpt", "0"),
            3,
            engine,
            requests,
        )
        if p == "suffix"
        else run_engine(
            tiny_merged,
            3,
            engine,
            requests,
            # the chunked setting's window run takes the default placement (chosen for the CPU)
            None if (p, request.param) == ("window", "chunked") else p,
            fields={"stream_dtype": STREAM_DTYPES[p]} if request.param == "default" else None,
            processes=(p, request.param) == ("window", "default"),
        )
        for p in placements
    }
    return requests, plain, spec


def _spec_run(runs, placement) -> dict:
    if placement == "suffix" and not has_suffix_decoding():
        pytest.skip("arctic-inference's suffix trees are not built here (make suffix-decoding)")
    if placement not in runs[2]:
        pytest.skip(f"placement {placement} is not run with these engine settings")
    return runs[2][placement]


@pytest.mark.parametrize("placement", PLACEMENT_NAMES)
def test_greedy_is_token_identical_with_speculation(runs, placement):
    requests, plain, _ = runs
    spec = _spec_run(runs, placement)
    assert spec["tokens"] == plain["tokens"]
    assert spec["text"] == plain["text"]
    # The request mix really has what it claims.
    assert any(len(t) == 1 for t in plain["tokens"]) and any(len(t) >= 24 for t in plain["tokens"])
    stopped = [
        i
        for i, r in enumerate(requests)
        if "stop" in r and len(plain["tokens"][i]) < r["max_tokens"]
    ]
    assert stopped, "no request ended on a stop string"


@pytest.mark.parametrize("placement", PLACEMENT_NAMES)
def test_drafts_are_proposed_and_counted(runs, placement):
    run = _spec_run(runs, placement)
    metrics = run["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0, metrics
    if placement == "tree":
        assert run["trees"]["tree_rows"] > 0, run["trees"]
    if placement == "suffix":
        assert run["suffix_drafted"], "no step drafted from the suffix trees"
        assert run["suffix_from_checkpoint"], "suffix drafts not set by the checkpoint's default"
    assert metrics["vllm:spec_decode_num_draft_tokens"] >= metrics["vllm:spec_decode_num_drafts"]


def test_an_eager_engine_runs_the_window_placement_by_default(runs, request):
    chosen = {p: run["default_placement"] for p, run in runs[2].items() if p != "tree"}
    if "chunked" in request.node.callspec.id:
        assert chosen["window"] == "window", chosen
        if has_suffix_decoding():  # else the suffix engine is not run (make suffix-decoding)
            assert chosen["suffix"] == "window", chosen
    else:  # placements named: nothing chosen
        assert set(chosen.values()) == {None}, chosen


def test_small_kv_cache_preempts(runs, request):
    """The "chunked" setting really preempts requests (so the lossless test covers drafts of
    recomputed requests)."""
    if "chunked" not in request.node.callspec.id:
        pytest.skip("only the chunked setting has a small KV cache")
    assert runs[2]["window"]["metrics"]["vllm:num_preemptions"] > 0


@pytest.mark.parametrize(
    ("placement", "stream_dtype"),
    [
        ("window", "model"),
        ("window-draft-vocab", "model"),
        ("accepted", "model"),
        ("accepted", "bfloat16"),
        ("accepted", "int8"),
    ],
)
def test_stream_drafts_equal_the_training_implementation(request, placement, stream_dtype):
    """The streams vLLM computes over its paged cache give the same top-1 tokens as the
    training wrapper on the same checkpoint, at every anchor of the last forward: the
    prefill's last token (max_tokens=1) and a decode window with rejected drafts (9); with
    placement "accepted" the one anchor is the last accepted token. With the stream pass in
    bf16 or int8 (field ``stream_dtype``) the drafts may differ where the top-2 logits are
    close: at least 80% agree; on a CPU without a bf16 GEMM the engine says it falls back
    and the drafts are exact. The same engine checks a user's batch-size schedule: with 2
    drafts per request only streams 1-2 run (and equal streams 1-2 of all), none at batch
    32, drafts at batch 1. "window-draft-vocab": a checkpoint whose streams draft from a
    third of the vocabulary (as the training wrapper's drafts, which differ from the whole
    vocabulary's); its window streams wait for the proposer, which projects the anchors it
    reads (the snapshot the rest)."""
    from vllm_specstream.training.checkpoint import load_merged

    vocab = deferred = placement == "window-draft-vocab"  # a draft head never rides along
    placement = "window" if placement.startswith("window") else placement
    tiny_merged = request.getfixturevalue("tiny_merged_draft_vocab" if vocab else "tiny_merged")

    prompts = [r["prompt"] for r in make_requests(3, seed=1)]
    result, out = run_child(
        "probe",
        env=INSPECT_ENV,
        fields={"stream_dtype": stream_dtype},
        ckpt=str(tiny_merged),
        max_tokens=[1, 9],
        prompts=prompts,
        placement=placement,
    )
    log = out.stdout + out.stderr
    assert "refused the model's stream stash" not in log, log[-4000:]
    # A window of 4 anchors x 3 streams rides along the main rows, but not to a draft head.
    windows = [p["stash"] for p in result["probes"] if p["max_tokens"] == 9]
    assert all(s["deferred"] == deferred for s in windows), windows
    packed = stream_dtype == "int8" or (stream_dtype == "bfloat16" and bf16_gemm_available())
    if stream_dtype == "bfloat16":
        said = "stream pass in bfloat16" if packed else "bfloat16 cannot be honoured"
        assert said in log, log[-4000:]
    if stream_dtype == "int8":
        assert "stream pass in int8" in log, log[-4000:]
    # The user's schedule, read by the proposer as vLLM reads it: 32 requests together draft
    # nothing (the engine may run its first steps before all 32 requests have arrived, and
    # those may draft), one request alone drafts.
    assert result["schedule_drafts"][0] <= 4 * 32 and result["schedule_drafts"][1] >= 10, result
    model = load_merged(tiny_merged)
    checked = {1: 0, 9: 0}
    agree = total = outside = 0
    for probe in result["probes"]:
        assert len(probe["stash"]["qsl"]) == 2  # the request's own forward, alone
        for row, want, whole in _stash_rows_and_training_drafts(model, probe):
            if not packed:
                assert row == want, (probe["max_tokens"], row, want)
            agree += sum(x == y for x, y in zip(row, want))
            total += len(want)
            outside += sum(x != y for x, y in zip(want, whole))
            checked[probe["max_tokens"]] += 1
    # The draft vocabulary changed drafts (else this case could not tell it was used).
    assert (outside > 0) == vocab, outside
    # Every prompt has its anchor; a decode window has several unless only one is run.
    assert checked[1] >= 3 and checked[9] >= (3 if placement == "accepted" else 4), checked
    assert agree >= 0.8 * total, (agree, total)
    # Two requests, 2 drafts each: only streams 1-2 ran, and they are streams 1-2 of all.
    # (The engine may start one request a step early, so that the last forward holds one
    # request drafting 3; then only the drafts it has are checked.)
    pair = list(_stash_rows_and_training_drafts(model, result["pair"]))
    assert pair, result["pair"]["stash"]
    for row, want, _ in pair:
        n = next((j for j, t in enumerate(row) if t < 0), len(row))
        assert n >= 2 and (packed or row[:n] == want[:n]), (row, want)


def _stash_rows_and_training_drafts(model, probe):
    """``(draft table row, the training wrapper's stream top-1 tokens, the same over the whole
    vocabulary)`` at every anchor of the stash of ``probe`` (rows without drafts are
    skipped)."""
    import torch

    stash = probe["stash"]
    qsl, positions, ids, table = (
        stash["qsl"],
        stash["positions"],
        stash["input_ids"],
        stash["table"],
    )
    for r in range(len(qsl) - 1):
        seq = probe["prompt_ids"][r] + probe["tokens"][r]
        # Tokens before the window are known; inside it, the scheduled ones (drafts included).
        known = seq[: positions[qsl[r]]] + ids[qsl[r] : qsl[r + 1]]
        for i in range(qsl[r], qsl[r + 1]):
            if table[i][0] < 0:
                continue
            t = positions[i]
            with torch.no_grad():
                ref = model(torch.tensor([known[: t + 1]]), anchors=torch.tensor([[t]]))
                hidden = ref.stream_hidden[0, 0]
                yield (
                    table[i],
                    model.stream_logits(hidden).argmax(-1).tolist(),
                    model.lm_head(hidden).argmax(-1).tolist(),
                )


def _copy(ckpt: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(ckpt, dest)
    return dest


def _without_streams(ckpt: Path, tmp: Path) -> Path:
    broken = _copy(ckpt, tmp / "no-streams")
    (broken / "specstream.safetensors").unlink()
    return broken


def _format_99(ckpt: Path, tmp: Path) -> Path:
    return with_section(ckpt, tmp / "format-99", format_version=99)


def _gemma3_base(ckpt: Path, tmp: Path) -> Path:
    # A base family the stream layers do not implement (sliding-window layers).
    return with_section(ckpt, tmp / "gemma3-base", base_architectures=["Gemma3ForCausalLM"])


def _half_hidden(ckpt: Path, tmp: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    broken = _copy(ckpt, tmp / "half-hidden")
    tensors = load_file(str(broken / "specstream.safetensors"))
    p = tensors["specstream.stream_embeddings"]
    tensors["specstream.stream_embeddings"] = torch.zeros(p.shape[0], p.shape[1] // 2)
    save_file(tensors, str(broken / "specstream.safetensors"))
    return broken


#: The broken setups a user meets, as (checkpoint from tiny_merged, k, the message[, the
#: environment added, the plugin's fields]).
#: The tiny checkpoint has num_streams 3 and hidden size 128.
BROKEN_SETUPS = {
    "missing-stream-tensors": (
        _without_streams,
        2,
        "specstream.safetensors: missing stream tensor(s) ['specstream.stream_embeddings']",
    ),
    "k-above-num-streams": (
        lambda ckpt, tmp: ckpt,
        5,
        "num_speculative_tokens=5 exceeds the checkpoint's num_streams=3",
    ),
    "plain-model": (
        lambda ckpt, tmp: ckpt.with_name(ckpt.name + "-base"),  # the base it was built from
        2,
        "the specstream proposer needs a SpecStreamForCausalLM checkpoint",
    ),
    "format-version-99": (
        _format_99,
        2,
        "config.json (specstream): format_version is 99, newer than this vllm-specstream",
    ),
    "unsupported-base-architecture": (
        _gemma3_base,
        2,
        "specstream.base_architectures is ['Gemma3ForCausalLM']; vllm-specstream serves",
    ),
    "wrong-hidden-size": (
        _half_hidden,
        2,
        "tensor specstream.stream_embeddings has shape [3, 64], expected [3, 128]",
    ),
    "bad-stream-dtype-field": (
        lambda ckpt, tmp: ckpt,
        2,
        "additional_config['specstream']['stream_dtype']='fp8': expected one of",
        None,
        {"stream_dtype": "fp8"},
    ),
    "retired-variable": (
        lambda ckpt, tmp: ckpt,
        2,
        "SPECSTREAM_TREE_TOP_K is no longer read: set field 'tree_top_k'",
        {"SPECSTREAM_TREE_TOP_K": "2"},
    ),
}


def last_line_of_failed_start(
    ckpt: Path, k: int, front_end: str, env: dict | None = None, fields: dict | None = None
) -> tuple[str, str]:
    """Start ``ckpt`` as a user would (``LLM(...)`` or ``vllm serve``, with ``env`` added to
    the environment and the plugin's ``fields``); it must fail. Returns the last non-empty
    line of the combined output, and the whole output."""
    from helpers import free_port, venv_script

    if front_end == "LLM":
        # (a process of its own; its traceback, the last thing it prints, goes to stderr)
        _, out = run_child(
            "fail_to_start", env=env, check=False, ckpt=str(ckpt), k=k, fields=fields
        )
        output = out.stdout + out.stderr
    else:
        cmd = [
            venv_script("vllm"),
            "serve",
            str(ckpt),
            "--spec-model",
            "specstream",
            "--spec-tokens",
            str(k),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.3",
            "--port",
            str(free_port()),
        ]
        if fields:
            cmd += ["--additional-config", json.dumps({"specstream": fields})]
        out = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
            env={**os.environ, **(env or {})},
        )
        output = out.stdout
    assert out.returncode != 0, output[-3000:]
    return [line for line in output.splitlines() if line.strip()][-1], output


#: ``vllm serve`` prints a front-end error as ``LLM()`` does whichever check raised it; it
#: runs for one setup of each check (the checkpoint's files, the drafts asked for, the
#: configuration) to keep the suite's time, ``LLM()`` for every setup.
SERVE_SETUPS = ("missing-stream-tensors", "k-above-num-streams", "bad-stream-dtype-field")


@pytest.mark.parametrize(
    "setup,front_end",
    [(s, "LLM") for s in sorted(BROKEN_SETUPS)] + [(s, "serve") for s in SERVE_SETUPS],
)
def test_broken_setup_names_the_cause_last(tiny_merged, tmp_path, setup, front_end):
    """Each broken setup fails in the front-end, before vLLM spawns an engine, and the last
    line a user sees is the error naming the file, field or flag and the fix."""
    make, k, message, *config = BROKEN_SETUPS[setup]
    last, log = last_line_of_failed_start(make(tiny_merged, tmp_path), k, front_end, *config)
    assert message in last, log[-4000:]
    assert last.startswith("vllm_specstream.checkpoint.config.ConfigError: "), last
    assert "EngineCore" not in log, log[-4000:]  # no engine process was started
