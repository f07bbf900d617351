"""The stream math of Speculative Streaming (docs/method.md), in pure PyTorch.

Training (``training/``) and inference (``model_executor/``) both import this module; they
differ only in where the main stream's keys/values come from (a dense tensor in training,
the paged KV cache in vLLM). Shapes use these letters:

    B  batch (requests)          A  anchors per request      G  streams (num_streams)
    H  query heads               K  key/value heads          D  head dim
    P  main key positions        h  hidden size
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def stream_position_ids(anchor_positions: Tensor, num_streams: int, mode: str) -> Tensor:
    """Rotary positions of the streams at each anchor: ``[..., A] -> [..., A, G]``.

    Stream ``j`` (1-based) at anchor ``t`` sits at ``t + j`` ("shifted", the position of the
    token it predicts minus one) or at ``t`` ("anchor").
    """
    j = torch.arange(
        1, num_streams + 1, device=anchor_positions.device, dtype=anchor_positions.dtype
    )
    if mode == "shifted":
        return anchor_positions[..., None] + j
    if mode == "anchor":
        return anchor_positions[..., None].expand(*anchor_positions.shape, num_streams)
    raise ValueError(f"stream_position must be 'shifted' or 'anchor', got {mode!r}")


def init_streams(
    main_hidden: Tensor,
    stream_embeddings: Tensor,
    init_a: Tensor | None = None,
    init_b: Tensor | None = None,
) -> Tensor:
    """``S[t, j] = f(M[t]) + P[j]`` with ``f(x) = x + B(A(x))`` (identity without A, B).

    ``main_hidden``: ``[..., h]`` residual stream entering the first MSA layer at the anchors;
    ``stream_embeddings``: ``[G, h]``; ``init_a``: ``[eta, h]``; ``init_b``: ``[h, eta]``.
    Returns ``[..., G, h]``.
    """
    x = main_hidden
    if init_a is not None:
        x = x + F.linear(F.linear(x, init_a), init_b)
    return x[..., None, :] + stream_embeddings.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox-style rotary embedding; ``cos``/``sin`` broadcast to ``x``. Where they are
    narrower than the head (partial rotary, e.g. Phi-4-mini's 0.75), only the first dims
    rotate and the rest pass unchanged, as in Transformers and vLLM."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :d], x[..., d:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def stream_self_mask(num_streams: int, device: torch.device | None = None) -> Tensor:
    """``[G, G]`` bool: stream ``j`` sees streams ``1..j`` of its own anchor (lower triangle)."""
    return torch.ones(num_streams, num_streams, dtype=torch.bool, device=device).tril()


def anchor_main_mask(
    anchor_positions: Tensor, key_positions: Tensor, key_valid: Tensor | None = None
) -> Tensor:
    """``[B, A, P]`` bool: the stream at anchor ``t`` sees main keys at positions ``<= t``.

    ``anchor_positions``: ``[B, A]``; ``key_positions``: ``[B, P]`` or ``[P]``;
    ``key_valid``: optional ``[B, P]`` (False for padding).
    """
    if key_positions.dim() == 1:
        key_positions = key_positions[None]
    mask = key_positions[:, None, :] <= anchor_positions[:, :, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, :]
    return mask


def multi_stream_attention(
    q_streams: Tensor,
    k_main: Tensor,
    v_main: Tensor,
    k_streams: Tensor,
    v_streams: Tensor,
    main_mask: Tensor,
    scale: float,
) -> Tensor:
    """Attention of the streams over main keys ``<= t`` and their own anchor's streams ``<= j``.

    ``q_streams``: ``[B, H, A, G, D]``; ``k_main``/``v_main``: ``[B, K, P, D]`` (post-rotary);
    ``k_streams``/``v_streams``: ``[B, K, A, G, D]``; ``main_mask``: ``[B, A, P]`` bool.
    Returns ``[B, H, A, G, D]``. One softmax over the concatenation of both key sets, in
    float32; nothing of the streams reaches the main stream. H must be a multiple of K (GQA).
    """
    b, h, a, g, d = q_streams.shape
    kv = k_main.shape[1]
    rep = h // kv
    # Group query heads by their key/value head instead of copying keys (GQA).
    q = q_streams.reshape(b, kv, rep, a, g, d).float()
    s_main = torch.einsum("bkragd,bkpd->bkragp", q, k_main.float()) * scale
    s_self = torch.einsum("bkragd,bkaid->bkragi", q, k_streams.float()) * scale
    # Under autocast the scores may come back in bf16: mask with that dtype's minimum.
    neg = torch.finfo(s_main.dtype).min
    s_main = s_main.masked_fill(~main_mask[:, None, None, :, None, :], neg)
    s_self = s_self.masked_fill(~stream_self_mask(g, q.device), neg)
    p = torch.softmax(torch.cat((s_main, s_self), dim=-1).float(), dim=-1)
    p_main, p_self = p.split((s_main.shape[-1], g), dim=-1)
    out = torch.einsum("bkragp,bkpd->bkragd", p_main, v_main.float())
    out = out + torch.einsum("bkragi,bkaid->bkragd", p_self, v_streams.float())
    return out.reshape(b, h, a, g, d).to(q_streams.dtype)


def joint_attention_mask(main_mask: Tensor, num_streams: int) -> Tensor:
    """``[B, A*G, P + A*G]`` bool mask of :func:`multi_stream_attention` over the
    concatenation ``[main keys, stream keys]`` with queries and stream keys flattened
    anchor-major: stream ``j`` at anchor ``t`` sees the main keys ``main_mask`` allows and
    streams ``<= j`` of its own anchor. ``main_mask``: ``[B, A, P]``."""
    b, a, p = main_mask.shape
    g = num_streams
    main = main_mask[:, :, None, :].expand(b, a, g, p).reshape(b, a * g, p)
    same_anchor = torch.eye(a, dtype=torch.bool, device=main_mask.device)
    own = same_anchor[:, None, :, None] & stream_self_mask(g, main_mask.device)[None, :, None, :]
    return torch.cat((main, own.reshape(1, a * g, a * g).expand(b, -1, -1)), dim=-1)


def joint_stream_attention(
    q_streams: Tensor,
    k_main: Tensor,
    v_main: Tensor,
    k_streams: Tensor,
    v_streams: Tensor,
    joint_mask: Tensor,
    scale: float,
) -> Tensor:
    """:func:`multi_stream_attention` as one fused attention call (inference).

    ``q_streams``: ``[B, H, A*G, D]``; ``k_main``/``v_main``: ``[B, K, P, D]``;
    ``k_streams``/``v_streams``: ``[B, K, A*G, D]``; ``joint_mask`` from
    :func:`joint_attention_mask`. Returns ``[B, H, A*G, D]``.
    """
    k = torch.cat((k_main, k_streams), dim=2)
    v = torch.cat((v_main, v_streams), dim=2)
    return F.scaled_dot_product_attention(
        q_streams, k, v, attn_mask=joint_mask[:, None], scale=scale, enable_gqa=True
    )


def stream_targets(
    input_ids: Tensor, labels_valid: Tensor, anchors: Tensor, num_streams: int
) -> tuple[Tensor, Tensor]:
    """Targets of the streams: stream ``j`` at anchor ``t`` predicts ``x[t + 1 + j]``.

    ``input_ids``/``labels_valid``: ``[B, T]``; ``anchors``: ``[B, A]`` positions (may be -1 for
    padding). Returns ``(targets [B, A, G], valid [B, A, G])``.
    """
    t = input_ids.shape[1]
    offsets = torch.arange(2, num_streams + 2, device=anchors.device)
    pos = anchors[..., None] + offsets
    in_range = (anchors[..., None] >= 0) & (pos < t)
    pos_c = pos.clamp(0, t - 1)
    targets = torch.gather(input_ids, 1, pos_c.flatten(1)).view_as(pos)
    valid = in_range & torch.gather(labels_valid, 1, pos_c.flatten(1)).view_as(pos)
    return targets, valid
