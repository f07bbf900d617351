"""Cheaper training batches with the same loss: frozen-prefix caching and sequence packing.

Two independent savings, both exact up to floating-point summation order:

* **Frozen prefix.** When nothing below layer ``F`` is trainable (LoRA on the top layers
  only, streams entering at ``L0 >= F``), the residual stream entering ``F`` is a fixed
  function of each example's tokens. It is computed once per example and reused at every
  epoch, so a step runs only layers ``F..N-1`` (forward and backward).
* **Packing.** A batch's examples are laid end to end in rows of up to ``row_tokens`` tokens
  instead of being padded to the longest one. Each example keeps its own positions (from 0)
  and sees only itself (a block-diagonal causal mask), so every loss term is the one the
  padded batch computes, over the same target positions.
* **Unread rows.** A packed batch's rows still end in padding, and its rows' anchors are
  padded to the row with the most: the projections of a packed pass skip padding positions,
  padding anchors' streams and the last layer's output where no loss term reads it
  (``rows_read`` of :meth:`SpecStreamModel.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vllm_specstream.training.model import SpecStreamModel

Tensor = torch.Tensor


def first_trainable_layer(model: SpecStreamModel) -> int:
    """The lowest decoder layer whose output depends on a trainable parameter: the lowest
    layer holding one, capped by L0 and the pruning layer (their inputs feed trainable
    tensors). 0 when anything below the decoder layers (e.g. embeddings) trains."""
    layers = model.decoder.layers
    index = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    first = min(model.first_msa_layer, model.prune_layer)
    stream = {id(p) for p in model.stream_parameters().values()}
    for p in model.parameters():
        if not p.requires_grad or id(p) in stream:
            continue
        if id(p) not in index:
            return 0  # trainable outside the decoder layers (embeddings, final norm, head)
        first = min(first, index[id(p)])
    return first


@torch.no_grad()
def per_example_hidden(
    encoded: list[dict], run, batch_size: int = 8, desc: str = "cache", progress: bool = False
) -> list[Tensor]:
    """Per example, ``run(ids, lengths)``'s ``[T_i, h]`` rows, computed in batches of
    similar length: ``ids`` ``[B, T]`` right-padded (padding does not change the real positions
    of a causal model), ``run`` returns ``[B, T, h]``."""
    out: list[Tensor | None] = [None] * len(encoded)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]["input_ids"]))
    with tqdm(total=len(order), desc=desc, disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            lengths = [len(encoded[i]["input_ids"]) for i in idx]
            ids = torch.zeros(len(idx), max(lengths), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : lengths[row]] = torch.tensor(encoded[i]["input_ids"])
            h = run(ids, lengths)
            for row, i in enumerate(idx):
                out[i] = h[row, : lengths[row]].clone()
            bar.update(len(idx))
    return out  # type: ignore[return-value]


def prefix_hidden(
    model: SpecStreamModel,
    encoded: list[dict],
    layer: int,
    batch_size: int = 8,
    progress: bool = False,
) -> list[Tensor]:
    """Per example, the residual stream ``[T_i, h]`` entering decoder layer ``layer``."""
    if layer == 0:
        raise ValueError("layer 0 has no frozen prefix to cache")
    decoder = model.decoder

    device = decoder.embed_tokens.weight.device

    def run(ids: Tensor, lengths: list[int]) -> Tensor:
        b, t = ids.shape
        ids = ids.to(device)
        positions = torch.arange(t, device=device).expand(b, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t)
        h = decoder.embed_tokens(ids)
        cos, sin = decoder.rotary_emb(h, positions)
        for block in list(decoder.layers)[:layer]:
            h, _, _ = model._main_layer(block, h, cos, sin, mask, None)
        return h

    was_training = model.training
    model.eval()
    try:
        desc = f"cache layers 0-{layer - 1}"
        return per_example_hidden(encoded, run, batch_size, desc, progress)
    finally:
        model.train(was_training)


def cache_key(*parts, encoded: list[dict]) -> str:
    """What a cached prefix depends on: the frozen model and layer (``parts``) and every
    example's token ids, hashed."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps([str(p) for p in parts]).encode())
    for e in encoded:
        digest.update(json.dumps(e["input_ids"]).encode())
    return digest.hexdigest()


def load_or_compute(path: Path, key: str, compute) -> list[Tensor]:
    """The tensors saved at ``path`` under ``key``, or ``compute()`` saved there, so a resumed
    run does not redo the cache (minutes on a CPU)."""
    if path.is_file():
        # On the CPU: a run may resume on another device than the one that wrote it.
        saved = torch.load(path, weights_only=True, map_location="cpu")
        if saved.get("key") == key:
            return saved["hidden"]
    hidden = compute()
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "hidden": hidden}, tmp)
    tmp.replace(path)
    return hidden


def pad_rows(rows: list[Tensor]) -> Tensor:
    """``[B, T, h]``: per-example ``[T_i, h]`` states, right-padded with zeros."""
    out = rows[0].new_zeros(len(rows), max(r.shape[0] for r in rows), rows[0].shape[-1])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


@dataclass
class PackedBatch:
    """Rows of examples laid end to end; the model's inputs for a packed forward."""

    input_ids: Tensor
    """``[R, L]`` token ids (0 after the last example of a row)."""
    attention_mask: Tensor
    """``[R, L]`` True on real tokens."""
    labels_mask: Tensor
    """``[R, L]`` True on completion tokens (the targets)."""
    positions: Tensor
    """``[R, L]`` each token's position within its own example."""
    new_mask: Tensor
    """``[R, L, L]`` causal within each example, nothing across examples."""
    hidden: Tensor | None = None
    """``[R, L, h]`` cached residual stream entering ``start_layer``, if any."""
    start_layer: int = 0
    skip_unread: bool = True
    """Compute only the rows a loss term depends on (no padding rows, no unread outputs)."""

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Example indices per row, first fit in the given order (a row never splits an example;
    one longer than ``row_tokens`` gets a row of its own)."""
    rows: list[list[int]] = []
    used: list[int] = []
    for i, n in enumerate(lengths):
        for r, u in enumerate(used):
            if u + n <= row_tokens:
                rows[r].append(i)
                used[r] += n
                break
        else:
            rows.append([i])
            used.append(n)
    return rows


def pack_batch(
    encoded: list[dict],
    row_tokens: int,
    num_streams: int,
    hidden: list[Tensor] | None = None,
    start_layer: int = 0,
) -> PackedBatch:
    """Pack ``encoded`` examples (``input_ids``, ``labels_mask``) into rows.

    A stream at anchor ``t`` predicts up to ``t + 1 + num_streams``; an example whose first
    ``num_streams + 1`` tokens hold a target could therefore hand a target to the streams of
    the example before it, so it starts a row of its own (chat prompts never do)."""
    lengths = [len(e["input_ids"]) for e in encoded]
    leads = [not any(e["labels_mask"][: num_streams + 1]) for e in encoded]
    packable = [i for i in range(len(encoded)) if leads[i]]
    rows = [
        [packable[j] for j in row] for row in pack_rows([lengths[i] for i in packable], row_tokens)
    ]
    rows += [[i] for i in range(len(encoded)) if not leads[i]]
    width = max(sum(lengths[i] for i in row) for row in rows)
    r = len(rows)
    ids = torch.zeros(r, width, dtype=torch.long)
    attn = torch.zeros(r, width, dtype=torch.bool)
    labels = torch.zeros(r, width, dtype=torch.bool)
    positions = torch.zeros(r, width, dtype=torch.long)
    segment = torch.full((r, width), -1, dtype=torch.long)
    h = None if hidden is None else hidden[0].new_zeros(r, width, hidden[0].shape[-1])
    for row, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members):
            n = lengths[i]
            ids[row, at : at + n] = torch.tensor(encoded[i]["input_ids"])
            labels[row, at : at + n] = torch.tensor(encoded[i]["labels_mask"])
            attn[row, at : at + n] = True
            positions[row, at : at + n] = torch.arange(n)
            segment[row, at : at + n] = k
            if h is not None:
                h[row, at : at + n] = hidden[i]
            at += n
        # Row padding belongs to the last example: its queries then see real keys (a query
        # with every key masked would give NaN, and NaN values poison even zero weights).
        segment[row, at:] = len(members) - 1
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    new_mask = causal & (segment[:, :, None] == segment[:, None, :])
    return PackedBatch(
        ids, attn, labels, positions, new_mask, h, start_layer if h is not None else 0
    )
