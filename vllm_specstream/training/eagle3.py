"""EAGLE-3 drafters (Li et al., 2025) on a frozen Llama-family target: the second peer baseline.

The drafter reads the target's *auxiliary* hidden states (the residual stream entering a
few of its decoder layers, concatenated and fused by ``fc``), adds one decoder layer whose
attention input is ``[input_layernorm(embedding) ; hidden_norm(hidden)]`` (2 x hidden wide),
and predicts over a *draft vocabulary* (the most frequent answer tokens). It is trained by
*training-time test*: the layer is unrolled ``ttt_steps`` times, each step feeding its own
pre-norm output back as the next step's hidden state, as vLLM does when it drafts, with
forward KL to the target's distribution over the draft vocabulary at every step.

Alignment (vLLM 0.32, ``v1/spec_decode/llm_base_proposer.py``): draft slot ``j`` gets the
target's auxiliary states at ``j``, the token ``x[j+1]`` and RoPE position ``j``, and
predicts ``x[j+2]``; step ``k`` of the unroll feeds ``x[j+1+k]`` at position ``j+k`` and
predicts ``x[j+2+k]``. Saved in the plain EAGLE format vLLM's ``eagle3`` method loads
(``LlamaForCausalLMEagle3``: ``midlayer.*`` names, ``d2t``/``t2d``; the drafter shares the
target's token embedding, which it does not store).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.checkpoint.tensor_files import read_tensors
from vllm_specstream.safe_write import files_into

Tensor = torch.Tensor

#: The architecture vLLM 0.32 resolves to its ``Eagle3LlamaForCausalLM`` drafter.
ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: Fields of the target's config the drafter's single Llama layer copies.
LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
)


@dataclass
class Eagle3Config:
    """The drafter's settings (``specstream train --objective eagle3``); all are written to
    its ``config.json``, the norm flags explicitly, as vLLM reads them."""

    aux_layer_ids: tuple[int, ...] | None = None
    """Target layers whose input feeds the drafter: id ``i`` is the residual stream entering
    decoder layer ``i`` (Hugging Face ``hidden_states[i]``), ``0 <= i < L``; concatenated in
    ascending order. None: vLLM's default ``(2, L // 2, L - 3)`` for a target of ``L`` layers
    ((2, 15, 27) for SmolLM2-135M)."""
    draft_vocab_size: int = 8192
    """Tokens the drafter can propose: the most frequent tokens of the training answers
    (ties and a shortfall filled by the lowest ids), sorted by id."""
    ttt_steps: int = 3
    """Steps of the training-time-test unroll (drafts trained per position)."""
    ttt_step_weight: float = 1.0
    """Weight of step ``k``'s loss is ``ttt_step_weight ** k`` (EAGLE-3 uses 0.8,
    speculators 1.0); the loss is the weighted mean over steps."""
    norm_before_residual: bool = False
    """Normalise the incoming hidden state before it becomes the layer's residual (vLLM's
    default for this format: after)."""
    norm_before_fc: bool = False
    """An RMSNorm over the concatenated auxiliary states before ``fc``."""
    norm_output: bool = False
    """Feed the *normed* output back as the next step's hidden state (default: pre-norm)."""

    def __post_init__(self) -> None:
        if self.ttt_steps < 1 or self.draft_vocab_size < 1 or not self.ttt_step_weight > 0:
            raise ConfigError(
                f"eagle3: ttt_steps {self.ttt_steps}, draft_vocab_size "
                f"{self.draft_vocab_size} and ttt_step_weight {self.ttt_step_weight} must be "
                "positive, e.g. --ttt-steps 3 --draft-vocab-size 8192"
            )

    def resolved_aux_layer_ids(self, num_layers: int) -> tuple[int, ...]:
        ids = self.aux_layer_ids
        if ids is None:
            ids = default_aux_layer_ids(num_layers)
        ids = tuple(sorted(set(int(i) for i in ids)))
        if not ids or ids[0] < 0 or ids[-1] >= num_layers:
            raise ConfigError(
                f"eagle3 aux_layer_ids {list(ids)}: each must be a layer of the target "
                f"(0 <= id < {num_layers}), e.g. {list(default_aux_layer_ids(num_layers))}"
            )
        return ids


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default auxiliary layers ``(2, L // 2, L - 3)``, sorted, without repeats and
    within ``[0, L)`` (a target of fewer than 6 layers has fewer distinct ones)."""
    ids = {2, num_layers // 2, num_layers - 3}
    return tuple(sorted(i for i in ids if 0 <= i < num_layers))


# ----------------------------------------------------------------------- pure functions


def draft_vocab_ids(counts: Counter, vocab_size: int, size: int) -> Tensor:
    """The draft vocabulary: the ``size`` most frequent token ids of ``counts`` (ties to the
    lower id), filled up with the lowest unused ids, sorted ascending (``int64 [size]``)."""
    if not 0 < size <= vocab_size:
        raise ConfigError(
            f"eagle3 draft_vocab_size {size}: must be in 1..{vocab_size} (the target's "
            "vocabulary), e.g. 8192"
        )
    ranked = sorted((t for t in counts if 0 <= t < vocab_size), key=lambda t: (-counts[t], t))
    chosen = set(ranked[:size])
    filler = (t for t in range(vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def d2t_t2d(draft_ids: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """vLLM's vocabulary maps: ``d2t[d] = target_id - d`` (``int64 [DV]``: the target id of
    draft id ``d`` is ``d + d2t[d]``) and ``t2d`` (``bool [V]``: True at the draft tokens)."""
    d2t = draft_ids.long() - torch.arange(len(draft_ids), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def target_ids_of(d2t: Tensor) -> Tensor:
    """The target id of every draft id (the inverse of :func:`d2t_t2d`)."""
    return torch.arange(len(d2t), dtype=torch.long) + d2t.long()


def ttt_attention_mask(valid: Tensor, step: int) -> Tensor:
    """Which keys each query sees at unroll step ``step`` (``bool [B, T, (step + 1) * T]``).

    Keys are laid out step by step: ``[step 0's T keys | step 1's | ... | step ``step``'s]``.
    Query ``j`` sees step 0's keys ``i <= j`` of real tokens (``valid [B, T]``; its own always)
    and, from each later step, only key ``j``: the drafts of its own chain, as vLLM's draft
    KV cache holds them when it drafts ``step`` tokens ahead of position ``j``."""
    b, t = valid.shape
    idx = torch.arange(t, device=valid.device)
    causal = idx[None, :] <= idx[:, None]
    own = idx[None, :] == idx[:, None]
    first = causal[None] & (valid[:, None, :] | own[None])
    later = own[None].expand(b, t, t)
    return torch.cat([first] + [later] * step, dim=-1)


def shift_left(x: Tensor, n: int, fill: float | int = 0) -> Tensor:
    """``x[:, n:]`` padded on the right with ``fill`` to the same length (dim 1)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def forward_kl(target_logits: Tensor, draft_logits: Tensor) -> Tensor:
    """Per row, ``KL(p || q)`` with ``p = softmax(target_logits)`` (the teacher) and
    ``q = softmax(draft_logits)``, over the same (draft) vocabulary."""
    log_p = F.log_softmax(target_logits.float(), dim=-1)
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


# ----------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in fp32, scaled by ``weight`` in the input's precision."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Eagle3Attention(nn.Module):
    """Grouped-query attention of the draft layer; its input is ``2 * hidden`` wide."""

    def __init__(self, cfg) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], cache: list[tuple[Tensor, Tensor]], mask
    ) -> Tensor:
        """``x [B, T, 2h]``; this step's keys/values are appended to ``cache`` (one entry per
        unroll step) and the queries attend to all of them under ``mask [B, T, S*T]``."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, t, _ = x.shape

        def heads(proj: nn.Linear, n: int) -> Tensor:
            return proj(x).view(b, t, n, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj, self.num_heads)
        k = heads(self.k_proj, self.num_kv_heads)
        v = heads(self.v_proj, self.num_kv_heads)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        cache.append((k, v))
        group = self.num_heads // self.num_kv_heads
        keys = torch.cat([c[0] for c in cache], dim=2).repeat_interleave(group, dim=1)
        values = torch.cat([c[1] for c in cache], dim=2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The drafter's decoder layer (``midlayer``), as vLLM's ``llama_eagle3`` computes it."""

    def __init__(self, cfg, norm_before_residual: bool) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(h, eps=eps)  # of the token embedding
        self.hidden_norm = RMSNorm(h, eps=eps)  # of the incoming hidden state
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds: Tensor, hidden: Tensor, rope, cache, mask) -> Tensor:
        """The layer's pre-norm output ``[B, T, h]``."""
        if self.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        h = residual + self.self_attn(x, rope, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def drafter_layer_config(target_config):
    """The ``LlamaConfig`` of the drafter's one layer: the target's shapes and RoPE, no
    biases (whatever the target's)."""
    from transformers import LlamaConfig

    fields = {k: getattr(target_config, k) for k in LAYER_FIELDS if hasattr(target_config, k)}
    fields.setdefault("head_dim", target_config.hidden_size // target_config.num_attention_heads)
    if fields.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"eagle3: the target's hidden_act is {fields['hidden_act']!r}; the drafter's "
            "Llama layer needs a silu target (a Llama-family model)"
        )
    fields.update(attention_bias=False, mlp_bias=False)
    return LlamaConfig(**fields, num_hidden_layers=1, tie_word_embeddings=False)


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter (trainable) on a frozen causal LM ``lm`` (the target)."""

    def __init__(self, lm: nn.Module, settings: Eagle3Config, draft_ids: Tensor) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.lm = lm
        for p in lm.parameters():
            p.requires_grad_(False)
        cfg = lm.config
        self.settings = settings
        self.aux_layer_ids = settings.resolved_aux_layer_ids(cfg.num_hidden_layers)
        self.layer_config = drafter_layer_config(cfg)
        h, n = cfg.hidden_size, len(self.aux_layer_ids)
        self.register_buffer("draft_ids", draft_ids.long().clone(), persistent=False)
        if settings.norm_before_fc:
            self.input_norm = RMSNorm(n * h, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(n * h, h, bias=False)
        self.midlayer = Eagle3Layer(self.layer_config, settings.norm_before_residual)
        self.norm = RMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, len(draft_ids), bias=False)
        self.rotary = LlamaRotaryEmbedding(self.layer_config)
        with torch.no_grad():  # the target's LM head rows of the draft vocabulary
            self.lm_head.weight.copy_(lm.get_output_embeddings().weight[self.draft_ids].float())

    @property
    def draft_vocab_size(self) -> int:
        return len(self.draft_ids)

    @property
    def feature_width(self) -> int:
        """Width of :meth:`target_features` rows: the auxiliary states and the final state."""
        return (len(self.aux_layer_ids) + 1) * self.lm.config.hidden_size

    def trainable(self) -> dict[str, nn.Parameter]:
        """The drafter's own parameters (names as saved), not the target's."""
        return {n: p for n, p in self.named_parameters() if not n.startswith("lm.")}

    @torch.no_grad()
    def target_features(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``[B, T, (n + 1) h]``: the target's auxiliary states (ascending layer ids) and its
        final (normed) hidden state, from which its logits over the draft vocabulary follow."""
        out = self.lm.model(
            input_ids=ids, attention_mask=attention_mask.long(), output_hidden_states=True
        )
        states = [out.hidden_states[i] for i in self.aux_layer_ids]
        return torch.cat([*states, out.last_hidden_state], dim=-1)

    def unroll(self, aux: Tensor, ids: Tensor, valid: Tensor) -> list[Tensor]:
        """Draft logits ``[B, T, DV]`` of every unroll step (teacher forcing: step ``k``'s
        input token at slot ``j`` is ``ids[j+1+k]``; its hidden state the step before's)."""
        b, t = ids.shape
        s = self.settings
        if s.norm_before_fc:
            aux = self.input_norm(aux)
        hidden = self.fc(aux)
        embed = self.lm.get_input_embeddings()
        cache: list[tuple[Tensor, Tensor]] = []
        logits = []
        for k in range(s.ttt_steps):
            tokens = shift_left(ids, k + 1)
            positions = (torch.arange(t, device=ids.device) + k).expand(b, t)
            embeds = embed(tokens)
            rope = self.rotary(hidden, positions)
            mask = ttt_attention_mask(valid, k)
            out = self.midlayer(embeds, hidden, rope, cache, mask)
            normed = self.norm(out)
            logits.append(self.lm_head(normed))
            hidden = normed if s.norm_output else out
        return logits

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """Weighted mean over unroll steps of the forward KL to the target's distribution
        over the draft vocabulary, on answer tokens (``labels_mask``) only.

        ``batch["hidden"]``, when given, holds :meth:`target_features` computed once per
        example instead of at every step."""
        ids, valid = batch["input_ids"], batch["attention_mask"].bool()
        labels = batch["labels_mask"].bool() & valid
        features = batch.get("hidden")
        if features is None:
            features = self.target_features(ids, valid)
        width = len(self.aux_layer_ids) * self.lm.config.hidden_size
        aux, final = features[..., :width], features[..., width:]
        with torch.no_grad():
            head = self.lm.get_output_embeddings().weight[self.draft_ids]
            target = F.linear(final.to(head.dtype), head)  # [B, T, DV]
        to_target = self.draft_ids
        total, weights, metrics = 0.0, 0.0, {}
        t = ids.shape[1]
        for k, logits in enumerate(self.unroll(aux, ids, valid)):
            n = t - 2 - k  # slots whose predicted token x[j+2+k] exists
            if n <= 0:
                break
            mask = labels[:, 2 + k :]
            rows_q = logits[:, :n][mask]
            rows_p = target[:, 1 + k : 1 + k + n][mask]
            if rows_q.shape[0] == 0:
                continue
            loss = forward_kl(rows_p, rows_q).mean()
            w = self.settings.ttt_step_weight**k
            total = total + w * loss
            weights += w
            drafted = to_target[rows_q.argmax(-1)]
            metrics[f"loss_step{k + 1}"] = float(loss.detach())
            metrics[f"top1_step{k + 1}"] = float((drafted == ids[:, 2 + k :][mask]).float().mean())
        if weights == 0:
            zero = sum(p.sum() for p in self.trainable().values()) * 0.0
            return zero, {"loss": 0.0}
        total = total / weights
        metrics["loss"] = float(total.detach())
        return total, metrics

    @torch.no_grad()
    def final_hidden(
        self, encoded: list[dict], batch_size: int = 8, progress: bool = False
    ) -> list[Tensor]:
        """Per example, :meth:`target_features` ``[T_i, (n + 1) h]`` (the frozen target's
        whole contribution, cached once per run)."""
        from vllm_specstream.training.fast_batches import per_example_hidden

        device = self.fc.weight.device

        def run(ids: Tensor, lengths: list[int]) -> Tensor:
            ids = ids.to(device)
            positions = torch.arange(ids.shape[1], device=device)
            mask = positions < torch.tensor(lengths, device=device)[:, None]
            return self.target_features(ids, mask)

        return per_example_hidden(encoded, run, batch_size, "cache the target's states", progress)

    def extra_params(self) -> int:
        return sum(p.numel() for p in self.trainable().values())

    # ---------------------------------------------------------------- checkpoint format

    def config_dict(self, dtype: torch.dtype = torch.float32) -> dict:
        """``config.json`` as vLLM's ``eagle3`` method reads it (plain EAGLE format)."""
        cfg = self.lm.config
        s = self.settings
        layer = {k: v for k, v in self.layer_config.to_dict().items() if k in LAYER_FIELDS}
        name = str(dtype).removeprefix("torch.")
        return {
            **layer,
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": cfg.hidden_size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            "norm_before_residual": s.norm_before_residual,
            "norm_before_fc": s.norm_before_fc,
            "fc_norm": False,
            "norm_output": s.norm_output,
            "ttt_steps": s.ttt_steps,
            "ttt_step_weight": s.ttt_step_weight,
            "torch_dtype": name,
            "dtype": name,
        }

    def state_tensors(self, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        """``model.safetensors``: the drafter's weights (names as vLLM maps them), ``d2t``
        (int64) and ``t2d`` (bool)."""
        tensors = {n: p.detach().to("cpu", dtype).contiguous() for n, p in self.trainable().items()}
        d2t, t2d = d2t_t2d(self.draft_ids.cpu(), self.lm.config.vocab_size)
        tensors["d2t"], tensors["t2d"] = d2t, t2d
        return tensors

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
        """Write the drafter into ``out_dir`` (each file written beside it and renamed into
        place: a training run's directory also holds its records)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        with files_into(out) as tmp:
            save_file(self.state_tensors(dtype), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            text = json.dumps(self.config_dict(dtype), indent=2) + "\n"
            (tmp / CONFIG_FILE).write_text(text)
        return out

    def load_trainable(self, ckpt: str | Path) -> None:
        """Load a drafter this class saved (same target shapes and draft vocabulary size)."""
        path = Path(ckpt) / WEIGHTS_FILE
        tensors = read_tensors(path)
        params = self.trainable()
        missing = sorted(set(params) - set(tensors))
        if missing:
            raise ConfigError(f"{path}: not an EAGLE-3 drafter of these settings: lacks {missing}")
        with torch.no_grad():
            for name, p in params.items():
                if tuple(tensors[name].shape) != tuple(p.shape):
                    raise ConfigError(
                        f"{path}: {name} has shape {tuple(tensors[name].shape)}, this drafter "
                        f"{tuple(p.shape)}; train with the checkpoint's settings"
                    )
                p.copy_(tensors[name].to(p.dtype))
            self.draft_ids.copy_(target_ids_of(tensors["d2t"]).to(self.draft_ids.device))


def answer_token_counts(encoded: Iterable[dict]) -> Counter:
    """Counts of the answer tokens (``labels_mask``) of encoded examples."""
    counts: Counter = Counter()
    for e in encoded:
        counts.update(t for t, m in zip(e["input_ids"], e["labels_mask"]) if m)
    return counts


def read_settings(drafter_dir: str | Path) -> Eagle3Config:
    """The settings a saved drafter was trained with (from its ``config.json``)."""
    path = Path(drafter_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{drafter_dir}: not an EAGLE-3 drafter ({e})") from None
    if config.get("architectures") != [ARCHITECTURE]:
        raise ConfigError(
            f"{path}: architectures {config.get('architectures')}, not [{ARCHITECTURE!r}] "
            "(a drafter written by `specstream train --objective eagle3`)"
        )
    settings = Eagle3Config(
        aux_layer_ids=tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        draft_vocab_size=int(config["draft_vocab_size"]),
        ttt_steps=int(config.get("ttt_steps", 3)),
        ttt_step_weight=float(config.get("ttt_step_weight", 1.0)),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        norm_output=bool(config.get("norm_output", False)),
    )
    return settings
