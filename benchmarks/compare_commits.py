"""specstream at this tree against specstream at another checkout, in one interleaved run.

Plain vLLM, a second plain engine (the noise floor), ``specstream`` from this tree and
``specstream-ref`` from ``--ref-tree`` (a checkout of another commit, e.g. ``git worktree add
/tmp/ref COMMIT``: its engine runs with that checkout first on ``PYTHONPATH``) decode the same
prompts, the methods' order alternating from round to round; speedups are the median of the
per-round ratios to plain (``specstream bench``'s summary); ``--also ngram`` adds other
methods of ``specstream bench`` (``--also eagle3 --eagle3 DRAFTER``: vLLM's EAGLE-3). Every
engine runs vLLM's default compilation, with both cores (``VLLM_CPU_OMP_THREADS_BIND=nobind``)
or, with ``--omp-threads-bind default``, vLLM's own binding as a user gets it (where that
leaves a speculating engine one thread, the plugin gives it both cores; plain engines keep
one).

    .venv/bin/python benchmarks/compare_commits.py CKPT --ref-tree /tmp/ref --task e2e \\
        --data ../shared/data/e2e/devset.csv [-n 16] [--batch-sizes 1,4,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from vllm_specstream.bench import bench
from vllm_specstream.machine import describe_machine

METHODS = ("plain", "plain-control", "specstream", "specstream-ref")


def run_ref(cfg: bench.BenchConfig, ref_tree: str, on_progress=lambda: None) -> dict:
    """``specstream`` with ``ref_tree``'s package (its logs in ``out_dir/ref``)."""
    shared_env = bench.engine_env

    def env(cfg, method=None):
        values = shared_env(cfg, method)
        values["PYTHONPATH"] = os.pathsep.join(p for p in (ref_tree, values.get("PYTHONPATH")) if p)
        return values

    out = Path(cfg.out_dir) / "ref"
    out.mkdir(parents=True, exist_ok=True)
    bench.engine_env = env
    try:
        return bench.run_method("specstream", replace(cfg, out_dir=str(out)), on_progress)
    finally:
        bench.engine_env = shared_env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("checkpoint", help="a merged specstream checkpoint")
    ap.add_argument("--ref-tree", required=True, help="a checkout of the commit to compare with")
    ap.add_argument("--task", required=True, choices=("e2e", "dialogsum", "sql"))
    ap.add_argument("--data", required=True, help="the task's development file")
    ap.add_argument("-n", "--num-prompts", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--also", default="", help="more methods of specstream bench, e.g. ngram")
    ap.add_argument("--eagle3", help="an EAGLE-3 drafter for the checkpoint (--also eagle3)")
    ap.add_argument(
        "--omp-threads-bind",
        default="nobind",
        help="VLLM_CPU_OMP_THREADS_BIND of every engine; 'default': vLLM's, as a user gets it",
    )
    ap.add_argument("--out", default="runs/compare-commits")
    args = ap.parse_args()
    for name in ("checkpoint", "ref_tree", "data", "eagle3", "out"):
        if getattr(args, name):
            setattr(args, name, str(Path(getattr(args, name)).resolve()))
    # The engines' processes start with `python -m` in the working directory, which goes on
    # their import path first: from a checkout that would shadow --ref-tree's package.
    Path(args.out).mkdir(parents=True, exist_ok=True)
    os.chdir(args.out)
    methods = (*METHODS[:2], *(m for m in args.also.split(",") if m), *METHODS[2:])
    bind = None if args.omp_threads_bind == "default" else args.omp_threads_bind
    if not (Path(args.ref_tree) / "vllm_specstream").is_dir():
        ap.error(f"--ref-tree {args.ref_tree}: no vllm_specstream package there")
    cfg = bench.BenchConfig(
        checkpoint=args.checkpoint,
        out_dir=args.out,
        methods=tuple(m for m in methods if m != "specstream-ref"),
        task=args.task,
        data=args.data,
        num_prompts=args.num_prompts,
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
        temperatures=(0.0,),
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        rounds=args.rounds,
        omp_threads_bind=bind,
        engine_options={"enforce_eager": False},
        eagle3=args.eagle3,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_round = []
    with tqdm(total=bench.steps_per_method(cfg) * len(methods) * args.rounds) as bar:
        for r in range(args.rounds):
            results = {}
            for method in methods if r % 2 == 0 else methods[::-1]:
                bar.set_postfix_str(f"{method}, round {r + 1}/{args.rounds}")
                if method == "specstream-ref":
                    results[method] = run_ref(cfg, args.ref_tree, bar.update)
                else:
                    results[method] = bench.run_method(method, cfg, on_progress=bar.update)
                (out / f"{method}.round{r + 1}.json").write_text(json.dumps(results[method]))
            per_round.append(bench.summarize({m: results[m] for m in methods}, cfg))
    rows = bench.combine_rounds(per_round)
    machine = describe_machine()
    setting = (
        f"{cfg.num_prompts} prompts ({bench.prompt_source(cfg)}), max_tokens {cfg.max_tokens}, "
        f"fp32, compiled, k={cfg.num_speculative_tokens}, "
        f"VLLM_CPU_OMP_THREADS_BIND={bind or 'vLLM default'}, "
        f"{cfg.repeats} repeats, {cfg.rounds} rounds (median of per-round speedups); "
        f"specstream-ref: {args.ref_tree}"
    )
    table = bench.markdown_table(rows)
    (out / "compare.md").write_text(f"Machine: {machine}\n\nSetting: {setting}\n\n{table}")
    (out / "compare.json").write_text(
        json.dumps({"machine": machine, "setting": setting, "rows": rows}, indent=2) + "\n"
    )
    print(f"\nMachine: {machine}\nSetting: {setting}\n\n{table}")


if __name__ == "__main__":
    main()
