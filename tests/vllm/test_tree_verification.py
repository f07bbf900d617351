"""Draft trees verified inside vLLM (field ``tree_top_k``): lossless on real engines,
the accepted path's keys/values where vLLM keeps them, acceptance as the reference decoder's;
on the same adapter, a window engine's chains as the adaptive policy drafts them. (Trees with chunked prefill, preemption and a short ``max_model_len``: the "tree" runs of
``test_specstream_engine.py``.)"""

import pytest
from helpers import E2E_ADAPTER, SAME_DRAFTS, meaning_representations
from test_specstream_engine import run_engine

from vllm_specstream.speculation.settings import SCHEDULE_OPTION as SCHEDULE

pytestmark = [pytest.mark.engine, pytest.mark.model]

#: Two candidates per stream, 8 nodes: the top-1 chain of 4 and the 4 likeliest others.
TOP_K, NODES = 2, 8
TREES = {"tree_top_k": TOP_K}
#: The tests read the worker's tree counters (``LLM.apply_model``).
INSPECT_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
# The runs whose acceptance is compared with the reference decoder's compute their drafts
# in the served fp32 (SAME_DRAFTS): with bf16 copies an Intel AMX CPU read +5.6% tokens per
# step over these 6 requests; in fp32 every request's equal. The "widths" run keeps the
# default, so the bf16 or int8 stream pass stays under the lossless check.
#: Early-exit pruning (the adapter's trained pruning head) at a threshold that prunes some
#: nodes of most trees and keeps others.
PRUNE = 0.01


@pytest.fixture(scope="module")
def e2e(base_model_dir, tmp_path_factory):
    """The committed E2E adapter merged (fp32), 12 prompts (every fourth asks for logprobs,
    which read drafts as a chain: those requests draft chains beside the trees) and the
    same served plainly."""
    import torch
    from transformers import AutoTokenizer

    from vllm_specstream.training.checkpoint import export_merged
    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks.public import e2e_prompt

    tmp = tmp_path_factory.mktemp("tree")
    ckpt = export_merged(E2E_ADAPTER, tmp / "merged", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(ckpt)
    requests = [
        {"prompt": prompt_text(tok, [{"role": "user", "content": e2e_prompt(mr)}])}
        | {"max_tokens": 64}
        | ({"logprobs": 0} if i % 4 == 3 else {})
        for i, mr in enumerate(meaning_representations(12))
    ]
    # Blocks of 32 tokens: prompt and output fill some, so the follow-up requests read back
    # from the prefix cache what the first ones wrote.
    engine = {"block_size": 32}
    plain = run_engine(ckpt, 0, engine, requests, follow_up=8)
    runs = {
        "tree": run_engine(
            ckpt,
            NODES,
            engine,
            requests,
            env=INSPECT_ENV,
            fields=TREES | SAME_DRAFTS | {"tree_prune": "off"},
            trees=True,
            follow_up=8,
        ),
        # pruned, with prefill chunks of other requests in the tree steps' batches
        "pruned": run_engine(
            ckpt,
            NODES,
            engine | {"max_num_batched_tokens": 64},
            requests,
            env=INSPECT_ENV,
            fields=TREES | SAME_DRAFTS | {"tree_prune": PRUNE},
            trees=True,
            follow_up=8,
        ),
        # the tree's width by batch size (a schedule: its first six nodes while all twelve
        # requests run, the whole tree once one has finished; a split that does not hang
        # on how many steps the last few requests run alone), pruned at the checkpoint's
        # threshold: trees the proposer cut to a prefix of the template, pruned again
        "widths": run_engine(
            ckpt,
            NODES,
            engine,
            requests,
            env=INSPECT_ENV,
            fields=TREES,
            trees=True,
            spec_options={SCHEDULE: [(1, 11, NODES), (12, 64, 6)]},
        ),
        # chains (no trees) in a window engine, as the adaptive policy drafts them
        "policy": run_engine(ckpt, 4, engine, requests, placement="window", adaptive=True),
    }
    return ckpt, tok, requests, plain, runs


def test_window_engine_policy_drafts_losslessly(e2e):
    # The adaptive policy of a window engine on the E2E adapter's acceptance: as the 12
    # requests finish the batch size changes, and drafting steps after plain ones run their
    # streams at the anchors; the outputs equal plain decoding's.
    _, _, _, plain, runs = e2e
    run = runs["policy"]
    assert run["tokens"] == plain["tokens"]
    assert run["metrics"]["vllm:spec_decode_num_drafts"] > 0, run["metrics"]


@pytest.mark.parametrize("kind", ["tree", "pruned"])
def test_trees_are_lossless_and_leave_the_accepted_path_in_the_cache(e2e, kind):
    _, _, _, plain, runs = e2e
    tree = runs[kind]
    assert tree["tokens"] == plain["tokens"]
    stats = tree["trees"]
    # Trees were verified and some accepted paths left the top-1 chain; their keys/values
    # were moved into the slots vLLM keeps. Without the move the outputs differ, and the
    # follow-ups (each prompt and output again, from the prefix cache) see other logprobs.
    assert stats["tree_rows"] > 20 and stats["off_chain_rows"] > 0, stats
    # (A block that a request's last speculative step filled may stay out of vLLM's prefix
    # cache, so the follow-ups may read a block or two fewer than plain decoding's.)
    assert 0.8 * plain["cached_tokens"] <= tree["cached_tokens"] <= plain["cached_tokens"]
    for want, got in zip(plain["follow_up"], tree["follow_up"]):
        assert got == pytest.approx(want, abs=1e-3)
    if kind == "pruned":
        # The layers above the pruning layer ran without some nodes of most trees: those
        # nodes were never accepted (their rows there hold nothing), the kept ones' keys and
        # values were written at their own slots in every layer.
        assert 0.1 < stats["nodes_pruned"] / stats["nodes_at_pruning"] < 0.9, stats
    else:
        assert stats["nodes_pruned"] == 0, stats


@pytest.mark.parametrize("kind", ["tree", "pruned"])
def test_tree_acceptance_equals_the_reference_decoders(e2e, kind):
    # The same tree (8 nodes, top-2; pruned as in vLLM or not) decoded by the training
    # side's reference decoder on the same prompts (the tree requests only), drafts in fp32
    # on both sides: vLLM's tokens per step within 5% (oneDNN's fp32 GEMMs and PyTorch's
    # may still round a near-tie of two draft candidates apart).
    import torch

    from vllm_specstream.training.evaluate import load_any
    from vllm_specstream.training.reference_decoder import speculative_generate

    ckpt, tok, requests, _, runs = e2e
    tree = runs[kind]
    model = load_any(ckpt).eval().to(torch.float32)
    tokens = steps = ref_tokens = ref_steps = 0
    for req, got, metrics in list(zip(requests, tree["tokens"], tree["per_request"]))[:8]:
        if "logprobs" in req:
            continue
        prompt = tok(req["prompt"], add_special_tokens=False).input_ids
        ref = speculative_generate(
            model,
            prompt,
            64,
            tok.eos_token_id,
            top_k=TOP_K,
            max_nodes=NODES,
            prune_threshold=PRUNE if kind == "pruned" else 0.0,
        )
        assert ref.tokens == got
        ref_tokens, ref_steps = ref_tokens + len(ref.tokens) - 1, ref_steps + ref.steps
        # generated tokens per decode forward, the reference's measure (vLLM's accepted
        # counts also hold drafts accepted past the end, which the output drops)
        tokens, steps = tokens + len(got) - 1, steps + metrics["num_spec_steps"]
    assert tokens / steps == pytest.approx(ref_tokens / ref_steps, rel=0.05)


def test_tree_widths_chosen_per_step_are_lossless(e2e):
    # Each step's trees as wide as the schedule says for its batch size (12 requests at
    # first, fewer as they finish), pruned by the early-exit head: the outputs equal plain
    # decoding's, and both widths were verified.
    _, _, _, plain, runs = e2e
    widths = runs["widths"]
    assert widths["tokens"] == plain["tokens"]
    stats = widths["trees"]
    by_nodes = {int(n): rows for n, rows in stats["tree_rows_by_nodes"].items()}
    assert set(by_nodes) == {6, NODES} and min(by_nodes.values()) > 10, stats
    assert stats["nodes_pruned"] > 0 and stats["off_chain_rows"] > 0, stats


def test_trees_and_stream_lora_at_tensor_parallel_3_equal_plain_decoding(e2e, monkeypatch):
    # The embedded model's 9 heads (3 KV heads) over 3 ranks (on a 2-core machine, unbound):
    # each rank runs its shard of the stream LoRA (rows of B where the output is sharded, the
    # A x of sharded inputs summed over ranks), verifies the tree rows on its heads and
    # moves the keys/values of accepted nodes off the chain in its own cache.
    ckpt, _, requests, plain, _ = e2e
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    tp3 = {"block_size": 32, "tensor_parallel_size": 3, "kv_cache_memory_bytes": 64 << 20}
    tree = run_engine(
        ckpt, NODES, tp3, requests, env=INSPECT_ENV, fields=TREES | SAME_DRAFTS, trees=True
    )
    assert tree["tokens"] == plain["tokens"]
    stats = tree["trees"]
    assert stats["tree_rows"] > 20 and stats["off_chain_rows"] > 0, stats
    metrics = tree["metrics"]
    tokens_per_step = 1 + (
        metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_drafts"]
    )
    assert tokens_per_step > 2.5, metrics  # the stream LoRA's drafts, not noise


@pytest.fixture(scope="module")
def compiled(e2e):
    """The same requests with trees at every step in vLLM's default compiled mode, beside
    the plain engine of :func:`e2e` (eager: a second, compiled plain engine would double the
    cost of this fixture; the compiled pipeline-parallel test also compares with eager plain
    decoding). The stream pass in the model's dtype, as on a CPU without native bf16 (AVX2,
    AVX-512 without bf16) on every CPU: the adapter's stream LoRA then stays unmerged and the
    pass runs eagerly beside the compiled decoder (the compiled pass:
    test_compiled_streams.py)."""
    ckpt, _, requests, plain, _ = e2e
    engine = {"block_size": 32, "enforce_eager": False}
    fields = TREES | SAME_DRAFTS
    tree = run_engine(ckpt, NODES, engine, requests, env=INSPECT_ENV, fields=fields, trees=True)
    return plain, tree


def test_trees_are_lossless_in_a_compiled_engine(compiled):
    # The decoder runs as vLLM's graphs, which call the attention (where the node rows are
    # redone) outside them; rotary positions by depth go in as the graphs' input, and the
    # streams run at the deepest accepted node through the compiled stream pass.
    plain, tree = compiled
    assert tree["tokens"] == plain["tokens"]
    stats = tree["trees"]
    assert stats["tree_rows"] > 20 and stats["off_chain_rows"] > 0, stats
    # Nothing compiled while serving beyond what plain decoding compiles (vLLM compiles its
    # logprob ranks at the first request that asks for logprobs, eager or compiled).
    assert tree["graphs_compiled_serving"] == plain["graphs_compiled_serving"]
