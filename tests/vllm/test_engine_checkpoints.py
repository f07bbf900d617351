"""Engines on other checkpoints and settings: the committed demo adapter on the embedded
model (lossless, acceptance, the confidence rule, per-request metrics, vLLM's own ngram), a
Qwen2 base, tensor parallelism over 3 ranks, and sampling at temperature > 0 (chains and
trees) against plain sampling."""

import json
from pathlib import Path

import pytest
from engine_child import run_child
from test_specstream_engine import INSPECT_ENV, TREE_FIELDS, make_requests, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.model]

DEMO_ADAPTER = Path(__file__).parents[2] / "examples" / "adapters" / "sql-smollm2-ss4"


@pytest.fixture(scope="module")
def demo(base_model_dir, tmp_path_factory):
    """The committed demo adapter merged onto the embedded model (fp32) and 16 SQL test
    prompts."""
    import torch
    from transformers import AutoTokenizer

    from vllm_specstream.training.checkpoint import export_merged
    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks import build_task, to_example

    tmp = tmp_path_factory.mktemp("demo")
    ckpt = export_merged(DEMO_ADAPTER, tmp / "merged", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(ckpt)
    requests = [
        {"prompt": prompt_text(tok, to_example("sql", r).messages), "max_tokens": 64}
        for r in build_task("sql", "test", n=16)
    ]
    return ckpt, requests


@pytest.fixture(scope="module")
def demo_runs(demo):
    """The demo checkpoint plain, speculative, speculative with the stream-confidence rule,
    and with vLLM's ngram method (the streams idle), the 16 prompts in one batch."""
    ckpt, requests = demo
    plain = run_engine(ckpt, 0, {}, requests)
    spec = run_engine(ckpt, 4, {}, requests)
    confident = run_engine(ckpt, 4, {}, requests, fields={"draft_min_prob": 0.5})
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    return plain, spec, confident, run_engine(ckpt, 0, {"speculative_config": ngram}, requests)


def test_other_speculative_methods_serve_a_specstream_checkpoint(demo_runs):
    """vLLM's own methods on a specstream checkpoint (what `specstream bench` compares):
    the engine starts, ngram drafts, the outputs are plain decoding's."""
    plain, *_, ngram = demo_runs
    assert ngram["tokens"] == plain["tokens"]
    assert ngram["metrics"]["vllm:spec_decode_num_drafts"] > 0, ngram["metrics"]


def test_demo_checkpoint_is_lossless_and_accepts_drafts(demo_runs):
    """A trained checkpoint: outputs identical to plain decoding over 16 prompts, and the
    streams' drafts are mostly accepted (reference decoder: 3.2 tokens per step on the whole
    test split)."""
    plain, spec, *_ = demo_runs
    assert spec["tokens"] == plain["tokens"]
    metrics = spec["metrics"]
    tokens_per_step = 1 + (
        metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_drafts"]
    )
    assert tokens_per_step > 2.5, metrics
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and per_pos[0] >= per_pos[1] >= per_pos[2] >= per_pos[3] > 0


def test_prompt_lookup_drafts_beside_the_streams(demo_runs):
    """On by default: SQL copies names from the schema in its prompt, so some requests' steps
    draft by prompt lookup (the tiny random models of the other engine tests never repeat
    their context); the outputs above are plain decoding's."""
    _, spec, *_ = demo_runs
    assert spec["lookup_drafted"], "no step drafted by prompt lookup"


def test_confidence_rule_drafts_less_and_stays_lossless(demo_runs):
    """Field ``draft_min_prob``: shorter drafts, a larger share of them accepted, the
    same outputs."""
    plain, spec, confident, _ = demo_runs
    assert confident["tokens"] == plain["tokens"]

    def draft_len_and_acceptance(run):
        m = run["metrics"]
        tokens = m["vllm:spec_decode_num_draft_tokens"]
        return tokens / m["vllm:spec_decode_num_drafts"], m[
            "vllm:spec_decode_num_accepted_tokens"
        ] / tokens

    full_len, full_rate = draft_len_and_acceptance(spec)
    cut_len, cut_rate = draft_len_and_acceptance(confident)
    assert full_len == 4.0 and 1.0 <= cut_len < 3.9, (full_len, cut_len)
    assert cut_rate > full_rate, (cut_rate, full_rate)


def test_per_request_metrics_add_up_to_the_engine_counters(demo_runs):
    """vLLM's per-request acceptance metrics (``per_request_spec_decode_metrics``) are
    reported for every request and sum to the engine-wide counters."""
    spec = demo_runs[1]
    per_request, metrics = spec["per_request"], spec["metrics"]
    assert all(m is not None for m in per_request)
    accepted = sum(m["num_accepted_draft_tokens"] for m in per_request)
    assert accepted == metrics["vllm:spec_decode_num_accepted_tokens"]
    assert sum(m["num_spec_steps"] for m in per_request) == metrics["vllm:spec_decode_num_drafts"]
    assert all(1.0 <= m["mean_acceptance_length"] <= 5.0 for m in per_request)
    assert sum(m["mean_acceptance_length"] > 1.5 for m in per_request) >= len(per_request) // 2


def chi2_homogeneity_pvalue(a: list[int], b: list[int], min_count: int = 10) -> float:
    """Two-sample chi-square test that ``a`` and ``b`` come from one distribution; tokens
    seen fewer than ``min_count`` times in total are pooled."""
    from collections import Counter

    import torch

    ca, cb = Counter(a), Counter(b)
    cats = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= min_count]
    rows = [
        [ca[t] for t in cats] + [sum(v for t, v in ca.items() if t not in cats)],
        [cb[t] for t in cats] + [sum(v for t, v in cb.items() if t not in cats)],
    ]
    cols = [x + y for x, y in zip(*rows)]
    keep = [i for i, c in enumerate(cols) if c > 0]
    n_a, n_b, n = sum(rows[0]), sum(rows[1]), sum(cols)
    stat = 0.0
    for i in keep:
        for row, total in ((rows[0], n_a), (rows[1], n_b)):
            expected = cols[i] * total / n
            stat += (row[i] - expected) ** 2 / expected
    df = max(1, len(keep) - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_chi2_helper_detects_a_shift():
    import random

    rng = random.Random(0)
    same = [rng.choice("aabbc") for _ in range(2000)], [rng.choice("aabbc") for _ in range(2000)]
    assert chi2_homogeneity_pvalue(*same) > 1e-3
    shifted = [rng.choice("aabbc") for _ in range(2000)], [rng.choice("abbcc") for _ in range(2000)]
    assert chi2_homogeneity_pvalue(*shifted) < 1e-6


def test_sampling_with_speculation_matches_plain_sampling(tiny_merged):
    """Temperature 0.8: the 2nd and 3rd generated tokens (the ones that pass through
    rejection sampling with stream drafts: chains through vLLM's sampler, trees through the
    plugin's tree sampling) follow the same distribution as plain sampling. Two-sample
    chi-square tests at alpha = 1e-3 each: false-alarm rate <= 0.4% per run. Without the
    expand-kernel fix the temperatures are garbage and p is ~0."""
    n = 500
    plain = run_child("sample", ckpt=str(tiny_merged), k=0, n=n)[0]["tokens"]
    # One batch: n requests drafting trees and n asking for logprobs, drafting chains.
    spec = run_child(
        "sample", env=INSPECT_ENV, ckpt=str(tiny_merged), k=6, n=n, trees=True, fields=TREE_FIELDS
    )[0]
    assert spec["trees"]["tree_rows"] > n // 2  # the tree requests drafted trees
    for name in ("tokens", "chain_tokens"):
        for pos in (1, 2):
            p = chi2_homogeneity_pvalue([t[pos] for t in plain], [t[pos] for t in spec[name]])
            assert p > 1e-3, (name, pos, p)


def test_qwen2_base_is_served_losslessly(tiny_merged_qwen2):
    """A Qwen2 base (biased q/k/v) gets its own model class; greedy output is unchanged by
    speculation and the streams' drafts are accepted."""
    cfg = json.loads((tiny_merged_qwen2 / "config.json").read_text())
    assert cfg["specstream"]["base_architectures"] == ["Qwen2ForCausalLM"]
    requests = make_requests(12, seed=4)
    plain = run_engine(tiny_merged_qwen2, 0, {}, requests)
    spec = run_engine(tiny_merged_qwen2, 3, {}, requests)
    assert spec["tokens"] == plain["tokens"]
    assert spec["metrics"]["vllm:spec_decode_num_drafts"] > 0


def test_prompt_lookup_and_streams_at_tensor_parallel_3_equal_plain_decoding(
    demo, demo_runs, monkeypatch
):
    """The embedded model's 9 heads over 3 ranks (a 2-core machine, unbound), a trained
    checkpoint drafting chains by default: stream drafts and prompt-lookup drafts (SQL
    copies names from its schema) both verified; outputs equal one rank's plain decoding."""
    ckpt, requests = demo
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    tp3 = {"tensor_parallel_size": 3, "kv_cache_memory_bytes": 64 << 20}  # per rank
    spec = run_engine(ckpt, 4, tp3, requests)
    assert spec["tokens"] == demo_runs[0]["tokens"]
    assert spec["lookup_drafted"], "no step drafted by prompt lookup"
    metrics = spec["metrics"]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > metrics["vllm:spec_decode_num_drafts"]


def test_pipeline_parallel_2_speculates_as_plain_decoding(demo, demo_runs, monkeypatch):
    """PP 2 (multiprocessing executor, compiled: vLLM 0.32's CPU runner makes the pipeline's
    receiving buffers only when it warms up a compiled model), the trained demo checkpoint's
    8 MSA layers on the second rank: the residual stream entering them crosses the ranks in
    the intermediate tensors, the second rank drafts, one batch is in flight
    (``patches/pipeline_speculation.py``). Greedy output equals one rank's plain decoding,
    with drafts accepted."""
    ckpt, requests = demo
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    pp2 = {"enforce_eager": False, "pipeline_parallel_size": 2, "kv_cache_memory_bytes": 256 << 20}
    spec_pp2 = run_engine(ckpt, 4, pp2, requests)
    assert spec_pp2["tokens"] == demo_runs[0]["tokens"]
    metrics = spec_pp2["metrics"]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > metrics["vllm:spec_decode_num_drafts"]
