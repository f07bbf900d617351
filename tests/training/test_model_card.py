import json

from vllm_specstream.checkpoint.config import SpecStreamConfig
from vllm_specstream.training.model_card import main


def test_card_has_the_three_models_and_vllm_rows(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    args = {
        "base": "/x/SmolLM2-135M-Instruct",
        "task": "e2e",
        "data": "devset.csv",
        "objective": "specstream",
        "spec": SpecStreamConfig(num_streams=4, num_msa_layers=15).to_dict(),
        "lora": {"rank": 32, "layers": "msa", "target_modules": ["q_proj"]},
        "steps": 300,
        "batch_size": 8,
        "grad_accum": 1,
        "lr": 5e-4,
        "stream_lr": 2e-2,
    }
    (adapter / "train_args.json").write_text(json.dumps(args))
    SpecStreamConfig(num_streams=4, num_msa_layers=15, suffix_drafts="on").save(adapter)
    # two resumed segments: 100 s + 200 s
    log = [{"elapsed_s": 50.0}, {"elapsed_s": 100.0}, {"elapsed_s": 20.0}, {"elapsed_s": 200.0}]
    (adapter / "train_log.jsonl").write_text("\n".join(json.dumps(x) for x in log))
    data = {"file": "devset.csv", "split": "val", "val_fraction": 0.15, "split_seed": 0}
    result = {
        "num_prompts": 82,
        "tokens_per_step": {"chain": 2.9, "tree": 3.3, "tree_top_k": 2},
        "rouge1": 70.12,
        "rougeLsum": 60.5,
        "extra_params": 39168,
        "chain_tree_identical": True,
        "data": data,
    }
    baseline = {**result, "rouge1": 70.9, "rougeLsum": 61.0}
    row = {"temperature": 0.0, "batch_size": 1, "lossless": True}
    bench = {
        "machine": "AMD EPYC, 2 cores",
        "setting": "32 prompts",
        "rows": [
            {**row, "method": "plain", "tokens_per_step": 1.0, "speedup": 1.0, "extra_params": 0},
            {**row, "method": "medusa", "tokens_per_step": 1.8, "speedup": 1.2, "extra_params": 9},
            {
                **row,
                "batch_size": 4,
                "method": "medusa",
                "tokens_per_step": 1.8,
                "speedup": 1.1,
                "extra_params": 9,
            },
        ],
    }
    files = {"eval.json": result, "ntp.json": baseline, "bench.json": bench}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    main(
        [
            str(adapter),
            "--eval",
            str(tmp_path / "eval.json"),
            "--baseline",
            str(tmp_path / "ntp.json"),
            "--bench",
            str(tmp_path / "bench.json"),
            "--command",
            "cmd",
        ]
    )
    card = (adapter / "README.md").read_text()
    assert "| rouge1 (%) | 70.1 |" in card
    assert "| rouge1 of the ntp baseline, same budget (%) | 70.9 |" in card
    assert "| tokens_per_step, chain (reference decoder) | 2.90 |" in card
    assert "| medusa | 1.80 | 1.20x | yes | 9 |" in card
    assert card.count("| medusa |") == 1  # batch 1 only
    assert "5 min of training" in card  # 300 s over two segments
    assert "cut by group, val_fraction 0.15, seed 0" in card
    assert "| tokens_per_step, tree (top-2) | 3.30 |" in card
    assert "identical outputs: True" in card
    assert "| suffix drafts beside the streams (serving default) | on |\n| wall time |" in card
    # A chain-only eval (--tree-top-k 0) has no tree row and says so.
    chain_only = {**result, "tokens_per_step": {"chain": 2.9, "tree": None, "tree_top_k": 0}}
    (tmp_path / "eval.json").write_text(json.dumps(chain_only))
    main([str(adapter), "--eval", str(tmp_path / "eval.json"), "--command", "cmd"])
    card = (adapter / "README.md").read_text()
    assert "tokens_per_step, tree" not in card and "Chain decoding only" in card
    assert "| learning rates | LoRA 0.0005, stream embeddings 0.02 |" in card
    # A run with the main LoRA frozen (--lora-lr 0) says so.
    (adapter / "train_args.json").write_text(json.dumps({**args, "lora_lr": 0.0}))
    main([str(adapter), "--eval", str(tmp_path / "eval.json"), "--command", "cmd"])
    card = (adapter / "README.md").read_text()
    assert "| learning rates | main LoRA frozen, stream init adapter 0.0005, stream " in card
    # A run that wrote train_state.json: the data it saw and each process that trained it.
    state = {
        "step": 300,
        "steps": 500,
        "examples_seen": 2400,
        "distinct_examples": 2400,
        "train_examples": 42061,
        "distinct_prompts": 1900,
        "train_prompts": 4862,
        "segments": [
            {"from": 0, "to": 100, "tokens": 60000, "seconds": 600.0, "trained_on": "CPU A"},
            {"from": 100, "to": 300, "tokens": 240000, "seconds": 1200.0, "trained_on": "GPU B"},
        ],
    }
    (adapter / "train_state.json").write_text(json.dumps(state))
    main([str(adapter), "--eval", str(tmp_path / "eval.json"), "--command", "cmd"])
    card = (adapter / "README.md").read_text()
    assert "300 steps (unfinished: 500 planned): 2,400 examples seen, 2,400 distinct" in card
    assert "(prompts covered: 1,900 of 4,862)" in card
    assert "| 0-100 | 60,000 | 10 min | 100 | CPU A |" in card
    assert "| 100-300 | 240,000 | 20 min | 200 | GPU B |" in card
