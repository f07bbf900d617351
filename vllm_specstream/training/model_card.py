"""Model card (README.md) of a trained adapter: how it was made and what it measures."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_specstream.checkpoint.config import CONFIG_FILE, SpecStreamConfig
from vllm_specstream.machine import describe_machine

#: Quality keys ``specstream eval`` may report (training/metrics.py ``task_metrics``).
TASK_METRICS = ("exact_match", "rouge1", "rougeLsum", "rouge_l")


def _train_summary(adapter_dir: Path) -> tuple[dict, float | None]:
    args = json.loads((adapter_dir / "train_args.json").read_text())
    wall = None
    log = adapter_dir / "train_log.jsonl"
    if log.is_file():
        # elapsed_s restarts with each (resumed) process: add up the segments.
        wall, last = 0.0, 0.0
        for line in log.read_text().splitlines():
            elapsed = json.loads(line).get("elapsed_s", 0.0)
            if elapsed < last:
                wall += last
            last = elapsed
        wall += last
    return args, wall


def _progress_section(adapter_dir: Path) -> str:
    """What the run has trained on and the processes that trained it (``train_state.json``,
    written by runs of this version; older adapters have only the wall time above)."""
    path = adapter_dir / "train_state.json"
    if not path.is_file():
        return ""
    state = json.loads(path.read_text())
    done = "" if state["step"] >= state["steps"] else f" (unfinished: {state['steps']} planned)"
    rows = "\n".join(
        f"| {x['from']}-{x['to']} | {x['tokens']:,} | {x['seconds'] / 60:.0f} min | "
        f"{x['tokens'] / max(x['seconds'], 1e-9):.0f} | {x['trained_on']} |"
        for x in state.get("segments", [])
    )
    return f"""
## Training data and time

{state["step"]} steps{done}: {state["examples_seen"]:,} examples seen, {state["distinct_examples"]:,} distinct of the training file's {state["train_examples"]:,} (prompts covered: {state["distinct_prompts"]:,} of {state["train_prompts"]:,}).

| steps | tokens | wall time | tokens/s | machine |
|---|---|---|---|---|
{rows}
"""


def _identity_line(result: dict) -> str:
    """Whether chain and tree decoding agreed (a chain-only eval has nothing to compare)."""
    if result["tokens_per_step"].get("tree") is None:
        return "Chain decoding only (`--tree-top-k 0`)."
    return f"Chain and tree decoding gave identical outputs: {result['chain_tree_identical']}."


def _measured_on(result: dict) -> str:
    data = result.get("data")
    if not data:
        return "the held-out test split of the built-in task"
    if data["split"] == "all":
        return f"every record of `{data['file']}`"
    where = f"the {data['split']} split of `{data['file']}`"
    if data["split"] != "val":
        return where
    return (
        f"{where} (cut by group, val_fraction {data['val_fraction']}, seed "
        f"{data['split_seed']}; never trained on)"
    )


def _bench_section(bench: dict | None) -> str:
    """Batch-1 rows of ``specstream bench`` (same split): every method serves the merged
    adapter, so each has the adapter's outputs and metric (the bench checks losslessness)."""
    if not bench:
        return ""
    rows = [r for r in bench["rows"] if r["batch_size"] == 1 and r["temperature"] == 0]
    lines = "\n".join(
        f"| {r['method']} | {r['tokens_per_step']:.2f} | {r['speedup']:.2f}x | "
        f"{'yes' if r['lossless'] else 'NO'} | {r['extra_params']:,} |"
        for r in rows
    )
    return f"""
## vLLM, batch 1, greedy ({bench["machine"]})

{bench["setting"]}

| method | tokens per step | speedup over plain | identical to plain | extra params |
|---|---|---|---|---|
{lines}
"""


def _serving_default(adapter_dir: Path) -> str:
    """The settings row of the adapter's serving default of suffix drafts, if it has one."""
    if not (adapter_dir / CONFIG_FILE).is_file():
        return ""
    value = SpecStreamConfig.load(adapter_dir).suffix_drafts
    return f"| suffix drafts beside the streams (serving default) | {value} |\n" if value else ""


def _learning_rates(args: dict) -> str:
    """The run's learning rates (the main LoRA's apart when it had its own)."""
    lora_lr = args.get("lora_lr")
    if lora_lr is None or lora_lr == args["lr"]:
        return f"LoRA {args['lr']}, stream embeddings {args['stream_lr']}"
    main = "frozen" if lora_lr == 0 else lora_lr
    return (
        f"main LoRA {main}, stream init adapter {args['lr']}, stream embeddings {args['stream_lr']}"
    )


def write_model_card(
    adapter_dir: str | Path,
    command: str,
    result: dict,
    baseline: dict | None = None,
    note: str | None = None,
    bench: dict | None = None,
) -> Path:
    """Write ``adapter_dir/README.md`` from the training args, log and eval results."""
    adapter_dir = Path(adapter_dir)
    args, wall = _train_summary(adapter_dir)
    spec, lora = args["spec"], args.get("lora") or {}
    metrics = [m for m in TASK_METRICS if m in result]
    tps = result["tokens_per_step"]
    rows = [
        ("tokens_per_step, chain (reference decoder)", f"{tps['chain']:.2f}"),
        *(
            [(f"tokens_per_step, tree (top-{tps['tree_top_k']})", f"{tps['tree']:.2f}")]
            if tps.get("tree") is not None
            else []
        ),
        *((f"{m} (%)", f"{result[m]:.1f}") for m in metrics),
        ("extra_params (over base + LoRA)", f"{result['extra_params']:,}"),
    ]
    if baseline is not None:
        rows += [
            (f"{m} of the ntp baseline, same budget (%)", f"{baseline[m]:.1f}") for m in metrics
        ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    wall_text = f"{wall / 60:.0f} min" if wall else "n/a"
    card = f"""# Speculative Streaming adapter: {args.get("task") or args.get("data")} on {Path(args["base"]).name}

Trained with vllm-specstream (`--objective {args["objective"]}`).

| setting | value |
|---|---|
| base model | {Path(args["base"]).name} |
| data | {"built-in task `" + args["task"] + "`" if not args.get("data") else args["data"]} |
| num_streams (gamma) | {spec["num_streams"]} |
| num_msa_layers (N_s) | {spec["num_msa_layers"]} |
| stream_position | {spec["stream_position"]} |
| init adapter rank (eta) | {spec.get("init_rank", 0)} |
| loss weights (a0, a_j) | {spec["loss"]["a0"]}, {spec["loss"]["a_j"]} |
| LoRA | rank {lora.get("rank")}, layers `{lora.get("layers")}`, {", ".join(lora.get("target_modules") or ["every projection"])} |
| steps x batch x accumulation | {args["steps"]} x {args["batch_size"]} x {args["grad_accum"]} |
| learning rates | {_learning_rates(args)} |
{_serving_default(adapter_dir)}| wall time | {wall_text} of training (sum over resumed runs) on {args.get("trained_on") or describe_machine()} |
{"" if not note else chr(10) + note + chr(10)}{_progress_section(adapter_dir)}
## Measured on {_measured_on(result)} ({result["num_prompts"]} prompts, greedy)

| metric | value |
|---|---|
{table}

{_identity_line(result)}
{_bench_section(bench)}
## Reproduce

```bash
{command}
```
"""
    path = adapter_dir / "README.md"
    path.write_text(card)
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write README.md (model card) of an adapter.")
    parser.add_argument("adapter_dir")
    parser.add_argument("--eval", required=True, help="JSON printed by `specstream eval`")
    parser.add_argument("--baseline", help="JSON printed by `specstream eval` for the ntp baseline")
    parser.add_argument("--command", required=True, help="the command that reproduces the adapter")
    parser.add_argument("--note", help="a sentence about the run for the card")
    parser.add_argument(
        "--bench", help="bench.json of `specstream bench` on the same split (its batch-1 rows)"
    )
    a = parser.parse_args(argv)
    result = json.loads(Path(a.eval).read_text().strip().splitlines()[-1])
    baseline = (
        json.loads(Path(a.baseline).read_text().strip().splitlines()[-1]) if a.baseline else None
    )
    bench = json.loads(Path(a.bench).read_text()) if a.bench else None
    print(write_model_card(a.adapter_dir, a.command, result, baseline, a.note, bench))


if __name__ == "__main__":
    main()
