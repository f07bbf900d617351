"""Medusa heads (Cai et al., 2024) on a frozen model: the peer baseline for benchmarks.

Head ``j`` (0-based) maps the target's final hidden state at ``t`` through residual blocks
``x + SiLU(W x)`` and the target's own LM head to the token ``t + 2 + j``, as vLLM's
``medusa`` method computes it. Saved in the layout vLLM 0.32's ``MedusaModel`` loads
(``config.json`` with ``model_type: medusa``; ``blocks.{j}.layers.{l}.weight``; one shared
``lm_head.weight`` with ``original_lm_head: true``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from vllm_specstream.checkpoint.tensor_files import read_tensors

Tensor = torch.Tensor


class MedusaHeads(nn.Module):
    """Trainable Medusa heads on a frozen causal LM."""

    def __init__(self, lm: nn.Module, num_heads: int, num_layers: int = 1):
        super().__init__()
        self.lm = lm
        for p in lm.parameters():
            p.requires_grad_(False)
        h = lm.config.hidden_size
        # Zero-initialised blocks start every head as a copy of the next-token head.
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(num_layers))
            for _ in range(num_heads)
        )
        for block in self.blocks:
            for layer in block:
                nn.init.zeros_(layer.weight)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def head_hidden(self, hidden: Tensor, j: int) -> Tensor:
        for layer in self.blocks[j]:
            hidden = hidden + F.silu(layer(hidden))
        return hidden

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """Mean over heads of the cross-entropy on completion targets ``t + 2 + j``.

        ``batch["hidden"]``, when given, is the frozen model's final hidden state computed
        once per example (:meth:`final_hidden`) instead of at every step."""
        ids, labels = batch["input_ids"], batch["labels_mask"]
        hidden = batch.get("hidden")
        if hidden is None:
            with torch.no_grad():
                hidden = self.lm.model(
                    input_ids=ids, attention_mask=batch["attention_mask"].long()
                ).last_hidden_state
        lm_head = self.lm.lm_head
        total, metrics = 0.0, {}
        for j in range(self.num_heads):
            shift = j + 2
            valid = labels[:, shift:]
            rows = hidden[:, :-shift][valid]
            targets = ids[:, shift:][valid]
            logits = lm_head(self.head_hidden(rows, j)).float()
            loss = F.cross_entropy(logits, targets)
            total = total + loss
            metrics[f"loss_head{j + 1}"] = float(loss.detach())
            metrics[f"top1_head{j + 1}"] = float((logits.argmax(-1) == targets).float().mean())
        total = total / self.num_heads
        metrics["loss"] = float(total.detach())
        return total, metrics

    @torch.no_grad()
    def final_hidden(
        self, encoded: list[dict], batch_size: int = 8, progress: bool = False
    ) -> list[Tensor]:
        """Per example, the frozen model's final hidden state ``[T_i, h]`` (after the norm)."""
        from vllm_specstream.training.fast_batches import per_example_hidden

        device = self.lm.lm_head.weight.device

        def run(ids: Tensor, lengths: list[int]) -> Tensor:
            ids = ids.to(device)
            mask = (
                torch.arange(ids.shape[1], device=device)
                < torch.tensor(lengths, device=device)[:, None]
            )
            return self.lm.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state

        return per_example_hidden(encoded, run, batch_size, "cache the frozen model", progress)

    def extra_params(self) -> int:
        return sum(p.numel() for p in self.blocks.parameters())

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write the vLLM ``medusa`` checkpoint."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.lm.config
        tensors = {
            f"blocks.{j}.layers.{i}.weight": layer.weight.detach().to("cpu", dtype).contiguous()
            for j, block in enumerate(self.blocks)
            for i, layer in enumerate(block)
        }
        tensors["lm_head.weight"] = self.lm.lm_head.weight.detach().to("cpu", dtype).contiguous()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "num_heads": self.num_heads,
            "num_hidden_layers": len(self.blocks[0]),
            "truncated_vocab_size": cfg.vocab_size,
            "original_lm_head": True,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out

    def load_trainable(self, ckpt: str | Path) -> None:
        tensors = read_tensors(Path(ckpt) / "model.safetensors")
        with torch.no_grad():
            for j, block in enumerate(self.blocks):
                for i, layer in enumerate(block):
                    layer.weight.copy_(
                        tensors[f"blocks.{j}.layers.{i}.weight"].to(layer.weight.dtype)
                    )


@torch.no_grad()
def medusa_drafts(heads: MedusaHeads, final_hidden: Tensor) -> list[int]:
    """Top-1 draft of every head from one final hidden state (what vLLM proposes)."""
    return [
        int(heads.lm.lm_head(heads.head_hidden(final_hidden, j)).argmax(-1))
        for j in range(heads.num_heads)
    ]
