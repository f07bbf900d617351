"""The training objectives: paper eq. 5 (specstream), plain next-token loss (ntp), pruning."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_specstream.streams.stream_math import stream_targets
from vllm_specstream.training.model import SpecStreamModel

Tensor = torch.Tensor


def select_anchors(labels_mask: Tensor, num_streams: int) -> Tensor:
    """``[B, A]`` anchor positions whose streams have at least one target in the completion.

    Stream ``j`` at ``t`` predicts ``x[t + 1 + j]`` (j = 1..G), so ``t`` is useful when any of
    ``labels_mask[t + 2 .. t + 1 + G]`` is set. Rows are padded with -1.
    """
    b, t = labels_mask.shape
    useful = torch.zeros_like(labels_mask)
    for j in range(2, num_streams + 2):
        useful[:, : t - j] |= labels_mask[:, j:]
    counts = useful.sum(1)
    a = max(int(counts.max()), 1)
    # Stable sort puts useful positions first, in order.
    order = torch.sort((~useful).int(), dim=1, stable=True).indices[:, :a]
    keep = torch.arange(a, device=counts.device)[None] < counts[:, None]
    return torch.where(keep, order, torch.full_like(order, -1))


def _ce_and_top1(head, hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy and top-1 accuracy of ``head(hidden)`` rows against ``targets``."""
    if targets.numel() == 0:
        zero = hidden.sum() * 0.0
        return zero, zero.detach()
    logits = head(hidden).float()
    loss = F.cross_entropy(logits, targets)
    top1 = (logits.argmax(-1) == targets).float().mean()
    return loss, top1.detach()


def main_rows(hidden: Tensor, input_ids: Tensor, labels_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Main-stream rows whose next token is a completion token, and those tokens."""
    read = main_rows_read(labels_mask, True)
    return hidden[read], input_ids[:, 1:][read[:, :-1]]


def main_rows_read(labels_mask: Tensor, main_loss: bool) -> Tensor:
    """``[B, T]`` positions whose final main hidden state a loss term reads: those whose next
    token is a completion token (none when the main stream has no loss term)."""
    read = torch.zeros_like(labels_mask)
    if main_loss:
        read[:, :-1] = labels_mask[:, 1:]
    return read


def specstream_loss(
    model: SpecStreamModel, batch: dict[str, Tensor], objective: str = "specstream"
) -> tuple[Tensor, dict[str, float]]:
    """Loss of one batch and its metrics.

    ``batch``: ``input_ids``, ``attention_mask``, ``labels_mask`` (True on completion tokens),
    all ``[B, T]``, right-padded; a packed batch (:mod:`fast_batches`) adds ``positions``,
    ``new_mask``, possibly a cached ``hidden`` with its ``start_layer``, and ``skip_unread``
    (compute only the rows a loss term depends on: ``rows_read`` of the model's forward). ``objective``:
    "specstream" (eq. 5), "ntp" (main only), "streams-only" (the streams' terms of eq. 5: the
    main stream is the frozen base) or "prune" (the pruning adapter alone, on a trained
    checkpoint: the same term as in eq. 5 training, whose input is detached anyway).
    """
    cfg = model.config
    ids, attn, labels = batch["input_ids"], batch["attention_mask"], batch["labels_mask"]
    packed = {k: batch[k] for k in ("positions", "new_mask", "hidden", "start_layer") if k in batch}
    if objective == "prune":
        return _prune_loss(model, ids, attn, labels, packed)
    streams = objective in ("specstream", "streams-only")
    anchors = select_anchors(labels, cfg.num_streams) if streams else None
    if batch.get("skip_unread"):
        packed["rows_read"] = main_rows_read(labels, objective != "streams-only")
    out = model(ids, anchors=anchors, attention_mask=attn, **packed)
    hidden, targets = main_rows(out.main_hidden, ids, labels)
    metrics: dict[str, float] = {}
    if objective == "streams-only":
        # The main stream is the frozen base: its loss is a constant, not worth a LM head.
        loss = out.stream_hidden.sum() * 0.0
    else:
        main_loss, main_top1 = _ce_and_top1(model.lm_head, hidden, targets)
        loss = cfg.loss.a0 * main_loss
        metrics = {"loss_main": float(main_loss.detach()), "top1_main": float(main_top1)}
    if anchors is not None:
        s_targets, s_valid = stream_targets(ids, labels, anchors, cfg.num_streams)
        for j, weight in enumerate(cfg.loss.stream_weights(cfg.num_streams)):
            valid = s_valid[:, :, j]
            s_loss, s_top1 = _ce_and_top1(
                model.lm_head, out.stream_hidden[:, :, j][valid], s_targets[:, :, j][valid]
            )
            loss = loss + weight * s_loss
            metrics[f"loss_stream{j + 1}"] = float(s_loss.detach())
            metrics[f"top1_stream{j + 1}"] = float(s_top1)
    if model.prune_a is not None:
        # The pruning adapter learns next-token prediction from layer Lp alone; detaching keeps
        # its loss from moving the LoRA weights below it.
        prune_hidden, _ = main_rows(out.prune_input.detach(), ids, labels)
        p_loss, p_top1 = _ce_and_top1(model.prune_logits, prune_hidden, targets)
        loss = loss + p_loss
        metrics["loss_prune"] = float(p_loss.detach())
        metrics["top1_prune"] = float(p_top1)
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def _prune_loss(model: SpecStreamModel, ids, attn, labels, packed) -> tuple[Tensor, dict]:
    """The pruning adapter's next-token loss at layer Lp; the layers above it do not run."""
    if model.prune_a is None:
        raise ValueError("objective prune: the model has no pruning adapter (prune.enabled)")
    out = model(ids, attention_mask=attn, stop_layer=model.prune_layer, **packed)
    hidden, targets = main_rows(out.prune_input.detach(), ids, labels)
    loss, top1 = _ce_and_top1(model.prune_logits, hidden, targets)
    metrics = {"loss_prune": float(loss.detach()), "top1_prune": float(top1)}
    metrics["loss"] = metrics["loss_prune"]
    return loss, metrics
