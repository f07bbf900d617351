"""The plugin inside real vLLM engines, on the embedded model."""

import pytest
from engine_child import run_child

from vllm_specstream.machine import cpu_info

pytestmark = [pytest.mark.engine, pytest.mark.model]

PROMPTS = [
    "Write a SQL query that counts the rows of the table orders.",
    "What is the capital of France?",
    "def fibonacci(n):",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine_run(base_model_dir):
    return run_child(
        "plain_run",
        env={"VLLM_LOGGING_LEVEL": "DEBUG"},
        processes=True,  # the user's process layout: the plugin registers in each
        model=str(base_model_dir),
        prompts=PROMPTS,
        n=MAX_TOKENS,
    )


def test_register_runs_in_engine_core_and_worker(engine_run):
    result, out = engine_run
    log = out.stdout + out.stderr
    lines = [line for line in log.splitlines() if "vllm-specstream registered with vLLM" in line]
    processes = {line.split(" pid=")[0].lstrip("(") for line in lines if " pid=" in line}
    # The engine core and the worker log it (vLLM configures logging there before plugins
    # load); the front-end registers before its logging is configured, so ask it directly.
    for process in ("EngineCore", "Worker"):
        assert any(process in p for p in processes), (process, lines)
    assert result["frontend_registered"] is True
    assert any("SpecStreamForCausalLM" in line for line in lines)
    assert "Failed to load plugin" not in log


def test_a_plain_engine_is_left_as_vllm_makes_it(engine_run):
    # The plugin's fixes of vLLM are for specstream engines (patches/engine_scope.py): in a
    # plain engine's processes only the two front-end hooks are installed.
    log = engine_run[1].stdout + engine_run[1].stderr
    lines = [line for line in log.splitlines() if "vllm-specstream registered with" in line]
    assert len(lines) >= 2, lines  # the engine core and the worker
    for line in lines:
        assert line.endswith("patches: engine-config-check, spec-model-alias)"), line


def test_greedy_matches_transformers(engine_run, base_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vllm_ids = engine_run[0]["tokens"]
    tok = AutoTokenizer.from_pretrained(base_model_dir)
    model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    for prompt, ids in zip(PROMPTS, vllm_ids):
        enc = tok(prompt, return_tensors="pt")
        n_prompt = enc.input_ids.shape[1]
        assert ids[:n_prompt] == enc.input_ids[0].tolist()
        hf = model.generate(
            **enc,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
        assert hf[0].tolist() == ids, prompt


@pytest.mark.skipif(
    "amx_tile" not in cpu_info()[1],
    reason="needs a CPU with AMX tiles (vLLM takes AMX kernels for bf16 there)",
)
def test_bf16_engine_runs_with_onednn_capped_below_amx(base_model_dir):
    # vLLM picks its AMX kernels from the CPU's flags; with oneDNN capped below AMX they
    # cannot run, and the worker died at its first step (patches/onednn_amx_cap.py).
    result, out = run_child(
        "plain_run",
        env={
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "VLLM_LOGGING_LEVEL": "DEBUG",
            "SPECSTREAM_VLLM_PATCHES": "1",
        },
        check=False,
        processes=True,  # the user's process layout: the worker must be patched too
        model=str(base_model_dir),
        prompts=PROMPTS[:2],
        n=8,
        dtype="bfloat16",
    )
    assert out.returncode == 0 and result is not None, out.stderr[-3000:]
    assert len(result["tokens"]) == 2  # both requests served: prompt and output tokens
    log = out.stdout + out.stderr
    patched = [line for line in log.splitlines() if "keeps oneDNN off AMX" in line]
    assert any("Worker" in line for line in patched), patched
