"""`specstream train`: fine-tune LoRA + streams (or a baseline) on a task."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_specstream.cli.common import (
    DATA_HELP,
    TASK_HELP,
    DefaultsHelpFormatter,
    add_field_flags,
    add_split_args,
)

#: Flags made from the fields of ``TrainArgs`` of the same name (type, default and help
#: from the dataclass).
FIELD_FLAGS = [
    "out",
    "sql_rename_copies",
    "sql_rename_rate",
    "medusa_heads",
    "steps",
    "batch_size",
    "grad_accum",
    "lr",
    "lora_lr",
    "stream_lr",
    "stream_init_std",
    "stream_init_scale",
    "warmup_steps",
    "max_length",
    "num_train",
    "num_eval",
    "dtype",
    "device",
    "save_every",
    "eval_every",
    "seed",
    "max_minutes",
    "continue_from",
    "pack",
    "frozen_prefix",
]


def _train_task(args: argparse.Namespace) -> str | None:
    """The task ``train`` reads: ``--data`` without ``--task`` is generic JSONL (None), and a
    public task with neither is None too (it has no synthetic builder, except sql)."""
    from vllm_specstream.training.tasks import TASKS

    if args.task is None:
        return None if args.data else "sql"
    return args.task if args.data or args.task in TASKS else None


def _flag_error(args: argparse.Namespace, task: str | None) -> str | None:
    """What is wrong with the flags of ``specstream train`` (None: nothing)."""
    if task is None and not args.data:
        return f"--task {args.task} needs --data FILE"
    if args.max_minutes is not None and not args.max_minutes > 0:
        return f"--max-minutes {args.max_minutes}: must be > 0"
    if args.lora_lr is not None and not args.lora_lr >= 0:
        return f"--lora-lr {args.lora_lr}: must be >= 0"
    if args.sql_rename_copies and not (args.data and task == "sql"):
        return (
            "--sql-rename-copies needs --task sql --data FILE (records with a CREATE TABLE context)"
        )
    if not (args.sql_rename_copies >= 0 and 0.0 <= args.sql_rename_rate <= 1.0):
        return (
            "--sql-rename-copies must be >= 0 and --sql-rename-rate in [0, 1], got "
            f"{args.sql_rename_copies} and {args.sql_rename_rate}"
        )
    return None


def _cmd_train(args: argparse.Namespace) -> int:
    from vllm_specstream.checkpoint.config import LossConfig, PruneConfig, SpecStreamConfig
    from vllm_specstream.training.args import TrainArgs
    from vllm_specstream.training.checkpoint import LoraSettings
    from vllm_specstream.training.eagle3 import Eagle3Config
    from vllm_specstream.training.tasks import PUBLIC_TASKS
    from vllm_specstream.training.train import train

    task = _train_task(args)
    error = _flag_error(args, task)
    if error:
        print(f"specstream train: error: {error}", file=sys.stderr)
        return 2
    # The split settings only mean something for a task file.
    split = (
        {"val_fraction": args.val_fraction, "split_seed": args.split_seed}
        if args.data and task in PUBLIC_TASKS
        else {}
    )
    base = args.base
    if base is None:
        from vllm_specstream.base_model import prepare_base

        base = str(prepare_base())
    else:
        base = _fine_tune_base(base, args.out)
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
            target_modules=args.lora_targets.split(",") if args.lora_targets else None,
        )
    )
    train_args = TrainArgs(
        base=base,
        task=task,
        data=args.data,
        eval_data=args.eval_data,
        **split,
        objective=args.objective,
        init_from=args.init_from,
        spec=spec,
        lora=lora,
        eagle3=Eagle3Config(ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size),
        **{name: getattr(args, name) for name in FIELD_FLAGS},
    )
    # streams-only, Medusa heads or an EAGLE-3 drafter learning replies, and a run continuing
    # an adapter (--init-from) write the replies they lack into the --distill file; other runs
    # only read it
    continues = bool(args.init_from) and args.objective in ("specstream", "ntp")
    medusa_replies = args.objective in ("medusa", "eagle3") and bool(args.distill)
    if args.distill:
        writes = args.objective == "streams-only" or continues or medusa_replies
        train_args.distill = _distill_file(args.distill, not writes)
    if args.objective == "streams-only" or medusa_replies:
        train_args.distill = str(_self_distill(train_args, args))
    elif args.distill and continues:
        train_args.distill = str(_self_distill(train_args, args, adapter=args.init_from))
    train(train_args)
    return 0


def _fine_tune_base(base: str, out: str) -> str:
    """``--base``: a model directory, or a fine-tune given as a PEFT LoRA directory, which
    is merged into its base once (``OUT/fine-tune``) and trained on as the base."""
    from vllm_specstream.training.checkpoint import is_peft_adapter, merge_peft_base

    if not is_peft_adapter(base):
        return base
    merged = Path(out) / "fine-tune"
    print(f"--base {base} is a PEFT LoRA: training on it merged into its base ({merged})")
    return str(merge_peft_base(base, merged))


def _stream_lora_rank(args: argparse.Namespace) -> int:
    """``--stream-lora-rank``; by default --lora-rank for streams-only, else 0."""
    if args.stream_lora_rank is not None:
        return args.stream_lora_rank
    return args.lora_rank if args.objective == "streams-only" else 0


def _distill_file(path: str, must_exist: bool) -> str:
    """``--distill``: a self-distillation file, or a run directory holding one."""
    from vllm_specstream.training.replies import DISTILL_FILE

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

    from vllm_specstream.training.batches import load_examples
    from vllm_specstream.training.replies import (
        DISTILL_FILE,
        DistillSettings,
        distill_replies,
        prompts_without_reply,
    )

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


def add_parser(sub) -> None:
    from vllm_specstream.checkpoint.config import LossConfig, SpecStreamConfig
    from vllm_specstream.training.args import TrainArgs
    from vllm_specstream.training.eagle3 import Eagle3Config
    from vllm_specstream.training.tasks import ALL_TASKS

    defaults = DefaultsHelpFormatter

    p = sub.add_parser(
        "train",
        help="fine-tune LoRA + stream embeddings (or plain LoRA) on a task",
        description="Train an adapter checkpoint (docs/checkpoint-format.md) with the multi-stream objective "
        "(paper eq. 5) or plain next-token loss. Saves every --save-every steps to OUT/checkpoint "
        "and resumes from there when run again with the same --out.",
        formatter_class=defaults,
    )
    p.add_argument(
        "--base",
        help="the model to train on: a model directory, or a fine-tune given as a PEFT LoRA "
        "directory (merged into the base its adapter_config.json names, once, into "
        "OUT/fine-tune); default: the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--task",
        choices=ALL_TASKS,
        help=TASK_HELP + "; not given (%(default)s): sql, or with --data generic JSONL of "
        "prompt/completion or messages records",
    )
    p.add_argument(
        "--data",
        help=DATA_HELP + "; training uses the part --val-fraction does not hold out "
        "(every reference is one example)",
    )
    p.add_argument(
        "--eval-data",
        help="held-out file, same format as --data (default: the part of --data held out, "
        "else the synthetic task's test split)",
    )
    add_split_args(p, choose_split=False, val_note="; 0 trains on all of it")
    p.add_argument(
        "--objective",
        default="specstream",
        choices=["specstream", "ntp", "medusa", "eagle3", "streams-only", "prune"],
        help="specstream: LoRA + streams (paper eq. 5); ntp: LoRA alone (the quality "
        "baseline); medusa: Medusa heads on the frozen --base; eagle3: an EAGLE-3 drafter on "
        "the frozen --base (served with vLLM's eagle3 method: --ttt-steps, "
        "--draft-vocab-size); streams-only: streams and a "
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
        "run, same --medusa-heads) to train further; with --objective eagle3, a trained "
        "drafter (same --draft-vocab-size); otherwise its LoRA and streams are "
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
        "that its streams learn what it says; with medusa and eagle3, the --base model's replies "
        "(those a streams-only run wrote for the same base, or generated into FILE where "
        "missing). Without vLLM installed, Transformers writes them (on a GPU if there is one)",
    )
    p.add_argument(
        "--distill-max-tokens",
        type=int,
        default=256,
        help="streams-only, medusa, eagle3 and --init-from with --distill: longest reply to "
        "learn from",
    )
    p.add_argument(
        "--distill-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="streams-only, medusa, eagle3 and --init-from with --distill: dtype of the "
        "engine that "
        "writes the replies (that of the deployment)",
    )
    add_field_flags(
        p, SpecStreamConfig, ["num_streams", "num_msa_layers", "stream_position", "init_rank"]
    )
    add_field_flags(p, Eagle3Config, ["ttt_steps", "draft_vocab_size"])
    p.add_argument("--prune", action="store_true", help="also train the tree-pruning adapter")
    p.add_argument("--prune-rank", type=int, default=8)
    p.add_argument("--prune-threshold", type=float, default=0.01)
    add_field_flags(p, LossConfig, ["a0", "a_j"], a_j={"help": "weight of each stream's loss"})
    p.add_argument(
        "--lora-rank",
        type=int,
        default=32,
        help="0 = no LoRA (the frozen base: streams and adapters train alone)",
    )
    p.add_argument("--lora-layers", default="all", help="all, msa, or indices like 24,25")
    p.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated projections that get LoRA (default: every projection of the "
        "base's family: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj; Phi-3: "
        "qkv_proj,o_proj,gate_up_proj,down_proj)",
    )
    add_field_flags(
        p,
        TrainArgs,
        FIELD_FLAGS,
        sql_rename_copies={"metavar": "N"},
        dtype={"choices": ["auto", "bf16", "fp32"]},
        max_minutes={"metavar": "M"},
        continue_from={"metavar": "ADAPTER_DIR"},
        pack={
            "help": "pad each batch to its longest example instead of packing examples into "
            "rows (same loss, slower)"
        },
        frozen_prefix={
            "help": "recompute the frozen layers below the lowest LoRA layer at every step "
            "instead of once per example (same loss, slower; the cache applies with "
            "--lora-layers msa)"
        },
    )
    p.set_defaults(func=_cmd_train)
