"""`specstream bench`: plain vLLM vs the speculative methods, one run."""

from __future__ import annotations

import argparse
import signal
import sys

from vllm_specstream.cli.common import (
    DATA_HELP,
    TASK_HELP,
    DefaultsHelpFormatter,
    add_split_args,
)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _cmd_bench(args: argparse.Namespace) -> int:
    from vllm_specstream.bench.bench import BenchConfig, run_bench

    try:
        cfg = BenchConfig(
            checkpoint=args.checkpoint,
            out_dir=args.out,
            methods=tuple(m for m in args.methods.split(",") if m) if args.methods else None,
            medusa=args.medusa,
            eagle3=args.eagle3,
            task=args.task,
            prompts=args.prompts,
            data=args.data,
            split=args.split,
            val_fraction=args.val_fraction,
            split_seed=args.split_seed,
            num_prompts=args.n,
            batch_sizes=_ints(args.batch_sizes),
            temperatures=_floats(args.temperatures),
            num_speculative_tokens=args.k,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            rounds=args.rounds,
            dtype=args.dtype,
            omp_threads_bind=args.omp_threads_bind,
            engine_options={"enforce_eager": False} if args.compile else {},
            tree_top_k=args.tree_top_k,
            tree_nodes=args.tree_nodes,
            tree_prune=args.tree_prune,
            suffix_drafts=args.suffix_drafts,
        )
    except (ValueError, OSError) as e:
        print(f"specstream bench: error: {e}", file=sys.stderr)
        return 2
    # SIGTERM ends the bench as Ctrl-C does: the running method's engines are stopped.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    run_bench(cfg)
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def add_parser(sub) -> None:
    from vllm_specstream.speculation.settings import FIELDS
    from vllm_specstream.training.tasks import ALL_TASKS

    defaults = DefaultsHelpFormatter

    p = sub.add_parser(
        "bench",
        help="plain vLLM vs ngram, suffix, Medusa, EAGLE-3, specstream: tok/s, speedup, TTFT/TPOT",
        description="Serve one merged specstream checkpoint with each method (plain, vLLM "
        "ngram, vLLM suffix decoding (needs arctic-inference), vLLM medusa with heads trained "
        "by `specstream train --objective medusa --base CKPT`, vLLM eagle3 with a drafter "
        "trained by `specstream train --objective eagle3 --base CKPT`, specstream), same "
        "prompts, batch "
        "sizes and temperatures, one fresh engine per method, in one run. Prints a Markdown "
        "table (tok/s, speedup, time to first token, decoding ms per output token, tokens per "
        "step, lossless) and writes OUT/bench.json, bench.md and bench.png (speedup vs batch "
        "size per method).",
        formatter_class=defaults,
    )
    p.add_argument("checkpoint", help="merged specstream checkpoint (specstream export)")
    p.add_argument("--medusa", help="Medusa heads directory (needed for the medusa method)")
    p.add_argument("--eagle3", help="EAGLE-3 drafter directory (needed for the eagle3 method)")
    p.add_argument(
        "--methods",
        help="comma-separated, from plain,plain-control (a second plain engine: the run's noise "
        "floor),plain-all-cores (plain decoding on every core: speedups are against the faster "
        "of it and plain),ngram,suffix,medusa,eagle3,specstream,specstream-fixed (the adaptive policy off),"
        "specstream-suffix (suffix-tree drafts where they pay more than the streams': "
        "--suffix-drafts),"
        "specstream-tree (draft trees verified in vLLM where the adaptive policy finds they "
        "pay, their width and pruning chosen per step: --tree-top-k, --tree-nodes),"
        "specstream-tree-fixed (the whole tree at every step, unpruned), "
        "specstream-tree-pruned (trees at every step, pruned by the checkpoint's early-exit "
        "adapter: --tree-prune) "
        "(default: all but specstream-fixed, specstream-suffix and the tree "
        "methods; medusa only "
        "with --medusa, eagle3 only with --eagle3, "
        "suffix only where arctic-inference is importable)",
    )
    p.add_argument("--task", default="sql", choices=ALL_TASKS, help=TASK_HELP)
    p.add_argument("--data", help=DATA_HELP)
    add_split_args(p, choose_split=True, val_note=" (training's value)")
    p.add_argument("--prompts", help="JSONL of prompts instead of the task's test split")
    p.add_argument("-n", type=int, default=16, help="number of prompts")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every method")
    p.add_argument(
        "--tree-top-k",
        default="2",
        help=f"specstream-tree: field tree_top_k, {FIELDS['tree_top_k']} (here 2 or 2,2,1,1)",
    )
    p.add_argument(
        "--tree-nodes", type=int, default=8, help="specstream-tree: draft nodes per request"
    )
    p.add_argument(
        "--tree-prune",
        help=f"specstream-tree-pruned and specstream-tree: field tree_prune, "
        f"{FIELDS['tree_prune']}; specstream-tree-fixed never prunes",
    )
    p.add_argument(
        "--suffix-drafts",
        default="on",
        help=f"specstream-suffix: field suffix_drafts, {FIELDS['suffix_drafts']} ('on': a "
        "request drafts from the suffix trees where that yields as many tokens per step cost "
        "as the streams)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="runs of each cell's prompts")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs of the whole method list, alternating order; speedups are the median of "
        "per-round ratios (a shared machine's speed drifts over minutes; the plain-control "
        "row shows how much)",
    )
    p.add_argument("--dtype", default="float32", help="engine dtype (fp32 is fast on CPUs)")
    p.add_argument(
        "--omp-threads-bind",
        help="VLLM_CPU_OMP_THREADS_BIND for every engine (default: the environment's, else "
        "vLLM's 'auto', which keeps one core for the front-end; 'nobind' gives the worker "
        "all cores); recorded in the report",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run every engine in vLLM's default compiled mode (torch.compile of the decoder, "
        "~1.5 min more per engine start; what `vllm serve` does without --enforce-eager) "
        "instead of eager mode; specstream then places its streams at the accepted position",
    )
    p.add_argument("--out", default="bench-results", help="output directory")
    p.set_defaults(func=_cmd_bench)
