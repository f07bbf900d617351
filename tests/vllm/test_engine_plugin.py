"""The plugin inside real vLLM engines, on the embedded model."""

import json

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.model]

PROMPTS = [
    "Write a SQL query that counts the rows of the table orders.",
    "What is the capital of France?",
    "def fibonacci(n):",
]
MAX_TOKENS = 24

ENGINE_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm_specstream.cpu_env import cpu_engine_kwargs

def main():
    model, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=model, **cpu_engine_kwargs(dtype="float32", max_model_len=512))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
    import vllm_specstream.plugin
    # One write per line: vLLM's threads log to the same stdout while the main thread prints.
    sys.stdout.write(f"FRONTEND_REGISTERED {vllm_specstream.plugin._registered}\\n")
    sys.stdout.write("TOKENS " + json.dumps([list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                                             for o in outs]) + "\\n")
    sys.stdout.flush()

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def engine_run(base_model_dir, tmp_path_factory):
    script = tmp_path_factory.mktemp("engine") / "engine_run.py"
    script.write_text(ENGINE_SCRIPT)
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(script), str(base_model_dir), json.dumps(PROMPTS), str(MAX_TOKENS)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**__import__("os").environ, "VLLM_LOGGING_LEVEL": "DEBUG"},
    )
    assert out.returncode == 0, out.stderr[-5000:]
    return out


def test_register_runs_in_engine_core_and_worker(engine_run):
    log = engine_run.stdout + engine_run.stderr
    lines = [line for line in log.splitlines() if "vllm-specstream registered with vLLM" in line]
    processes = {line.split(" pid=")[0].lstrip("(") for line in lines if " pid=" in line}
    # The engine core and the worker log it (vLLM configures logging there before plugins
    # load); the front-end registers before its logging is configured, so ask it directly.
    for process in ("EngineCore", "Worker"):
        assert any(process in p for p in processes), (process, lines)
    assert "FRONTEND_REGISTERED True" in engine_run.stdout
    assert any("SpecStreamForCausalLM" in line for line in lines)
    assert "Failed to load plugin" not in log


def test_greedy_matches_transformers(engine_run, base_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    line = next(x for x in engine_run.stdout.splitlines() if x.startswith("TOKENS "))
    vllm_ids = json.loads(line[len("TOKENS ") :])
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
