"""vLLM multi-LoRA serving on CPU with the plugin loaded (real engines)."""

import pytest
from engine_child import run_child

pytestmark = pytest.mark.engine

PROMPTS = [
    "Write a haiku about the sea.",
    "The three largest cities of France are",
    "def fibonacci(n):",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def random_adapter(base_model_dir, tmp_path_factory):
    """A rank-8 PEFT adapter with random A and B (large enough to change greedy outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_model_dir, torch_dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    out = tmp_path_factory.mktemp("lora") / "random-adapter"
    get_peft_model(model, config).save_pretrained(out)
    return out


def test_requests_without_an_adapter_are_served_by_the_base_model(base_model_dir, random_adapter):
    # vLLM 0.32's CPU LoRA ops give a token without an adapter (index -1) the last slot's
    # adapter in batches that mix requests with and without one; patches/cpu_lora_ops.py
    # fixes that. The unpatched run shows the test can fail.
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
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    patched, unpatched = got["patched"], got["unpatched"]
    assert patched["mixed"][1:] == want and patched["alone"] == want
    # vLLM's own ops: batched with an adapter's request, the base requests ran the adapter
    # (V1 always takes the prefill path, which skips LoRA for a batch without adapters).
    assert unpatched["mixed"][1] != want[0] and unpatched["mixed"][2] != want[1]
    assert unpatched["alone"] == want and unpatched["mixed"][0] == patched["mixed"][0]
