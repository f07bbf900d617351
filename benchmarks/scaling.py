"""How a speculative step's cost grows with the model: plain and specstream steps of
random-weight bases of real shapes, and the speedup they project.

For each shape a merged checkpoint is made once (random weights, SmolLM2's tokenizer) with
the E2E adapter's stream settings: 4 streams in the top half of the layers (the E2E
adapter's 15 of 30), stream-initialisation and stream-row LoRA of rank 32, a draft vocabulary
of 8,192 tokens. ``benchmarks/step_cost.py`` then times, interleaved in one process, a plain
engine, a second plain engine (the noise floor, where three engines fit in memory) and a
specstream engine drafting a fixed ``k`` every step, at batch 1, compiled, fp32, on every
core (``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless set). The projected speedup of a size is
the tokens per step the streams reach on a task (``--tokens-per-step``: measured on the
135M E2E adapter) over the step's cost in plain steps: it assumes a bigger model's streams
accept as well, which random weights cannot tell.

    .venv/bin/python benchmarks/scaling.py [--sizes smollm2-135m,smollm2-360m,llama-3.2-1b,smollm2-1.7b]
        [--k 4] [--tokens-per-step 4.07] [-n 8] [--data E2E_DEV_CSV] [--out runs/scaling]

Writes OUT/NAME/CLASS.json (step_cost's report) per size (a size whose report is there
already is not timed again: a run that stopped goes on where it stopped), OUT/scaling.json,
OUT/scaling.md and OUT/scaling.png. Checkpoints stay in OUT/ckpt-NAME (delete them when done: 0.5-7 GB each).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: step_cost.py's KV cache per engine.
KV_CACHE_BYTES = 1 << 30

#: Shapes of the models users serve (their published configs; all Llama-architecture, tied
#: embeddings, head_dim 64).
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
    ),
    "smollm2-360m": dict(
        hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
        num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    ),
    "smollm2-1.7b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=49152,
    ),
}  # fmt: skip


def parameters(shape: dict) -> int:
    """Parameters of a tied Llama of ``shape``."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    layer = h * (2 * h + 2 * kv) + 3 * h * i + 2 * h
    return n * layer + shape["vocab_size"] * h + h


def make_checkpoint(name: str, out: Path) -> Path:
    """The merged checkpoint of shape ``name`` in ``out`` (made once)."""
    if (out / "config.json").exists():
        return out
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_specstream.base_model import prepare_base
    from vllm_specstream.checkpoint.config import SpecStreamConfig
    from vllm_specstream.training.checkpoint import build_model, export_merged, save_adapter
    from vllm_specstream.training.draft_vocab import write_draft_vocab

    shape = SHAPES[name]
    tokenizer_dir = prepare_base(progress=False)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "llama", **shape, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    base = out.with_name(out.name + "-base")
    lm.save_pretrained(base)
    del lm
    gc.collect()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / f, base / f)
    spec = SpecStreamConfig(
        num_streams=4,
        num_msa_layers=shape["num_hidden_layers"] // 2,
        init_rank=32,
        stream_lora_rank=32,
    )
    model = build_model(base, spec, lora=None)
    adapter = save_adapter(model, out.with_name(out.name + "-adapter"))
    del model
    gc.collect()
    ids = torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:8192]
    write_draft_vocab(adapter, ids.tolist(), shape["vocab_size"])
    export_merged(adapter, out, dtype=torch.float32)
    shutil.rmtree(base)
    shutil.rmtree(adapter)
    return out


def fits_control(name: str) -> bool:
    """Whether three fp32 engines of ``name`` (plain, control, specstream), each with its KV
    cache, fit in memory beside one more copy of the weights while the last one loads."""
    import psutil

    weights = 4 * parameters(SHAPES[name])
    need = 3 * (weights + KV_CACHE_BYTES) + weights
    return need < 0.8 * psutil.virtual_memory().total


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = range(len(rows))  # evenly spaced: 1B and 1.7B would overlap on a log axis
    labels = [f"{r['size']}\n{r['parameters'] / 1e9:.2f}B" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot(sizes, [r["plain_ms"] for r in rows], "o-", label="plain")
    a.plot(sizes, [r["spec_ms"] for r in rows], "s-", label=f"specstream, k={rows[0]['k']}")
    a.set(ylabel="ms per step (median)")
    b.plot(sizes, [r["cost"] for r in rows], "s-", label="step cost (plain steps)")
    b.plot(sizes, [r["projected_speedup"] for r in rows], "o-", label="projected speedup")
    b.axhline(1.0, color="grey", lw=0.8)
    b.set_ylim(bottom=0)
    for ax in (a, b):
        ax.set_xticks(sizes, labels, fontsize=8)
        ax.set_xlabel("model shape (random weights)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--sizes", default=",".join(SHAPES), help="comma-separated, from " + ", ".join(SHAPES)
    )
    ap.add_argument("--k", type=int, default=4, help="drafts per step (fixed)")
    ap.add_argument(
        "--tokens-per-step",
        type=float,
        default=4.07,
        help="tokens per step the streams reach (default: the E2E adapter's, development split)",
    )
    ap.add_argument("-n", type=int, default=8, help="timed groups per size")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--data",
        default=str(HERE.parents[1] / "shared" / "data" / "e2e" / "devset.csv"),
        help="E2E file whose validation side gives the prompts (absent: built-in SQL prompts)",
    )
    ap.add_argument("--out", default="runs/scaling")
    args = ap.parse_args()
    prompts = (
        ["--task", "e2e", "--data", args.data] if Path(args.data).exists() else ["--task", "sql"]
    )
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    }
    rows = []
    for name in args.sizes.split(","):
        if name not in SHAPES:
            sys.exit(f"--sizes: unknown size {name!r}; choose from {', '.join(SHAPES)}")
        reports = sorted((out / name).glob("*.json"))
        if not reports:
            ckpt = make_checkpoint(name, out / f"ckpt-{name}")
            cmd = [
                sys.executable, str(HERE / "step_cost.py"), str(ckpt), "--ks", str(args.k),
                "--batch-sizes", "1", "-n", str(args.n), "--max-tokens", str(args.max_tokens),
                *prompts, "--out", str(out / name),
            ] + (["--control"] if fits_control(name) else [])  # fmt: skip
            print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, env=env, check=True)
            reports = sorted((out / name).glob("*.json"))
        else:
            print(f"== {name}: reusing {reports[0]} (delete {out / name} to time it again)")
        report = json.loads(reports[0].read_text())
        cost = report["ratios"][f"k{args.k}"][0]
        rows.append(
            {
                "size": name,
                "parameters": parameters(SHAPES[name]),
                "k": args.k,
                "plain_ms": report["median_ms"]["plain"]["1"],
                "spec_ms": report["median_ms"][f"k{args.k}"]["1"],
                "cost": cost,
                "control": (report["ratios"].get("control") or [None])[0],
                "projected_speedup": round(args.tokens_per_step / cost, 2),
                "machine": report["machine"],
            }
        )
    (out / "scaling.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        f"{rows[0]['machine']}; batch 1, fp32, compiled, k={args.k}, threads: "
        f"{env['VLLM_CPU_OMP_THREADS_BIND']}; projected speedup = {args.tokens_per_step} tokens "
        "per step / step cost.",
        "",
        "| model shape | parameters | plain ms/step | specstream ms/step | step cost (plain steps) "
        "| second plain engine | projected speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        control = "not run (memory)" if r["control"] is None else f"{r['control']:.2f}"
        lines.append(
            f"| {r['size']} | {r['parameters'] / 1e9:.2f}B | {r['plain_ms']} | {r['spec_ms']} "
            f"| {r['cost']:.2f} | {control} | {r['projected_speedup']:.2f}x |"
        )
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "scaling.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
