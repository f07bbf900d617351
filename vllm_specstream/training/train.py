"""The training loop: LoRA + stream embeddings (or plain LoRA), with saves, resume and eval."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from vllm_specstream.checkpoint.config import ConfigError, SpecStreamConfig
from vllm_specstream.logger import init_logger
from vllm_specstream.safe_write import new_dir, write_text
from vllm_specstream.training.checkpoint import (
    LoraSettings,
    build_model,
    check_model_dir,
    load_stream_tensors,
    save_adapter,
)
from vllm_specstream.training.eagle3 import Eagle3Config
from vllm_specstream.training.loss import specstream_loss
from vllm_specstream.training.model import SpecStreamModel
from vllm_specstream.training.tasks.holdout import DEFAULT_VAL_FRACTION
from vllm_specstream.training.tasks.sql_rename import DEFAULT_RENAME_RATE

logger = init_logger(__name__)

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
#: The frozen layers' output per training example, kept until the run finishes so that a
#: resumed run does not compute it again.
FROZEN_PREFIX_FILE = "frozen_prefix.pt"
OBJECTIVES = ("specstream", "ntp", "medusa", "eagle3", "streams-only", "prune")
#: Objectives that train streams (stream embeddings, their adapters).
STREAM_OBJECTIVES = ("specstream", "streams-only")
#: How far a run got, written beside its adapter: the step reached of the run's ``steps``,
#: where it last continued (``continue_from``), and the data it has seen so far.
PROGRESS_FILE = "train_state.json"
#: Settings a run continued from a committed adapter must share with it: the data order and
#: the learning-rate schedule both follow from them.
CHAIN_FIELDS = (
    "objective",
    "task",
    "val_fraction",
    "split_seed",
    "sql_rename_copies",
    "sql_rename_rate",
    "spec",
    "lora",
    "steps",
    "batch_size",
    "grad_accum",
    "lr",
    "lora_lr",
    "stream_lr",
    "warmup_steps",
    "max_length",
    "num_train",
    "seed",
)


@dataclass
class TrainArgs:
    """Everything one training run depends on (saved as ``train_args.json``)."""

    base: str
    """Base model checkpoint directory (Hugging Face format)."""
    out: str
    """Output directory: the adapter checkpoint, logs, and ``checkpoint/`` for resuming."""
    task: str | None = "sql"
    """Built-in task (sql, code, text); ignored when ``data`` is given."""
    data: str | None = None
    """Training JSONL (prompt/completion, messages, or sql-create-context records)."""
    eval_data: str | None = None
    """Held-out file (same format as ``data``); default: the part of ``data`` held out by
    ``val_fraction``, else the built-in task's test split."""
    val_fraction: float = DEFAULT_VAL_FRACTION
    """Share of a task file (``task`` sql, e2e or dialogsum with ``data``) held out by group;
    0 trains on all of it."""
    split_seed: int = 0
    """Seed of that split (``specstream eval/bench --split val`` with the same values)."""
    objective: str = "specstream"
    """"specstream" (paper eq. 5), "ntp" (plain LoRA, the quality baseline), "medusa"
    (Medusa heads on the frozen ``base``, saved for vLLM's ``medusa`` method), "eagle3" (an
    EAGLE-3 drafter on the frozen ``base``, saved for vLLM's ``eagle3`` method) or
    "streams-only" (streams on the frozen ``base``: no LoRA on the main stream, a stream LoRA
    (``spec.stream_lora_rank``) on the stream rows; outputs stay the base model's)."""
    init_from: str | None = None
    """A trained adapter to start from. Objective "prune": the adapter the pruning adapter is
    added to (its LoRA and streams are loaded and stay frozen; the output is that adapter
    plus the pruning tensors); "medusa": trained heads (same ``medusa_heads``) to train
    further; "eagle3": a trained drafter (same draft vocabulary size and auxiliary layers)
    to train further; the other objectives train its LoRA and streams further (same
    ``spec`` settings)."""
    distill: str | None = None
    """Self-distillation file (JSONL of ``messages`` and ``completion``): every example's
    completion is replaced by the model's own greedy reply to its prompt (the base's for
    streams-only and Medusa heads, the ``init_from`` adapter's when continuing one), so that
    the streams learn what the model they draft for will say."""
    sql_rename_copies: int = 0
    """Task sql with ``data``: schema-renamed copies of each training record added to the
    training examples (:func:`~vllm_specstream.training.tasks.renamed_sql_examples`: tables
    and columns named with other words, consistently in schema, question and query), so that
    the model and its streams learn to copy names from the prompt's schema rather than
    memorise those of the few training databases."""
    sql_rename_rate: float = DEFAULT_RENAME_RATE
    """Share of the schema's word parts each renamed copy renames."""
    medusa_heads: int = 4
    """Number of Medusa heads (objective medusa)."""
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    """The EAGLE-3 drafter's settings (objective eagle3)."""
    spec: SpecStreamConfig = field(default_factory=SpecStreamConfig)
    lora: LoraSettings | None = field(default_factory=LoraSettings)
    steps: int = 300
    """Optimizer steps of the whole run (also of a run continued with ``continue_from``)."""
    batch_size: int = 8
    """Examples per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 2e-4
    """Learning rate of LoRA (and the small adapters)."""
    lora_lr: float | None = None
    """Learning rate of the main model's LoRA alone (None: ``lr``). 0 freezes it: continuing
    an adapter (``init_from``) on its own replies (``distill``), the streams and the stream
    init adapter learn while the adapter's outputs stay exactly what they were."""
    stream_lr: float = 2e-2
    """Learning rate of the stream embeddings: they must grow to the scale of the residual
    stream (norm in the hundreds) to make streams differ from the main stream."""
    stream_init_std: float = 0.02
    """Std of the stream embeddings' random init (used when ``stream_init_scale`` is 0)."""
    stream_init_scale: float = 0.5
    """Initialise each stream embedding with a norm of this fraction of the median norm of
    the residual stream entering layer L0 (measured on the first batch), so that streams
    start distinct from the main stream; 0 uses ``stream_init_std``."""
    warmup_steps: int = 20
    """Steps of linear learning-rate warm-up (again when continuing an adapter)."""
    max_length: int = 256
    """Longest example in tokens: longer ones lose prompt tokens from the left (a reply longer
    on its own is cut on the right)."""
    num_train: int | None = None
    """Records of the built-in task to generate (default: the task's default)."""
    num_eval: int = 64
    """Held-out examples the periodic evaluation reads."""
    dtype: str = "auto"
    """"bf16" (autocast), "fp32", or "auto" (bf16 on a GPU or where the CPU has native bf16
    matmuls)."""
    device: str = "auto"
    """Where training runs: "cpu", "cuda" (or "cuda:N"), or "auto" (a CUDA GPU when PyTorch
    sees one, else the CPU). The adapter written is the same either way (saved on the CPU)."""
    save_every: int = 50
    """Steps between checkpoints in ``out/checkpoint`` (a run started again resumes there)."""
    eval_every: int = 100
    """Steps between evaluations on the held-out examples (and at the last step; 0: at the
    last step only)."""
    seed: int = 0
    """Seed of the data order and the initialisation."""
    max_minutes: float | None = None
    """Stop after the first step past this many minutes of training, writing the adapter as
    it stands and ``train_state.json`` (the step reached); the same command continues from
    ``out/checkpoint``, and ``continue_from`` continues from the adapter alone."""
    continue_from: str | None = None
    """The adapter of an unfinished run (``max_minutes``) with the same settings and data
    (checked): training continues at its step, with the data order and
    learning-rate schedule of the whole run, so no example is seen twice before all have
    been. The optimizer's moments are not part of an adapter: they start again, under a
    warm-up of ``warmup_steps``."""
    pack: bool = True
    """Lay each batch's examples end to end in rows of up to ``max_length`` tokens instead of
    padding them (same loss; objectives specstream and ntp)."""
    frozen_prefix: bool = True
    """Compute the frozen layers below the lowest trainable one once per example and reuse
    them at every epoch (same loss; needs ``--lora-layers`` above the bottom layers)."""
    frozen_prefix_max_gib: float = 6.0
    """Skip the frozen-prefix cache when it would take more memory than this."""


def resolve_device(name: str) -> torch.device:
    """The device of ``--device`` (``auto``: a CUDA GPU when PyTorch sees one); a bad one is a
    :class:`ConfigError`, which the CLI shows as one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"--device {name!r}: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {name}: PyTorch {torch.__version__} sees no CUDA GPU; "
            "use --device cpu (or auto)"
        )
    return device


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """The training precision of ``--dtype`` on ``device`` (default: the CPU)."""
    if name == "bf16":
        return torch.bfloat16
    if name == "fp32":
        return torch.float32
    if name == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16
        from vllm_specstream.machine import native_bf16

        fast_bf16 = torch.backends.mkldnn.is_available() and native_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    raise ValueError(f"--dtype must be bf16, fp32 or auto, got {name!r}")


def cast_frozen_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen linear weight in ``dtype`` once, for training under autocast to it:
    autocast keeps its casts of trainable weights only, so a frozen fp32 weight was cast
    again at every call (the tied LM head, 28M values, once per stream per step). The
    products are the same. A weight shared with an embedding (a tied LM head) gets its own
    copy, so embeddings stay in full precision. Returns how many weights were cast."""
    cast = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for name in ("weight", "bias"):
            param = getattr(module, name)
            if param is None or param.requires_grad or param.dtype == dtype:
                continue
            setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))
            cast += 1
    return cast


def describe_device(device: torch.device) -> str:
    """The machine a run trains on, for its model card: the GPU's name, or the CPU's."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    from vllm_specstream.machine import describe_machine

    return describe_machine()


def to_device(batch: dict, device: torch.device) -> dict:
    """``batch`` with its tensors on ``device`` (other values as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def load_examples(args: TrainArgs, split: str, n: int | None, distilled: bool = True):
    """The examples of ``split`` (``train`` or ``test``), with the base model's own replies
    when ``args.distill`` is set (and ``distilled``)."""
    from vllm_specstream.training.data import read_replies, with_replies

    examples = _task_examples(args, split, n)
    if args.distill and distilled:
        return with_replies(examples, read_replies(args.distill), args.distill)
    return examples


def _task_examples(args: TrainArgs, split: str, n: int | None):
    from vllm_specstream.training.tasks import task_examples

    return task_examples(
        args.task,
        split,
        n,
        data=args.data,
        eval_data=args.eval_data,
        seed=args.seed,
        val_fraction=args.val_fraction,
        split_seed=args.split_seed,
        sql_rename_copies=args.sql_rename_copies,
        sql_rename_rate=args.sql_rename_rate,
    )


def collate(encoded: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``labels_mask``."""
    t = max(len(e["input_ids"]) for e in encoded)
    ids = torch.zeros(len(encoded), t, dtype=torch.long)
    attn = torch.zeros(len(encoded), t, dtype=torch.bool)
    labels = torch.zeros(len(encoded), t, dtype=torch.bool)
    for i, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        attn[i, :n] = True
        labels[i, :n] = torch.tensor(e["labels_mask"])
    return {"input_ids": ids, "attention_mask": attn, "labels_mask": labels}


def batch_maker(job, args: TrainArgs, train_set: list[dict], autocast, progress: bool = False):
    """The function from example indices to a training batch: padded (:func:`collate`), or
    packed, with the frozen layers' output cached where that applies (:mod:`fast_batches`;
    Medusa heads and EAGLE-3 drafters: the whole model is frozen, its outputs are cached)."""
    from vllm_specstream.training.fast_batches import (
        cache_key,
        first_trainable_layer,
        load_or_compute,
        pack_batch,
        pad_rows,
        prefix_hidden,
    )

    medusa = isinstance(job, FrozenBaseJob)  # the whole base is frozen
    model = job.model
    start = 0
    if args.frozen_prefix:
        start = model.lm.config.num_hidden_layers if medusa else first_trainable_layer(model)
    hidden = None
    seen = args.steps * args.batch_size * args.grad_accum
    if start > 0 and seen < len(train_set):
        # Caching every example costs more than the run's own steps would spend on them.
        logger.info(
            "Frozen-prefix cache skipped: the run sees %d examples, fewer than the %d it "
            "would cache",
            seen,
            len(train_set),
        )
        start = 0
    if start > 0:
        h = getattr(model, "feature_width", model.lm.config.hidden_size)
        gib = sum(len(e["input_ids"]) for e in train_set) * h * 4 / 2**30
        if gib > args.frozen_prefix_max_gib:
            logger.warning(
                "Frozen-prefix cache skipped: %.1f GiB > --frozen-prefix-max-gib %.1f",
                gib,
                args.frozen_prefix_max_gib,
            )
        else:
            t0 = time.monotonic()

            def compute():
                with autocast():  # the precision the layers would run in at every step
                    if medusa:
                        return model.final_hidden(train_set, progress=progress)
                    return prefix_hidden(model, train_set, start, progress=progress)

            # An EAGLE-3 drafter caches other states than Medusa heads' (its auxiliary layers).
            drafter = ("eagle3", model.aux_layer_ids) if isinstance(job, Eagle3Job) else ()
            key = cache_key(
                args.base, args.init_from, start, medusa, args.dtype, *drafter, encoded=train_set
            )
            hidden = load_or_compute(Path(args.out) / FROZEN_PREFIX_FILE, key, compute)
            logger.info(
                "Layers 0-%d are frozen: their output for %d examples cached (%.2f GiB, %.0f s)",
                start - 1,
                len(train_set),
                gib,
                time.monotonic() - t0,
            )

    device = next(model.parameters()).device

    def make(idx: list[int]) -> dict:
        return to_device(build(idx), device)

    def build(idx: list[int]) -> dict:
        examples = [train_set[i] for i in idx]
        rows = None if hidden is None else [hidden[i] for i in idx]
        if medusa or not args.pack:
            batch = collate(examples)
            if rows is not None:
                batch["hidden"] = pad_rows(rows)
                if not medusa:
                    batch["start_layer"] = start
            return batch
        return pack_batch(
            examples, args.max_length, model.config.num_streams, rows, start
        ).as_dict()

    return make


def train_step(
    job,
    optimizer,
    base_lrs: list[float],
    make_batch,
    num_examples: int,
    args,
    step: int,
    autocast,
    continued_at: int = 0,
) -> tuple[dict[str, float], int]:
    """One optimizer step (``grad_accum`` micro-batches); returns its metrics and the number
    of real (non-padding) tokens it trained on."""
    factor = lr_factor(step, args.warmup_steps, args.steps, continued_at)
    for g, base_lr in zip(optimizer.param_groups, base_lrs):
        g["lr"] = base_lr * factor
    totals: dict[str, float] = {}
    tokens = 0
    for micro in range(args.grad_accum):
        idx = batch_indices(
            num_examples, args.batch_size, step * args.grad_accum + micro, args.seed
        )
        batch = make_batch(idx)
        tokens += int(batch["attention_mask"].sum())
        with autocast():
            loss, metrics = job.loss(batch)
        (loss / args.grad_accum).backward()
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v / args.grad_accum
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return totals, tokens


def epoch_order(num_examples: int, epoch: int, seed: int) -> list[int]:
    """The order in which epoch ``epoch`` visits the examples (a permutation fixed by
    ``seed``): every example once before any repeats."""
    perm = list(range(num_examples))
    random.Random(seed * 100_003 + epoch).shuffle(perm)
    return perm


def batch_indices(num_examples: int, batch_size: int, micro_step: int, seed: int) -> list[int]:
    """Examples of micro-batch ``micro_step`` (:func:`epoch_order`), so a resumed or continued
    run sees exactly the batches an uninterrupted one would."""
    start = micro_step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_examples)
        out.extend(epoch_order(num_examples, epoch, seed)[offset : offset + batch_size - len(out)])
    return out


def seen_examples(num_examples: int, batch_size: int, micro_steps: int, seed: int) -> set[int]:
    """Indices of the examples the first ``micro_steps`` micro-batches trained on."""
    epochs, offset = divmod(micro_steps * batch_size, num_examples)
    if epochs:
        return set(range(num_examples))
    return set(epoch_order(num_examples, 0, seed)[:offset])


def lr_factor(step: int, warmup: int, total: int, continued_at: int = 0) -> float:
    """Linear warm-up, then cosine decay to 10% of the run's ``total`` steps; a run continued
    at ``continued_at`` (fresh optimizer moments) warms up again over ``warmup`` steps."""
    if step < warmup:
        factor = (step + 1) / warmup
    else:
        progress = (step - warmup) / max(1, total - warmup)
        factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    if continued_at and step - continued_at < warmup:
        factor *= (step - continued_at + 1) / warmup
    return factor


class SpecStreamJob:
    """LoRA + stream embeddings (objective "specstream") or LoRA alone ("ntp")."""

    def __init__(self, args: TrainArgs):
        self.args = args
        if args.objective == "prune":
            self.model = _pruning_model(args)
            return
        lora = None if args.objective == "streams-only" else args.lora
        self.model: SpecStreamModel = build_model(
            args.base, args.spec, lora, torch.float32, args.stream_init_std
        )
        if args.init_from:
            self._continue_from(Path(args.init_from))

    def _continue_from(self, adapter: Path) -> None:
        """Start from a trained adapter of the same settings (its LoRA and streams)."""
        trained = SpecStreamConfig.load(adapter)
        for name in ("num_streams", "num_msa_layers", "init_rank", "stream_lora_rank"):
            if getattr(trained, name) != getattr(self.args.spec, name):
                raise ConfigError(
                    f"--init-from {adapter}: its {name} is {getattr(trained, name)}, this run's "
                    f"{getattr(self.args.spec, name)}; train with the adapter's settings"
                )
        self.load_trainable(adapter)
        logger.info("Starting from the adapter %s", adapter)

    def loss(self, batch):
        return specstream_loss(self.model, batch, self.args.objective)

    def param_groups(self) -> list[dict]:
        model, args = self.model, self.args
        if args.objective == "prune":
            return [{"params": [model.prune_a, model.prune_b], "lr": args.lr, "weight_decay": 0.0}]
        named = [
            (n, p)
            for n, p in model.named_parameters()
            if p.requires_grad and n != "stream_embeddings"
        ]
        lora_lr = args.lr if args.lora_lr is None else args.lora_lr
        if lora_lr == args.lr:
            groups = [{"params": [p for _, p in named], "lr": args.lr, "weight_decay": 0.0}]
        else:
            # The main model's trainable parameters (its LoRA) are those of ``model.lm``, the
            # set ``main_trains`` reads; the stream tensors live on the wrapper.
            main = {id(p) for p in model.lm.parameters()}
            lora = [p for _, p in named if id(p) in main]
            other = [p for _, p in named if id(p) not in main]
            groups = [{"params": other, "lr": args.lr, "weight_decay": 0.0}]
            if lora_lr > 0:
                groups.append({"params": lora, "lr": lora_lr, "weight_decay": 0.0})
            else:
                # Frozen: the main stream then runs without autograd.
                for p in lora:
                    p.requires_grad_(False)
        if args.objective in STREAM_OBJECTIVES:
            groups.append(
                {"params": [model.stream_embeddings], "lr": args.stream_lr, "weight_decay": 0.0}
            )
        else:
            model.stream_embeddings.requires_grad_(False)
        return groups

    @torch.no_grad()
    def calibrate(self, batch: dict) -> None:
        """Scale the stream embeddings to ``stream_init_scale`` x the residual norm at L0."""
        if (
            self.args.objective not in STREAM_OBJECTIVES
            or self.args.stream_init_scale <= 0
            or self.args.init_from  # the adapter's streams are the start
        ):
            return
        model = self.model
        hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"]).msa_input
        # Skip position 0: the first token carries a huge "attention sink" activation.
        norms = hidden[:, 1:].norm(dim=-1)[batch["attention_mask"][:, 1:]]
        target = self.args.stream_init_scale * float(norms.median())
        p = model.stream_embeddings
        # Drawn on the CPU: the same initial streams whatever the device.
        noise = torch.randn(p.shape, dtype=p.dtype)
        p.copy_(noise.to(p.device) * target / p.shape[-1] ** 0.5)
        logger.info(
            "Stream embeddings initialised with norm ~%.1f (residual norm at layer %d: "
            "median %.1f)",
            target,
            model.first_msa_layer,
            float(norms.median()),
        )

    def log_extra(self) -> dict[str, float]:
        if self.args.objective == "prune":
            return {}
        return {"stream_norm": float(self.model.stream_embeddings.detach().norm(dim=-1).mean())}

    def save(self, out: Path) -> None:
        save_adapter(self.model, out)

    def load_trainable(self, ckpt: Path) -> None:
        from vllm_specstream.checkpoint.tensor_files import read_tensors
        from vllm_specstream.training.checkpoint import PEFT_WEIGHTS_FILE, STREAM_FILE

        load_stream_tensors(self.model, read_tensors(ckpt / STREAM_FILE))
        # A streams-only run's PEFT files are vLLM's null LoRA, not a model of its own.
        if (ckpt / PEFT_WEIGHTS_FILE).is_file() and hasattr(self.model.lm, "peft_config"):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model.lm, read_tensors(ckpt / PEFT_WEIGHTS_FILE))


def _pruning_model(args: TrainArgs) -> SpecStreamModel:
    """The adapter ``args.init_from`` with a fresh pruning adapter (``args.spec.prune``'s rank
    and threshold); everything but the pruning tensors frozen."""
    import dataclasses

    from vllm_specstream.training.checkpoint import load_adapter

    if not args.init_from:
        raise ConfigError("--objective prune needs --init-from ADAPTER_DIR (a trained adapter)")
    trained = load_adapter(args.init_from, base=args.base)
    prune = dataclasses.replace(args.spec.prune, enabled=True)
    config = dataclasses.replace(trained.config, prune=prune)
    model = SpecStreamModel(trained.lm, config)
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        for name, param in trained.stream_parameters().items():
            getattr(model, name).copy_(param)
    model.prune_a.requires_grad_(True)
    model.prune_b.requires_grad_(True)
    return model


class FrozenBaseJob:
    """A drafter trained on the frozen base model (Medusa heads, an EAGLE-3 drafter): the
    drafter (``self.model``) computes its own loss and writes its own checkpoint; only the
    parameters :meth:`trainable` names train, without weight decay."""

    args: TrainArgs

    def trainable(self) -> list[torch.nn.Parameter]:
        raise NotImplementedError

    def loss(self, batch):
        return self.model.loss(batch)

    def param_groups(self) -> list[dict]:
        return [{"params": self.trainable(), "lr": self.args.lr, "weight_decay": 0.0}]

    def calibrate(self, batch: dict) -> None:
        pass

    def log_extra(self) -> dict[str, float]:
        return {}

    def save(self, out: Path) -> None:
        self.model.save(out)

    def load_trainable(self, ckpt: Path) -> None:
        self.model.load_trainable(ckpt)


class MedusaJob(FrozenBaseJob):
    """Medusa heads on the frozen base model (the peer baseline)."""

    def __init__(self, args: TrainArgs):
        from vllm_specstream.training.checkpoint import load_base_lm
        from vllm_specstream.training.medusa import MedusaHeads

        self.args = args
        self.model = MedusaHeads(load_base_lm(args.base, torch.float32), args.medusa_heads)
        if args.init_from:
            self._continue_from(Path(args.init_from))

    def _continue_from(self, heads_dir: Path) -> None:
        """Start from trained heads (a directory this objective wrote) of the same count."""
        config = heads_dir / "config.json"
        try:
            num_heads = json.loads(config.read_text()).get("num_heads")
        except (OSError, ValueError) as e:
            raise ConfigError(f"--init-from {heads_dir}: not a Medusa checkpoint ({e})") from e
        if num_heads != self.args.medusa_heads:
            raise ConfigError(
                f"--init-from {heads_dir}: {config} has num_heads {num_heads}, this run "
                f"{self.args.medusa_heads}; pass --medusa-heads {num_heads}"
            )
        self.model.load_trainable(heads_dir)

    def trainable(self) -> list[torch.nn.Parameter]:
        return list(self.model.blocks.parameters())


class Eagle3Job(FrozenBaseJob):
    """An EAGLE-3 drafter on the frozen base model (a peer baseline): its draft vocabulary
    is the training answers' most frequent tokens."""

    def __init__(self, args: TrainArgs, train_set: list[dict]):
        from vllm_specstream.training.checkpoint import load_base_lm
        from vllm_specstream.training.eagle3 import (
            Eagle3Drafter,
            answer_token_counts,
            draft_vocab_ids,
        )

        self.args = args
        lm = load_base_lm(args.base, torch.float32)
        settings = args.eagle3
        if args.init_from:
            settings = self._settings_of(Path(args.init_from))
        ids = draft_vocab_ids(
            answer_token_counts(train_set), lm.config.vocab_size, settings.draft_vocab_size
        )
        self.model = Eagle3Drafter(lm, settings, ids)
        if args.init_from:
            self.model.load_trainable(args.init_from)
            logger.info("Starting from the EAGLE-3 drafter %s", args.init_from)

    def _settings_of(self, drafter_dir: Path) -> Eagle3Config:
        """A trained drafter's settings, which must be this run's (but for the unroll)."""
        import dataclasses

        from vllm_specstream.training.eagle3 import read_settings

        trained = read_settings(drafter_dir)
        ours = self.args.eagle3
        if ours.draft_vocab_size != trained.draft_vocab_size:
            raise ConfigError(
                f"--init-from {drafter_dir}: its draft_vocab_size is "
                f"{trained.draft_vocab_size}, this run's {ours.draft_vocab_size}; pass "
                f"--draft-vocab-size {trained.draft_vocab_size}"
            )
        if ours.aux_layer_ids is not None and tuple(ours.aux_layer_ids) != trained.aux_layer_ids:
            raise ConfigError(
                f"--init-from {drafter_dir}: its aux_layer_ids are {list(trained.aux_layer_ids)}, "
                f"this run's {list(ours.aux_layer_ids)}; train with the drafter's"
            )
        return dataclasses.replace(
            trained, ttt_steps=ours.ttt_steps, ttt_step_weight=ours.ttt_step_weight
        )

    def trainable(self) -> list[torch.nn.Parameter]:
        return list(self.model.trainable().values())


def make_job(args: TrainArgs, train_set: list[dict] | None = None):
    """The job of ``args.objective`` (``train_set``: the encoded training examples, which
    choose an EAGLE-3 drafter's vocabulary)."""
    if args.objective not in OBJECTIVES:
        raise ValueError(f"--objective must be one of {OBJECTIVES}, got {args.objective!r}")
    if args.objective == "medusa":
        return MedusaJob(args)
    if args.objective == "eagle3":
        return Eagle3Job(args, train_set or [])
    return SpecStreamJob(args)


@torch.no_grad()
def evaluate(job, encoded: list[dict], args: TrainArgs, autocast) -> dict[str, float]:
    """Mean loss and per-stream (per-head) top-1 accuracy over the held-out examples."""
    job.model.eval()
    device = next(job.model.parameters()).device
    sums: dict[str, float] = {}
    batches = 0
    for i in range(0, len(encoded), args.batch_size):
        with autocast():
            _, metrics = job.loss(to_device(collate(encoded[i : i + args.batch_size]), device))
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        batches += 1
    job.model.train()
    return {f"eval_{k}": v / max(1, batches) for k, v in sums.items()}


def _save_checkpoint(
    job,
    optimizer,
    step: int,
    out: Path,
    continued_at: int = 0,
    segments: tuple[dict, ...] | list[dict] = (),
) -> None:
    """Trainable weights + optimizer state in ``out/checkpoint`` (written aside, then swapped
    in), with the processes that trained it so far (``segments``: a run killed before it
    wrote its progress file resumes with them)."""
    state = {
        "step": step,
        "continued_at": continued_at,
        "segments": list(segments),
        "optimizer": optimizer.state_dict(),
    }
    with new_dir(out / CHECKPOINT_DIR) as tmp:
        job.save(tmp)
        torch.save(state, tmp / STATE_FILE)


def _resume(job, optimizer, out: Path) -> tuple[int, int, list[dict] | None]:
    """Load ``out/checkpoint`` if present; return the step to continue from, the step at
    which the run last continued from an adapter (0: never) and the processes that trained
    it (None: not recorded in the checkpoint)."""
    ckpt = out / CHECKPOINT_DIR
    if not (ckpt / STATE_FILE).is_file():
        return 0, 0, None
    job.load_trainable(ckpt)
    # Optimizer state follows its parameters' device (a run may resume on another one).
    state = torch.load(ckpt / STATE_FILE, weights_only=True, map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])
    _keep_log(out / LOG_FILE, state["step"])
    logger.info("Resuming from %s at step %d", ckpt, state["step"])
    return int(state["step"]), int(state.get("continued_at", 0)), state.get("segments")


def _keep_log(log: Path, step: int) -> None:
    """Drop the records of steps after ``step`` (they will run again)."""
    if log.is_file():
        kept = [x for x in log.read_text().splitlines() if json.loads(x)["step"] <= step]
        write_text(log, "".join(x + "\n" for x in kept))


def _continue_chain(job, args: TrainArgs, num_examples: int) -> int:
    """Load the unfinished run's adapter ``args.continue_from`` after checking that it was
    trained with this run's settings and data; copy its log; return its step."""
    src = Path(args.continue_from)
    flag = f"--continue-from {src}"
    try:
        progress = json.loads((src / PROGRESS_FILE).read_text())
        before = json.loads((src / "train_args.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{flag}: not the adapter of an unfinished run ({e}); it must hold "
            f"{PROGRESS_FILE} and train_args.json as `specstream train --max-minutes` writes them"
        ) from None
    now = json.loads(json.dumps(asdict(args), default=str))
    for settings in (before, now):  # the base may lie elsewhere on another machine
        (settings.get("spec") or {}).pop("base_model", None)
    for name in CHAIN_FIELDS:
        if before.get(name) != now.get(name):
            raise ConfigError(
                f"{flag}: it was trained with {name}={before.get(name)!r}, this run has "
                f"{now.get(name)!r}; continue with the adapter's settings (its train_args.json)"
            )
    if progress["train_examples"] != num_examples:
        raise ConfigError(
            f"{flag}: it trained on {progress['train_examples']} examples of "
            f"{before.get('data')}, --data {args.data} gives {num_examples}; continue on the "
            "same file"
        )
    step = int(progress["step"])
    if step >= args.steps:
        raise ConfigError(f"{flag}: it is finished ({step} of {args.steps} steps)")
    job.load_trainable(src)
    log = Path(args.out) / LOG_FILE
    if (src / LOG_FILE).is_file():
        log.write_text((src / LOG_FILE).read_text())
        _keep_log(log, step)
    logger.info("Continuing %s at step %d of %d", src, step, args.steps)
    return step


def _earlier_segments(args: TrainArgs, start: int) -> list[dict]:
    """The processes that trained this run's steps before ``start`` (from ``out``'s progress
    file, or that of the adapter it continues)."""
    sources = [Path(args.out)] + ([Path(args.continue_from)] if args.continue_from else [])
    for src in sources:
        try:
            segments = json.loads((src / PROGRESS_FILE).read_text())["segments"]
        except (OSError, ValueError, KeyError):
            continue
        return [x for x in segments if x["to"] <= start]
    return []


def _write_progress(
    out: Path,
    args: TrainArgs,
    step: int,
    continued_at: int,
    prompts: list[str],
    segments: list[dict],
) -> dict:
    """``train_state.json``: how far the run got, what it has trained on (an example is a
    prompt and one reference: E2E has several references per meaning representation) and
    the processes that trained it (steps, tokens, seconds, machine)."""
    micro = step * args.grad_accum
    seen = seen_examples(len(prompts), args.batch_size, micro, args.seed)
    progress = {
        "step": step,
        "steps": args.steps,
        "continued_at": continued_at,
        "examples_seen": micro * args.batch_size,
        "train_examples": len(prompts),
        "distinct_examples": len(seen),
        "distinct_prompts": len({prompts[i] for i in seen}),
        "train_prompts": len(set(prompts)),
        "segments": segments,
    }
    write_text(out / PROGRESS_FILE, json.dumps(progress, indent=2) + "\n")
    return progress


def train(args: TrainArgs, progress: bool = True) -> Path:
    """Run (or resume) training; return the adapter checkpoint directory."""
    from contextlib import nullcontext

    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import encode_example, prompt_key

    out = Path(args.out)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if dtype == torch.bfloat16
        else nullcontext
    )
    tokenizer = AutoTokenizer.from_pretrained(check_model_dir(args.base), local_files_only=True)
    examples = load_examples(args, "train", args.num_train)
    train_set = [encode_example(tokenizer, e, args.max_length) for e in examples]
    prompts = [prompt_key(e.messages) for e in examples]
    del examples
    eval_set = [
        encode_example(tokenizer, e, args.max_length)
        for e in load_examples(args, "test", args.num_eval)
    ]
    if not train_set:
        raise ValueError(f"no training examples (task={args.task!r}, data={args.data!r})")
    out.mkdir(parents=True, exist_ok=True)  # once the data and base are known to be usable
    job = make_job(args, train_set)
    if dtype == torch.bfloat16:
        cast_frozen_linears(job.model, dtype)
    job.model.to(device)
    job.model.train()
    optimizer = torch.optim.AdamW(job.param_groups(), betas=(0.9, 0.99))
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    start, continued_at, segments = _resume(job, optimizer, out)
    if start == 0 and args.continue_from:
        start = continued_at = _continue_chain(job, args, len(train_set))
    if segments is None:
        segments = _earlier_segments(args, start)
    if start >= args.steps:  # e.g. a script run again: never relabel a longer run's state
        logger.info("%s is trained to step %d >= --steps %d: nothing to do", out, start, args.steps)
        return out
    make_batch = batch_maker(job, args, train_set, autocast, progress)
    if start == 0:
        first = [train_set[i] for i in batch_indices(len(train_set), args.batch_size, 0, args.seed)]
        with autocast():  # the precision of the steps (frozen weights may be bf16)
            job.calibrate(to_device(collate(first), device))
    machine = describe_device(device)
    record = {**asdict(args), "trained_on": machine}
    (out / "train_args.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    n_trainable = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    logger.info(
        "Training %s on %d examples (%d held out): %d trainable parameters, %s on %s, "
        "%d steps x %d x %d",
        args.objective,
        len(train_set),
        len(eval_set),
        n_trainable,
        dtype,
        device,
        args.steps,
        args.batch_size,
        args.grad_accum,
    )
    bar = tqdm(
        total=args.steps, initial=start, desc=f"train {args.objective}", disable=not progress
    )
    log = open(out / LOG_FILE, "a")  # noqa: SIM115 (one handle for the whole run)
    started = time.monotonic()
    run_tokens = 0
    step = start

    def this_segment(to: int) -> dict:
        seconds = round(time.monotonic() - started, 1)
        return {
            "from": start,
            "to": to,
            "tokens": run_tokens,
            "seconds": seconds,
            "trained_on": machine,
        }

    try:
        for step in range(start, args.steps):
            totals, tokens = train_step(
                job,
                optimizer,
                base_lrs,
                make_batch,
                len(train_set),
                args,
                step,
                autocast,
                continued_at,
            )
            record = {
                "step": step + 1,
                "tokens": tokens,
                "lr": optimizer.param_groups[0]["lr"],
                **totals,
                **job.log_extra(),
                "elapsed_s": round(time.monotonic() - started, 1),
            }
            periodic = args.eval_every > 0 and (step + 1) % args.eval_every == 0
            if eval_set and (periodic or step + 1 == args.steps):
                record.update(evaluate(job, eval_set, args, autocast))
                logger.info(
                    "step %d: %s",
                    step + 1,
                    {k: round(v, 4) for k, v in record.items() if k.startswith("eval_")},
                )
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.update()
            run_tokens += tokens
            shown = ("loss", "top1_main", "top1_stream1", "top1_step1")
            postfix = {k: f"{v:.3f}" for k, v in totals.items() if k in shown}
            postfix["tok/s"] = f"{run_tokens / max(1e-9, time.monotonic() - started):.0f}"
            bar.set_postfix(postfix)
            out_of_time = (
                args.max_minutes is not None and time.monotonic() - started >= 60 * args.max_minutes
            )
            if out_of_time:
                break
            if (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                so_far = [*segments, this_segment(step + 1)]
                _save_checkpoint(job, optimizer, step + 1, out, continued_at, so_far)
    finally:
        bar.close()
        log.close()
    done = step + 1
    job.save(out)
    segments.append(this_segment(done))
    _save_checkpoint(job, optimizer, done, out, continued_at, segments)
    reached = _write_progress(out, args, done, continued_at, prompts, segments)
    if done < args.steps:
        logger.info(
            "Stopped after --max-minutes %g at step %d of %d (%d examples seen, %d distinct): "
            "the adapter in %s is usable as it stands; run the same command to continue, or "
            "--continue-from that adapter (the same settings) to continue elsewhere",
            args.max_minutes,
            done,
            args.steps,
            reached["examples_seen"],
            reached["distinct_examples"],
            out,
        )
        return out
    (out / FROZEN_PREFIX_FILE).unlink(missing_ok=True)  # only a resumed run needs it
    logger.info("Adapter saved to %s (%.0f s)", out, time.monotonic() - started)
    return out
