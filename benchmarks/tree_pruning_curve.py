"""The paper's Figure 5 in vLLM: speedup over plain decoding against the draft tree's size,
with and without early-exit pruning.

One ``specstream bench`` run per tree size (``--nodes``), each with plain vLLM, trees at
every step (``specstream-tree-fixed``, never pruned) and the same trees pruned by the
checkpoint's early-exit adapter (``specstream-tree-pruned``), so every speedup is a ratio
measured in one run. Runs already in ``OUT/nodes-K/bench.json`` are kept (the script
resumes). Then ``OUT/curve.md`` (speedup and tokens per step per size, batch size and
method) and ``OUT/curve.png``.

    .venv/bin/python benchmarks/tree_pruning_curve.py CKPT --task e2e \\
        --data ../shared/data/e2e/devset.csv --out benchmarks/results/e2e/tree-pruning
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

METHODS = {"specstream-tree-fixed": "tree", "specstream-tree-pruned": "tree, pruned"}


def run_sizes(args: argparse.Namespace, out: Path) -> None:
    for nodes in args.nodes:
        run = out / f"nodes-{nodes}"
        if (run / "bench.json").is_file():
            print(f"nodes {nodes}: kept {run / 'bench.json'}", flush=True)
            continue
        cmd = [
            sys.executable, "-m", "vllm_specstream.cli", "bench", args.checkpoint,
            "--task", args.task, "--data", args.data, "--split", "val",
            "-n", str(args.n), "--methods", ",".join(METHODS),
            "--tree-top-k", args.tree_top_k, "--tree-nodes", str(nodes),
            "--temperatures", "0", "--batch-sizes", args.batch_sizes,
            "--repeats", "1", "--rounds", str(args.rounds), "--max-tokens", str(args.max_tokens),
            "--omp-threads-bind", args.omp_threads_bind, "--out", str(run),
        ]  # fmt: skip
        if args.tree_prune:
            cmd += ["--tree-prune", args.tree_prune]
        print(f"nodes {nodes}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True)


def collect(out: Path) -> list[dict]:
    """One record per tree size, batch size and tree method."""
    rows = []
    for path in sorted(out.glob("nodes-*/bench.json"), key=lambda p: int(p.parent.name[6:])):
        nodes = int(path.parent.name[6:])
        for r in json.loads(path.read_text())["rows"]:
            if r["method"] in METHODS:
                rows.append({"nodes": nodes, **r})
    return rows


def markdown(rows: list[dict], machine: str) -> str:
    lines = [
        f"Speedup over plain vLLM (same run) and tokens per step; {machine}.",
        "",
        "| nodes | batch | tree: speedup | tree: tokens/step | pruned: speedup "
        "| pruned: tokens/step |",
        "|---|---|---|---|---|---|",
    ]
    keyed = {(r["nodes"], r["batch_size"], r["method"]): r for r in rows}
    for nodes, batch in sorted({(r["nodes"], r["batch_size"]) for r in rows}):
        cells = []
        for method in METHODS:
            r = keyed.get((nodes, batch, method))
            cells += ["-", "-"] if r is None else [
                f"{r['speedup']:.2f}x", f"{r['tokens_per_step']:.2f}"
            ]  # fmt: skip
        lines.append(f"| {nodes} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch_size"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for method, label in METHODS.items():
            pts = sorted(
                (r["nodes"], r["speedup"])
                for r in rows
                if r["batch_size"] == batch and r["method"] == method
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("draft tree nodes (k)")
        ax.set_ylabel("speedup over plain")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="merged checkpoint with a pruning adapter")
    p.add_argument("--task", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--nodes", default="6,8,12,16", help="tree sizes (num_speculative_tokens)")
    p.add_argument("--tree-top-k", default="2")
    p.add_argument("--tree-prune", help="threshold (default: the checkpoint's)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("-n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--omp-threads-bind", default="nobind")
    p.add_argument("--report-only", action="store_true", help="only collect finished runs")
    args = p.parse_args()
    args.nodes = [int(x) for x in args.nodes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        run_sizes(args, out)
    rows = collect(out)
    if not rows:
        print(f"no finished runs under {out}", file=sys.stderr)
        return 1
    first = next(iter(out.glob("nodes-*/bench.json")))
    machine = json.loads(first.read_text()).get("machine", "")
    text = markdown(rows, machine if isinstance(machine, str) else json.dumps(machine))
    (out / "curve.md").write_text(text)
    plot(rows, out / "curve.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
