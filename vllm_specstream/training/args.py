"""A training run's settings (``specstream train``'s flags), saved as ``train_args.json``."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_specstream.checkpoint.config import SpecStreamConfig
from vllm_specstream.training.checkpoint import LoraSettings
from vllm_specstream.training.eagle3 import Eagle3Config
from vllm_specstream.training.tasks.holdout import DEFAULT_VAL_FRACTION
from vllm_specstream.training.tasks.sql_rename import DEFAULT_RENAME_RATE

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
