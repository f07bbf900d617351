"""EAGLE-3 drafters in vLLM 0.32: its loader takes every weight we write, a drafter trained
by `specstream train --objective eagle3` serves losslessly with vLLM's eagle3 method, and the
committed E2E drafter (the results' peer baseline) does on its adapter merged."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from engine_child import run_child
from helpers import E2E_ADAPTER, E2E_EAGLE3, REPO, meaning_representations, run_python, venv_script

#: Builds vLLM's own ``Eagle3LlamaForCausalLM`` (no engine) for a tiny target and drafters we
#: save, fills its parameters with NaN, loads the drafter's file with vLLM's ``load_weights``
#: and reports what it did: parameters left unloaded, the stacked projections, ``d2t``, the
#: norm flags vLLM read, and ``fc``/logits against ours.
LOADER_CHECK = r"""
import json, sys, tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, "training")
from tiny import tiny_llama

from vllm_specstream.training.eagle3 import Eagle3Config, Eagle3Drafter


def check(target, drafter_dir, drafter):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    spec = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": 2}
    config = EngineArgs(
        model=str(target), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        max_model_len=128, speculative_config=spec,
    ).create_engine_config()
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():
            init_distributed_environment(1, 0, "tcp://127.0.0.1:0", 0, "gloo")
            initialize_model_parallel(1, 1)
        model = Eagle3LlamaForCausalLM(vllm_config=config)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan")) if p.is_floating_point() else p.fill_(-1)
        model.load_weights(load_file(str(drafter_dir / "model.safetensors")).items())
        ours = drafter.trainable()
        layer = model.model.layers[0]
        qkv = torch.cat([ours[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"])
        gate_up = torch.cat([ours[f"midlayer.mlp.{x}_proj.weight"] for x in ("gate", "up")])
        stacked = {
            "qkv": torch.equal(layer.self_attn.qkv_proj.weight, qkv),
            "gate_up": torch.equal(layer.mlp.gate_up_proj.weight, gate_up),
        }
        draft_config = config.speculative_config.draft_model_config
        process_weights_after_loading(model, draft_config, torch.device("cpu"))
        unloaded = sorted(
            n for n, p in model.named_parameters() if p.is_floating_point() and p.isnan().any()
        )
        torch.manual_seed(0)
        aux = torch.randn(5, drafter.fc.in_features)
        hidden = torch.randn(5, drafter.fc.out_features)
        with torch.no_grad():
            fused = model.combine_hidden_states(aux)
            want = drafter.fc(drafter.input_norm(aux) if drafter.settings.norm_before_fc else aux)
            logits = model.compute_logits(hidden)
            ours_logits = drafter.lm_head(hidden)
        outside = torch.ones(logits.shape[1], dtype=torch.bool)
        outside[drafter.draft_ids] = False
    return {
        "unloaded": unloaded,
        "stacked": stacked,
        "d2t": (torch.arange(len(drafter.draft_ids)) + model.draft_id_to_target_id).tolist()
        == drafter.draft_ids.tolist(),
        "fc": float((fused - want).abs().max()),
        "logits": float((logits[:, drafter.draft_ids] - ours_logits).abs().max()),
        "outside_is_minus_inf": bool(torch.isneginf(logits[:, outside]).all()),
        "aux_layers": list(config.speculative_config.draft_model_config.hf_config.eagle_config[
            "eagle_aux_hidden_state_layer_ids"]),
        "norm_before_residual": layer._residual_norm == layer._norm_before_residual,
        "norm_before_fc": model.model.norm_before_fc,
        "norm_output": model.model.norm_output,
        "fc_norm": model.model.fc_norm is not None,
    }


tmp = Path(tempfile.mkdtemp())
lm = tiny_llama(layers=4, vocab=128)
lm.config.architectures = ["LlamaForCausalLM"]
lm.save_pretrained(tmp / "target")
results = {}
all_flags = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
for name, flags in (("default", {}), ("flags", all_flags)):
    settings = Eagle3Config(draft_vocab_size=48, **flags)
    drafter = Eagle3Drafter(lm, settings, torch.arange(0, 96, 2))
    with torch.no_grad():
        for p in drafter.trainable().values():
            p.normal_(0, 0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    drafter.save(tmp / name)
    results[name] = check(tmp / "target", tmp / name, drafter)
print("RESULT " + json.dumps(results))
"""


def test_vllms_eagle3_loader_takes_every_weight_of_our_drafter():
    """vLLM's own model class and loader (not our reading of them): every parameter but the
    token embedding (shared with the target) is loaded from our file, q/k/v and gate/up
    stacked in vLLM's order, ``d2t`` mapped, and the norm flags we wrote are those vLLM runs."""
    out = run_python(LOADER_CHECK)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line[len("RESULT ") :])
    for name, r in results.items():
        assert r["unloaded"] == ["model.embed_tokens.weight"], (name, r)
        assert r["stacked"] == {"qkv": True, "gate_up": True}, (name, r)
        assert r["d2t"] and r["outside_is_minus_inf"], (name, r)
        assert r["fc"] < 1e-4 and r["logits"] < 1e-4, (name, r)
        assert r["aux_layers"] == [1, 2] and r["fc_norm"] is False, (name, r)
        flags = name == "flags"
        assert (r["norm_before_residual"], r["norm_before_fc"], r["norm_output"]) == (flags,) * 3


def test_bench_serves_the_drafter_with_vllms_eagle3_method(tmp_path):
    import torch
    from safetensors.torch import save_file

    from vllm_specstream.bench.bench import BenchConfig, extra_params, speculative_config_for

    ckpt, drafter = tmp_path / "ckpt", tmp_path / "drafter"
    for d in (ckpt, drafter):
        d.mkdir()
        (d / "config.json").write_text("{}")
    tensors = {"fc.weight": torch.zeros(4, 12), "d2t": torch.zeros(8, dtype=torch.long)}
    save_file(tensors, str(drafter / "model.safetensors"))
    with pytest.raises(ValueError, match="--eagle3"):
        BenchConfig(checkpoint=str(ckpt), methods=("eagle3",))
    cfg = BenchConfig(checkpoint=str(ckpt), eagle3=str(drafter), num_speculative_tokens=3)
    assert "eagle3" in cfg.methods
    assert "eagle3" not in BenchConfig(checkpoint=str(ckpt)).methods
    assert speculative_config_for("eagle3", cfg) == {
        "method": "eagle3",
        "model": str(drafter),
        "num_speculative_tokens": 3,
    }
    assert extra_params("eagle3", cfg) == 48  # the index maps are not parameters


#: The engine side of the serving test: greedy outputs with and without the drafter, and
#: vLLM's speculation counters.
SERVE = r"""
import json, sys
sys.path.insert(0, "vllm")
from engine_child import _llm, _metrics
from vllm import SamplingParams

args = ARGS
engine = {"max_model_len": 512, "disable_log_stats": False}
if args["drafter"]:
    engine["speculative_config"] = {
        "method": "eagle3", "model": args["drafter"], "num_speculative_tokens": args["k"],
    }
llm = _llm(args["base"], **engine)
params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"])
outs = llm.generate(args["prompts"], params, use_tqdm=False)
print("RESULT " + json.dumps({
    "tokens": [list(o.outputs[0].token_ids) for o in outs],
    "metrics": _metrics(llm, "spec_decode"),
}))
"""

QUESTIONS = [
    "What is 2 + 2?",
    "Name a colour.",
    "Write one short sentence about the sea.",
    "Count from 1 to 6.",
    "What is the capital of France?",
    "List three fruits.",
    "Say hello in French.",
    "What day comes after Monday?",
]


def _trained_drafter(base: Path, tmp_path: Path) -> Path:
    """A drafter trained for a few steps on ``base`` (`specstream train --objective eagle3`)."""
    for name, part in (("train", QUESTIONS[:6]), ("eval", QUESTIONS[6:])):
        rows = [{"prompt": q, "completion": "I do not know."} for q in part]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "drafter"
    cmd = [venv_script("specstream"), "train", "--objective", "eagle3"]
    cmd += ["--base", str(base), "--out", str(out)]
    cmd += ["--data", str(tmp_path / "train.jsonl"), "--eval-data", str(tmp_path / "eval.jsonl")]
    cmd += ["--steps", "2", "--batch-size", "2", "--max-length", "96", "--dtype", "fp32"]
    cmd += ["--draft-vocab-size", "1024", "--ttt-steps", "2", "--eval-every", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (out / "model.safetensors").is_file()
    return out


def _serve_with_and_without(model: Path, drafter: Path, prompts: list[str], k: int = 3) -> dict:
    """Greedy outputs of ``model`` served plainly and with vLLM's eagle3 method."""
    runs = {}
    for name, path in (("plain", None), ("eagle3", str(drafter))):
        args = {"base": str(model), "drafter": path, "prompts": prompts, "k": k}
        code = SERVE.replace("ARGS", repr({**args, "max_tokens": 48}))
        runs[name], _ = run_child("python", code=code, cwd=str(REPO / "tests"))
    return runs


def _tokens_per_step(metrics: dict) -> float:
    drafts = metrics.get("vllm:spec_decode_num_drafts", 0)
    return 1 + metrics.get("vllm:spec_decode_num_accepted_tokens", 0) / max(drafts, 1)


@pytest.mark.engine
@pytest.mark.model
def test_a_trained_drafter_serves_losslessly_with_vllms_eagle3_method(base_model_dir, tmp_path):
    """A drafter trained for a few steps on the embedded model, served by vLLM's eagle3
    method: greedy outputs token-identical to plain decoding of the same model, and drafts
    made."""
    drafter = _trained_drafter(base_model_dir, tmp_path)
    prompts = ["The capital of France is", "def fibonacci(n):\n", QUESTIONS[3]]
    runs = _serve_with_and_without(base_model_dir, drafter, prompts)
    assert runs["eagle3"]["tokens"] == runs["plain"]["tokens"]
    assert runs["eagle3"]["metrics"].get("vllm:spec_decode_num_drafts", 0) > 0, runs["eagle3"]


@pytest.mark.engine
@pytest.mark.model
def test_the_committed_e2e_drafter_serves_its_adapter_losslessly(tmp_path):
    """The committed EAGLE-3 drafter of the E2E adapter (the peer baseline of the results),
    served by vLLM's eagle3 method on that adapter merged (its streams idle: the model hands
    vLLM the auxiliary states vLLM asks for): greedy outputs equal plain decoding's, and the
    trained drafter's drafts are accepted (tokens per step well above chance)."""
    import torch
    from transformers import AutoTokenizer

    from vllm_specstream.training.checkpoint import export_merged
    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks.public import e2e_prompt

    merged = export_merged(E2E_ADAPTER, tmp_path / "merged", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(merged)
    prompts = [
        prompt_text(tok, [{"role": "user", "content": e2e_prompt(mr)}])
        for mr in meaning_representations(6, seed=1)
    ]
    runs = _serve_with_and_without(merged, E2E_EAGLE3, prompts, k=4)
    assert runs["eagle3"]["tokens"] == runs["plain"]["tokens"]
    # made-up MRs (no dataset rows): 2.5 tokens per step here, 4.5 on the development file
    assert _tokens_per_step(runs["eagle3"]["metrics"]) > 2.0, runs["eagle3"]["metrics"]
