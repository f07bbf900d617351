"""What a run trains, by objective: its model, loss, parameter groups and saved files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_specstream.checkpoint.config import ConfigError, SpecStreamConfig
from vllm_specstream.logger import init_logger
from vllm_specstream.training.args import OBJECTIVES, STREAM_OBJECTIVES, TrainArgs
from vllm_specstream.training.checkpoint import build_model, load_stream_tensors, save_adapter
from vllm_specstream.training.eagle3 import Eagle3Config
from vllm_specstream.training.loss import specstream_loss
from vllm_specstream.training.model import SpecStreamModel

logger = init_logger(__name__)


class SpecStreamJob:
    """LoRA + stream embeddings (objective "specstream") or LoRA alone ("ntp")."""

    #: The base model trains too (its LoRA): only the layers below the lowest trainable one
    #: can be cached.
    frozen_base = False
    cache_tag: tuple = ()

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
    #: The whole base is frozen: its outputs can be cached (``cache_tag`` names which).
    frozen_base = True
    cache_tag: tuple = ()

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

    @property
    def cache_tag(self) -> tuple:
        """An EAGLE-3 drafter caches other states than Medusa heads' (its auxiliary layers)."""
        return ("eagle3", self.model.aux_layer_ids)

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
