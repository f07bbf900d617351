"""vLLM multi-LoRA serving on CPU with the plugin loaded (real engines)."""

import pytest
from engine_child import run_child
from helpers import SAME_DRAFTS
from test_specstream_engine import _stash_rows_and_training_drafts

from vllm_specstream.training.checkpoint import load_merged

pytestmark = pytest.mark.engine

PROMPTS = [
    "Write a haiku about the sea.",
    "The three largest cities of France are",
    "def fibonacci(n):",
]
MAX_TOKENS = 12


def random_peft_adapter(
    model_dir, out, targets=("q_proj", "v_proj", "o_proj", "down_proj"), seed: int = 1
):
    """A rank-8 PEFT adapter of ``model_dir`` with random A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=list(targets), init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def random_adapter(base_model_dir, tmp_path_factory):
    """Random A and B on the attention projections (large enough to change greedy outputs)."""
    out = tmp_path_factory.mktemp("lora") / "random-adapter"
    return random_peft_adapter(base_model_dir, out, ("q_proj", "v_proj", "o_proj"), seed=0)


def test_requests_without_an_adapter_are_served_by_the_base_model(base_model_dir, random_adapter):
    # vLLM 0.32's CPU LoRA ops give a token without an adapter (index -1) the last slot's
    # adapter in batches that mix requests with and without one; patches/cpu_lora_ops.py
    # fixes that (and patches/cpu_lora_linear.py, which groups the linear layers' tokens by
    # adapter, skips them too). A plain engine gets the fixes only with
    # SPECSTREAM_VLLM_PATCHES=1; the run with both put back shows the test can fail.
    requests = [{"prompt": p, "max_tokens": MAX_TOKENS} for p in PROMPTS[1:]]
    base, _ = run_child(
        "generate", ckpt=str(base_model_dir), k=0, engine={"max_model_len": 512}, requests=requests
    )
    want = base["tokens"]
    got, _ = run_child(
        "lora_mixed",
        base=str(base_model_dir),
        adapter=str(random_adapter),
        prompts=PROMPTS,
        n=MAX_TOKENS,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "SPECSTREAM_VLLM_PATCHES": "1"},
    )
    patched, unpatched = got["patched"], got["unpatched"]
    assert patched["mixed"][1:] == want and patched["alone"] == want
    # vLLM's own ops: batched with an adapter's request, the base requests ran the adapter
    # (V1 always takes the prefill path, which skips LoRA for a batch without adapters).
    assert unpatched["mixed"][1] != want[0] and unpatched["mixed"][2] != want[1]
    assert unpatched["alone"] == want and unpatched["mixed"][0] == patched["mixed"][0]


SPEC_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "SELECT name FROM singer WHERE age > 30; SELECT name FROM singer WHERE",
    "one two three four five six seven eight nine ten eleven twelve",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
]


def test_specstream_under_multi_lora_is_lossless_in_mixed_batches(tiny_merged, tmp_path):
    # Each stream row takes its own request's adapter through the MSA layers
    # (model_executor/lora/vllm_lora_layers.py); the main rows stay vLLM's. Two adapters and base
    # requests in one batch: the streams must neither crash nor change an output.
    first = random_peft_adapter(tiny_merged, tmp_path / "a1")
    second = random_peft_adapter(tiny_merged, tmp_path / "a2", targets=("gate_proj", "up_proj"))
    loras = [str(first), None, str(second), str(first), None]
    # The last request is the first one's prompt without an adapter.
    requests = [
        {"prompt": p, "max_tokens": 24, "lora": lora}
        for p, lora in zip([*SPEC_PROMPTS, SPEC_PROMPTS[0]], loras)
    ]
    engine = {"max_model_len": 512, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    plain, _ = run_child("generate", ckpt=str(tiny_merged), k=0, engine=engine, requests=requests)
    spec, _ = run_child("generate", ckpt=str(tiny_merged), k=3, engine=engine, requests=requests)
    assert spec["tokens"] == plain["tokens"]
    assert spec["metrics"]["vllm:spec_decode_num_drafts"] > 0
    # the adapters are active: the same prompt with and without one decodes differently
    assert plain["tokens"][0] != plain["tokens"][4]


#: ``LLM.apply_model`` (the stash snapshot) sends a function to the engine process.
INSPECT = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def _deployment(base, adapters) -> dict:
    from vllm_specstream.checkpoint.deployment import plan_deployment

    plan = plan_deployment(base, {f"task{i}": str(a) for i, (a, _) in enumerate(adapters)})
    return {
        "max_model_len": 512,
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": plan.max_lora_rank,
        "hf_overrides": plan.overrides(),
    }


def assert_drafts_are_the_training_models(served: dict, model) -> None:
    """The streams' drafts in ``served`` (a ``lora_stash`` result) equal those of ``model``,
    the training implementation on the adapter's merged checkpoint, at every anchor."""
    rows = list(_stash_rows_and_training_drafts(model, served))
    assert rows, served["stash"]
    for row, want, _ in rows:
        assert row == want


def test_each_adapter_drafts_with_its_own_streams_on_a_base_deployment(
    tiny_adapters, plain_deployment_outputs
):
    # One base served for two specstream adapters (adapter_deployment): a request's drafts
    # come from its adapter's streams and LoRA, exactly as the training implementation
    # drafts on that adapter's merged checkpoint; a request without an adapter drafts
    # nothing (the base has no streams). Outputs are the deployment's without speculation.
    base, adapters = tiny_adapters
    engine = _deployment(base, adapters)
    mixed = _mixed_adapter_requests(adapters)[:3]  # adapter 1, none, adapter 2
    requests = [{**r, "max_tokens": 9} for r in mixed]
    served = run_child(
        "lora_stash",
        ckpt=str(base),
        k=3,
        engine={**engine, "fields": SAME_DRAFTS},
        requests=requests,
        env=INSPECT,
    )[0]
    for got, want in zip(served, plain_deployment_outputs["tokens"]):
        assert got["tokens"][0] == want[:9]
    for (_, merged), got in zip(adapters, (served[0], served[2])):
        assert_drafts_are_the_training_models(got, load_merged(merged))
    # the adapters' drafts differ (their own streams), and the base request has none
    assert served[0]["stash"]["table"] != served[2]["stash"]["table"]
    assert all(t < 0 for row in served[1]["stash"]["table"] for t in row)


def _mixed_adapter_requests(adapters) -> list[dict]:
    first, second = (str(a) for a, _ in adapters)
    return [
        {"prompt": p, "max_tokens": 24, "lora": lora}
        for p, lora in zip(SPEC_PROMPTS, [first, None, second, first])
    ]


@pytest.fixture(scope="module")
def plain_deployment_outputs(tiny_adapters) -> dict:
    """The mixed-adapter batch served without speculation (the outputs do not depend on
    the number of LoRA slots)."""
    base, adapters = tiny_adapters
    engine = {**_deployment(base, adapters), "max_cpu_loras": 2}
    requests = _mixed_adapter_requests(adapters)
    return run_child("generate", ckpt=str(base), k=0, engine=engine, requests=requests)[0]


def test_a_base_deployment_is_lossless_when_adapters_share_one_slot(
    tiny_adapters, plain_deployment_outputs
):
    # max_loras=1: fewer slots than adapters, so the adapters take turns in the one slot
    # (vLLM's LRU) between steps; each request must still draft with its own streams. (Two
    # adapters in one step: test_each_adapter_drafts_with_its_own_streams_on_a_base_deployment.)
    base, adapters = tiny_adapters
    engine = {**_deployment(base, adapters), "max_loras": 1, "max_cpu_loras": 2}
    requests = _mixed_adapter_requests(adapters)
    plain = plain_deployment_outputs
    spec, _ = run_child("generate", ckpt=str(base), k=3, engine=engine, requests=requests)
    assert spec["tokens"] == plain["tokens"]
    steps = [m["num_spec_steps"] if m else 0 for m in spec["per_request"]]
    assert steps[0] > 0 and steps[2] > 0 and steps[3] > 0 and steps[1] == 0, steps


@pytest.mark.parametrize("placement", ["window", "accepted"])
def test_adapter_streams_under_tensor_parallelism_equal_one_rank(
    tiny_merged_tp3, tmp_path, placement
):
    # TP 3: o_proj and down_proj are row-parallel, their LoRA deltas partial sums added before
    # the all-reduce (vllm_lora_layers.py); stream rows must follow, or their drafts (not the
    # outputs: verification keeps those right) would differ from one rank's.
    from conftest import make_tiny_adapter

    from vllm_specstream.training.reference_decoder import plain_greedy

    base = tiny_merged_tp3.with_name(tiny_merged_tp3.name + "-base")
    adapters = [make_tiny_adapter(base, tmp_path / "tp3-task", seed=20)]
    engine = {**_deployment(base, adapters), "placement": placement}
    prompt = {"max_tokens": 9, "lora": str(adapters[0][0])}
    requests = [{**prompt, "prompt": p} for p in SPEC_PROMPTS[:2]]
    tp3 = run_child(
        "lora_stash",
        ckpt=str(base),
        k=3,
        engine={**engine, "tensor_parallel_size": 3, "kv_cache_memory_bytes": 64 << 20},
        requests=requests,
        env={**INSPECT, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},  # 3 ranks on 2 cores
    )[0]
    # One rank's answer is the training implementation's on the adapter merged: greedy
    # tokens, and the drafts at every anchor of each request's last forward.
    model = load_merged(adapters[0][1])
    for got in tp3:
        prompt, tokens = got["prompt_ids"][0], got["tokens"][0]
        assert plain_greedy(model, prompt, len(tokens), eos_token_id=-1) == tokens
        assert_drafts_are_the_training_models(got, model)
