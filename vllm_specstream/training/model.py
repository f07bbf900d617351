"""Multi-stream wrapper over a Hugging Face causal LM of a supported family (docs/method.md).

One forward computes the main stream (the unchanged decoder) for every position and the
``num_streams`` speculative streams at chosen anchor positions. The streams enter at layer
``L0 = N - num_msa_layers`` as ``f(M[t]) + P[j]`` and go through the same layers (and LoRA) as
main tokens; in attention they see the main keys/values at positions ``<= t`` and the streams
``<= j`` of their own anchor. Main tokens never see streams.

The decoder layers are driven here from their submodules (norms, projections, MLP) rather
than through the layers' ``forward``, so the main and stream paths share weights exactly and
the per-layer main keys/values are at hand for the streams. The families of
:mod:`vllm_specstream.checkpoint.families` differ only in whether q/k/v and gate/up are one
fused projection (Phi-3) and whether queries and keys are normalised per head (Qwen3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_specstream.checkpoint.config import (
    DRAFT_VOCAB_MASK,
    STREAM_LORA_STAGES,
    ConfigError,
    SpecStreamConfig,
    stream_lora_name,
)
from vllm_specstream.checkpoint.families import family_of
from vllm_specstream.streams.stream_layer import run_layer, stream_layer
from vllm_specstream.streams.stream_math import (
    apply_rope,
    init_streams,
    multi_stream_attention,
    stream_position_ids,
)

Tensor = torch.Tensor

KVCache = list[tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class RowSubset:
    """Some rows of tensors whose leading dims are ``lead``: the projections (the bulk of a
    layer's arithmetic) run on those rows only, in one matmul over the compacted rows."""

    index: Tensor
    """Flat indices (over the leading dims) of the rows kept, ascending."""
    lead: tuple[int, ...]

    @classmethod
    def of(cls, keep: Tensor) -> RowSubset:
        """The rows where the bool tensor ``keep`` (shape ``lead``) is set."""
        return cls(keep.flatten().nonzero().squeeze(1), tuple(keep.shape))

    def take(self, x: Tensor) -> Tensor:
        """``[N, ...]``: the kept rows of ``x`` ``[*lead, ...]``."""
        return x.flatten(0, len(self.lead) - 1).index_select(0, self.index)

    def put(self, rows: Tensor, into: Tensor | None = None) -> Tensor:
        """``[*lead, ...]``: ``rows`` at the kept rows; elsewhere ``into``'s rows (zeros when
        None)."""
        if into is None:
            flat = rows.new_zeros(math.prod(self.lead), *rows.shape[1:])
        else:
            flat = into.flatten(0, len(self.lead) - 1)
        return flat.index_copy(0, self.index, rows).view(*self.lead, *rows.shape[1:])


@dataclass
class StreamOutput:
    """Result of :meth:`SpecStreamModel.forward` (hidden states after the final norm)."""

    main_hidden: Tensor | None
    """``[B, T, h]`` main stream at every input position (None: stopped at ``stop_layer``)."""
    stream_hidden: Tensor | None
    """``[B, A, G, h]`` streams at the anchors, or None when no anchors were asked for."""
    anchors: Tensor | None
    """``[B, A]`` anchor indices into the input (-1 = padding)."""
    msa_input: Tensor
    """``[B, T, h]`` residual stream entering the first MSA layer L0 (``M``)."""
    prune_input: Tensor
    """``[B, T, h]`` residual stream entering the pruning layer Lp (default L0)."""
    cache: KVCache | None = None
    """Per-layer main keys/values (post-rotary) for all positions so far, if caching."""


def unwrap_causal_lm(lm: nn.Module) -> nn.Module:
    """The HF ``*ForCausalLM`` inside a PEFT wrapper (or ``lm`` itself)."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def initial_stream_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, stream_init_std: float
) -> Tensor:
    """Initial value of a stream tensor: ``P ~ N(0, std^2)``; an adapter's ``A ~ N(0, 1/h)``
    and ``B = 0``, so that ``f`` and the pruning adapter start as the identity; the draft
    vocabulary starts as every token (a checkpoint's replaces it)."""
    if name == "draft_vocab_mask":
        return torch.ones(shape, dtype=dtype)
    if name == "stream_embeddings":
        return torch.randn(shape, dtype=dtype) * stream_init_std
    if name.endswith("_b"):
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, dtype=dtype) * shape[1] ** -0.5


def split_heads(
    qkv: tuple[Tensor, Tensor, Tensor], num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)`` projections ``[..., heads * D]`` as ``[..., heads, D]``."""
    q, k, v = qkv
    lead = q.shape[:-1]
    return (
        q.view(*lead, num_heads, head_dim),
        k.view(*lead, num_kv_heads, head_dim),
        v.view(*lead, num_kv_heads, head_dim),
    )


def qk_normed(attn: nn.Module, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """Queries and keys ``[..., heads, D]`` after the layer's per-head RMS norms (Qwen3's
    ``q_norm``/``k_norm``, before rotary); unchanged for a layer without them."""
    if getattr(attn, "q_norm", None) is None:
        return q, k
    return attn.q_norm(q), attn.k_norm(k)


@dataclass
class HFProjections:
    """The four projections of an HF decoder layer (:class:`StreamProjections`): separate
    q/k/v and gate/up modules, or one fused module each (Phi-3's ``qkv_proj`` and
    ``gate_up_proj``), possibly PEFT LoRA wrappers."""

    layer: nn.Module

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        attn = self.layer.self_attn
        fused = getattr(attn, "qkv_proj", None)
        if fused is None:
            return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        cfg = attn.config
        q_size = cfg.num_attention_heads * attn.head_dim
        kv_size = cfg.num_key_value_heads * attn.head_dim
        q, k, v = fused(x).split([q_size, kv_size, kv_size], dim=-1)
        return q, k, v

    def o(self, x: Tensor) -> Tensor:
        return self.layer.self_attn.o_proj(x)

    def gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mlp = self.layer.mlp
        fused = getattr(mlp, "gate_up_proj", None)
        if fused is None:
            return mlp.gate_proj(x), mlp.up_proj(x)
        gate, up = fused(x).chunk(2, dim=-1)
        return gate, up

    def down(self, x: Tensor) -> Tensor:
        return self.layer.mlp.down_proj(x)


@dataclass
class StreamLoRAProjections:
    """:class:`HFProjections` plus a LoRA on the stream rows only (a streams-only adapter):
    each projection adds ``B(A(x))``, split like vLLM's merged outputs (q, k, v; gate, up),
    so that the serving side adds the same delta to its merged projections."""

    base: HFProjections
    lora: dict[str, tuple[Tensor, Tensor]]
    """Stage (:data:`~vllm_specstream.checkpoint.config.STREAM_LORA_STAGES`) -> ``(A, B)``."""

    def _delta(self, stage: str, x: Tensor) -> Tensor:
        a, b = self.lora[stage]
        return F.linear(F.linear(x, a), b)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.base.qkv(x)
        dq, dk, dv = self._delta("qkv", x).split([q.shape[-1], k.shape[-1], v.shape[-1]], -1)
        return q + dq, k + dk, v + dv

    def o(self, x: Tensor) -> Tensor:
        return self.base.o(x) + self._delta("o", x)

    def gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = self.base.gate_up(x)
        dg, du = self._delta("gate_up", x).split([gate.shape[-1], up.shape[-1]], -1)
        return gate + dg, up + du

    def down(self, x: Tensor) -> Tensor:
        return self.base.down(x) + self._delta("down", x)


#: A run of one row's anchors and the main keys they see: ``(a0, a1, p0, p1)``, anchors
#: ``a0 <= a < a1`` see main keys in ``[p0, p1)`` only.
AttentionBlock = tuple[int, int, int, int]


def attention_blocks(main_mask: Tensor) -> list[list[AttentionBlock]]:
    """Per row of ``main_mask`` ``[B, A, P]``, runs of consecutive anchors whose visible main
    keys start at the same key (one packed example), with the span of keys they see; anchors
    that see no key (padding) are in no block. Their attention over that span alone is the
    attention over the whole row: every key outside it is masked."""
    seen = main_mask.any(-1)
    p = main_mask.shape[-1]
    first = main_mask.int().argmax(-1)
    end = p - main_mask.flip(-1).int().argmax(-1)
    out = []
    for row_seen, row_first, row_end in zip(seen.tolist(), first.tolist(), end.tolist()):
        blocks: list[list[int]] = []
        for a, (ok, p0, p1) in enumerate(zip(row_seen, row_first, row_end)):
            if not ok:
                continue
            last = blocks[-1] if blocks else None
            if last is not None and last[1] == a and last[2] == p0:
                last[1], last[3] = a + 1, max(last[3], p1)
            else:
                blocks.append([a, a + 1, p0, p1])
        out.append([tuple(b) for b in blocks])
    return out


@dataclass
class SubsetProjections:
    """:class:`StreamProjections` computed on a :class:`RowSubset` of the rows only (the
    others get zeros): the streams of padding anchors cost no matmul."""

    base: HFProjections | StreamLoRAProjections
    rows: RowSubset

    def qkv(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.rows.put(y) for y in self.base.qkv(self.rows.take(x)))

    def o(self, x: Tensor) -> Tensor:
        return self.rows.put(self.base.o(self.rows.take(x)))

    def gate_up(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.rows.put(y) for y in self.base.gate_up(self.rows.take(x)))

    def down(self, x: Tensor) -> Tensor:
        return self.rows.put(self.base.down(self.rows.take(x)))


@dataclass
class HFStreamOps:
    """:class:`StreamLayerOps` of an HF decoder layer for streams ``[B, A, G, h]`` over the
    layer's dense main keys/values."""

    layer: nn.Module
    num_heads: int
    num_kv_heads: int
    cos: Tensor
    """``[B, A, G, D]`` rotary tables at the streams' positions."""
    sin: Tensor
    k_main: Tensor
    """``[B, K, P, D]`` main keys (post-rotary) and values of the layer."""
    v_main: Tensor
    main_mask: Tensor
    """``[B, A, P]`` main keys each anchor's streams see."""
    blocks: list[list[AttentionBlock]] | None = None
    """:func:`attention_blocks` of ``main_mask``: attention per block only (padding anchors
    get zeros); None: over every anchor and key of the row."""

    def input_norm(self, s: Tensor) -> Tensor:
        return self.layer.input_layernorm(s)

    def rotate(self, qkv: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        d = self.layer.self_attn.head_dim
        q, k, v = split_heads(qkv, self.num_heads, self.num_kv_heads, d)
        q, k = qk_normed(self.layer.self_attn, q, k)
        perm = (0, 3, 1, 2, 4)  # [B, A, G, *, D] -> [B, *, A, G, D]
        cos, sin = self.cos[:, None], self.sin[:, None]
        q = apply_rope(q.permute(perm), cos, sin)
        k = apply_rope(k.permute(perm), cos, sin)
        return q, k, v.permute(perm)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scale = self.layer.self_attn.scaling
        if self.blocks is None:
            o = multi_stream_attention(q, self.k_main, self.v_main, k, v, self.main_mask, scale)
        else:
            o = self._attend_blocks(q, k, v, scale)
        b, h, a, g, d = o.shape
        return o.permute(0, 2, 3, 1, 4).reshape(b, a, g, h * d)

    def _attend_blocks(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        b, h, a, g, d = q.shape
        rows = []
        for r, blocks in enumerate(self.blocks):
            parts, at = [], 0
            for a0, a1, p0, p1 in blocks:
                if a0 > at:
                    parts.append(q.new_zeros(1, h, a0 - at, g, d))
                rs, ks = slice(r, r + 1), slice(p0, p1)
                parts.append(
                    multi_stream_attention(
                        q[rs, :, a0:a1],
                        self.k_main[rs, :, ks],
                        self.v_main[rs, :, ks],
                        k[rs, :, a0:a1],
                        v[rs, :, a0:a1],
                        self.main_mask[rs, a0:a1, ks],
                        scale,
                    )
                )
                at = a1
            if at < a:
                parts.append(q.new_zeros(1, h, a - at, g, d))
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)

    def post_norm(self, s: Tensor) -> Tensor:
        return self.layer.post_attention_layernorm(s)

    def act(self, gate_up: tuple[Tensor, Tensor]) -> Tensor:
        gate, up = gate_up
        mlp = self.layer.mlp
        act = getattr(mlp, "act_fn", None) or mlp.activation_fn  # Phi-3 names it so
        return act(gate) * up


def main_masks(
    input_ids: Tensor,
    past: int,
    attention_mask: Tensor | None,
    positions: Tensor | None,
    new_mask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The main stream's positions ``[B, T]``, attention mask ``[B, T, past + T]`` (all
    cached keys, the allowed new keys: causal unless ``new_mask`` says otherwise, no padding
    keys) and which keys are real ``[B, past + T]``."""
    b, t = input_ids.shape
    device = input_ids.device
    if positions is None:
        positions = torch.arange(past, past + t, device=device).expand(b, t)
    if new_mask is None:
        new_mask = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t)
    key_valid = torch.ones(b, past + t, dtype=torch.bool, device=device)
    if attention_mask is not None:
        key_valid[:, past:] = attention_mask.bool()
    seen_past = torch.ones(b, t, past, dtype=torch.bool, device=device)
    attn_mask = torch.cat((seen_past, new_mask), dim=2) & key_valid[:, None, :]
    return positions, attn_mask, key_valid


class SpecStreamModel(nn.Module):
    """A causal LM plus stream embeddings (and optional init/pruning adapters)."""

    def __init__(self, lm: nn.Module, config: SpecStreamConfig, stream_init_std: float = 0.02):
        super().__init__()
        causal_lm = unwrap_causal_lm(lm)
        hf_config = causal_lm.config
        family_of(hf_config)  # a clear error for an unsupported base
        config.validate(hf_config.num_hidden_layers)
        self.lm = lm
        self.config = config
        self.num_layers = hf_config.num_hidden_layers
        self.first_msa_layer = config.first_msa_layer(self.num_layers)
        self.prune_layer = config.prune_layer(self.num_layers)
        dtype = causal_lm.get_input_embeddings().weight.dtype
        # The names and shapes are the config's, as in checkpoints and in vLLM.
        shapes = config.stream_tensor_shapes(hf_config.hidden_size, hf_config)
        for name, shape in shapes.items():
            init = initial_stream_tensor(name, shape, dtype, stream_init_std)
            # The draft vocabulary is data, not trained.
            self.register_parameter(
                name, nn.Parameter(init, requires_grad=name != DRAFT_VOCAB_MASK)
            )
        if config.draft_vocab_size == 0:
            self.draft_vocab_mask = None
        if config.init_rank == 0:
            self.init_a = self.init_b = None
        if not config.prune.enabled:
            self.prune_a = self.prune_b = None
        self._stream_tensor_names = tuple(shapes)

    # -- pieces of the HF model -------------------------------------------------------------
    @property
    def causal_lm(self) -> nn.Module:
        return unwrap_causal_lm(self.lm)

    @property
    def decoder(self) -> nn.Module:
        return self.causal_lm.model

    def lm_head(self, hidden: Tensor) -> Tensor:
        return self.causal_lm.lm_head(hidden)

    def stream_logits(self, stream_hidden: Tensor) -> Tensor:
        """The streams' logits for drafting: the LM head's, tokens outside the draft
        vocabulary (if the checkpoint has one) at ``-inf``."""
        logits = self.lm_head(stream_hidden)
        if self.draft_vocab_mask is None:
            return logits
        return logits.masked_fill(self.draft_vocab_mask <= 0, float("-inf"))

    def stream_lora(self, msa_index: int) -> dict[str, tuple[Tensor, Tensor]]:
        """The stream LoRA of MSA layer ``msa_index`` (0 = L0): stage -> ``(A, B)``."""
        return {
            stage: (
                getattr(self, stream_lora_name(msa_index, stage, "a")),
                getattr(self, stream_lora_name(msa_index, stage, "b")),
            )
            for stage in STREAM_LORA_STAGES
        }

    def main_trains(self) -> bool:
        """Whether a parameter of the main stream trains (LoRA): else (streams-only) the main
        stream runs without autograd, and only the streams' graph is kept."""
        return any(p.requires_grad for p in self.lm.parameters())

    def stream_parameters(self) -> dict[str, Tensor]:
        """The specstream tensors saved in ``specstream.safetensors``."""
        return {n: getattr(self, n) for n in self._stream_tensor_names}

    # -- one decoder layer, main and streams --------------------------------------------------
    def _main_layer(
        self,
        layer,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        attn_mask: Tensor,
        cache: tuple[Tensor, Tensor] | None,
        qkv_rows: RowSubset | None = None,
        out_rows: RowSubset | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Main stream through ``layer``; returns (h, K, V) with K/V over all cached positions.

        ``qkv_rows``: the only positions whose queries/keys/values are computed (zeros
        elsewhere: padding, whose keys are masked); ``out_rows``: the only positions whose
        output is computed (elsewhere ``h`` passes unchanged: rows nobody reads)."""
        attn, cfg = layer.self_attn, self.causal_lm.config
        n_heads, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        x = layer.input_layernorm(h)
        if qkv_rows is None:
            qkv = HFProjections(layer).qkv(x)
        else:
            qkv = SubsetProjections(HFProjections(layer), qkv_rows).qkv(x)
        q, k, v = split_heads(qkv, n_heads, n_kv, d)  # [B, T, *, D]
        q, k = qk_normed(attn, q, k)
        q = apply_rope(q.transpose(1, 2), cos[:, None], sin[:, None])
        k = apply_rope(k.transpose(1, 2), cos[:, None], sin[:, None])
        v = v.transpose(1, 2)
        if cache is not None:
            k = torch.cat((cache[0], k), dim=2)
            v = torch.cat((cache[1], v), dim=2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask[:, None], scale=attn.scaling, enable_gqa=True
        )
        o = o.transpose(1, 2).reshape(*h.shape[:-1], n_heads * d)
        if out_rows is None:
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            return h, k, v
        r = out_rows.take(h) + attn.o_proj(out_rows.take(o))
        r = r + layer.mlp(layer.post_attention_layernorm(r))
        return out_rows.put(r, into=h), k, v

    def _stream_layer(
        self,
        layer,
        msa_index: int,
        s: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_main: Tensor,
        v_main: Tensor,
        main_mask: Tensor,
        rows: RowSubset | None = None,
        blocks: list[list[AttentionBlock]] | None = None,
    ) -> Tensor:
        """Streams ``[B, A, G, h]`` through ``layer`` with multi-stream attention; ``rows``:
        the only stream rows whose projections are computed (zeros elsewhere); ``blocks``:
        attention per :func:`attention_blocks` block."""
        cfg = self.causal_lm.config
        heads = cfg.num_attention_heads, cfg.num_key_value_heads
        ops = HFStreamOps(layer, *heads, cos, sin, k_main, v_main, main_mask, blocks)
        projections = HFProjections(layer)
        if self.config.stream_lora_rank > 0:
            projections = StreamLoRAProjections(projections, self.stream_lora(msa_index))
        if rows is not None:
            projections = SubsetProjections(projections, rows)
        return run_layer(stream_layer(s, ops), projections)

    def _enter_streams(self, h: Tensor, anchors: Tensor, positions: Tensor, attn_mask: Tensor):
        """Stream states at the anchors entering layer L0, their rotary tables and main mask."""
        b, g = h.shape[0], self.config.num_streams
        idx = anchors.clamp(min=0)
        m = torch.gather(h, 1, idx[..., None].expand(-1, -1, h.shape[-1]))
        s = init_streams(m, self.stream_embeddings, self.init_a, self.init_b)
        anchor_pos = torch.gather(positions, 1, idx)
        spos = stream_position_ids(anchor_pos, g, self.config.stream_position)
        cos, sin = self.decoder.rotary_emb(h, spos.flatten(1))
        cos, sin = cos.view(b, -1, g, cos.shape[-1]), sin.view(b, -1, g, sin.shape[-1])
        # A stream sees exactly the main keys its anchor's main token sees; padding anchors none.
        main_mask = torch.gather(attn_mask, 1, idx[..., None].expand(-1, -1, attn_mask.shape[2]))
        main_mask = main_mask & (anchors >= 0)[..., None]
        return s, cos, sin, main_mask

    # -- the forward --------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        anchors: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool = False,
        positions: Tensor | None = None,
        new_mask: Tensor | None = None,
        hidden: Tensor | None = None,
        start_layer: int = 0,
        stop_layer: int | None = None,
        rows_read: Tensor | None = None,
    ) -> StreamOutput:
        """Main stream for ``input_ids`` ``[B, T]`` and streams at ``anchors`` ``[B, A]``.

        ``anchors`` index into ``input_ids`` (-1 = padding); None computes no streams.
        ``attention_mask`` ``[B, T]`` marks real tokens (right padding only). With
        ``cache`` (from a previous call with ``use_cache=True``) the inputs continue the
        cached sequence; positions continue from the cache length (batch of 1 or equal lengths).
        For tree verification, ``positions`` ``[B, T]`` and ``new_mask`` ``[B, T, T]`` (which new
        tokens each new token sees, itself included) replace the causal defaults; packed
        training rows use them for their block-diagonal masks. The stream at an anchor sees
        exactly the main keys that the main token at the anchor sees.
        ``hidden`` ``[B, T, h]`` with ``start_layer`` resumes the decoder at that layer from the
        residual stream entering it (layers below it are frozen and their output was cached);
        it must not be above L0 or the pruning layer, whose inputs are taken from it.
        ``stop_layer`` ends the pass at the input of that layer (no main hidden state, no
        streams above it): what training the pruning adapter alone needs.
        ``rows_read`` ``[B, T]`` (training): the only positions whose ``main_hidden`` the
        caller reads. Then the projections skip what no loss term depends on: padding
        positions in every layer, the last layer's attention output and MLP outside
        ``rows_read`` (``main_hidden`` is not computed there) and padding anchors' streams,
        whose attention runs per packed example over that example's keys only.
        """
        past = 0 if cache is None else cache[0][0].shape[2]
        positions, attn_mask, key_valid = main_masks(
            input_ids, past, attention_mask, positions, new_mask
        )
        decoder = self.decoder
        cached = cache is not None or use_cache
        h = self._first_hidden(input_ids, hidden, start_layer, cached)
        cos, sin = decoder.rotary_emb(h, positions)
        main_grad = torch.is_grad_enabled() and self.main_trains()
        s = s_cos = s_sin = main_mask = prune_input = msa_input = None
        real_rows = last_rows = stream_rows = blocks = None
        if rows_read is not None:
            real = key_valid[:, past:]
            real_rows, last_rows, stream_rows = self._rows_read(real, rows_read, anchors, cached)
        last = len(decoder.layers) - 1
        new_cache: KVCache = []
        for i, layer in enumerate(decoder.layers):
            if i < start_layer:
                continue
            if i == self.prune_layer:
                prune_input = h
            if i == self.first_msa_layer:
                msa_input = h
            if i == stop_layer:
                break
            if i == self.first_msa_layer and anchors is not None:
                s, s_cos, s_sin, main_mask = self._enter_streams(h, anchors, positions, attn_mask)
                if rows_read is not None:
                    blocks = attention_blocks(main_mask)
            layer_cache = None if cache is None else cache[i]
            out_rows = last_rows if i == last else real_rows
            with torch.set_grad_enabled(main_grad):
                h, k, v = self._main_layer(
                    layer, h, cos, sin, attn_mask, layer_cache, real_rows, out_rows
                )
            if use_cache:
                new_cache.append((k, v))
            if s is not None:
                j = i - self.first_msa_layer
                s = self._stream_layer(
                    layer, j, s, s_cos, s_sin, k, v, main_mask, stream_rows, blocks
                )
        stopped = stop_layer is not None and stop_layer < len(decoder.layers)
        main_hidden = None if stopped else decoder.norm(h)
        stream_hidden = None if s is None else decoder.norm(s)
        cache_out = new_cache if use_cache else None
        return StreamOutput(main_hidden, stream_hidden, anchors, msa_input, prune_input, cache_out)

    def _first_hidden(
        self, input_ids: Tensor, hidden: Tensor | None, start_layer: int, cached: bool
    ) -> Tensor:
        """The residual stream the pass starts from: the embeddings, or ``hidden`` entering
        ``start_layer`` (not above L0 or the pruning layer, whose inputs come from it)."""
        if hidden is None:
            if start_layer != 0:
                raise ValueError("start_layer > 0 needs the hidden state entering that layer")
            return self.decoder.embed_tokens(input_ids)
        if start_layer > min(self.first_msa_layer, self.prune_layer) or cached:
            raise ValueError(
                f"cannot resume at layer {start_layer}: above the first MSA layer "
                f"{self.first_msa_layer} or pruning layer {self.prune_layer}, or with a cache"
            )
        return hidden

    def _rows_read(self, real: Tensor, rows_read: Tensor, anchors: Tensor | None, cached: bool):
        """The row subsets a training pass projects: real tokens, the last layer's read rows,
        and the real anchors' stream rows (None without anchors)."""
        if cached:
            raise ValueError("rows_read is for training passes, without a cache")
        stream_rows = None
        if anchors is not None:
            g = self.config.num_streams
            stream_rows = RowSubset.of((anchors >= 0)[..., None].expand(-1, -1, g))
        return RowSubset.of(real), RowSubset.of(rows_read & real), stream_rows

    def prune_logits(self, prune_input: Tensor) -> Tensor:
        """Early-exit logits of the pruning adapter: ``lm_head(norm(M + Bp(Ap(M))))``."""
        if self.prune_a is None:
            raise ConfigError("prune.enabled is false: this checkpoint has no pruning adapter")
        x = prune_input + F.linear(F.linear(prune_input, self.prune_a), self.prune_b)
        return self.lm_head(self.decoder.norm(x))
