"""The speculative streams inside vLLM: top ``num_msa_layers`` layers over the paged KV cache.

For every anchor (each position of a request's scheduled window, at most ``k + 1`` per
request, or only each request's last accepted position: the placements of
:mod:`vllm_specstream.model_executor.specstream`), the ``num_streams`` streams start as
``f(M[t]) + P[j]`` from the residual stream entering layer L0 and go through vLLM's own
layer modules. In attention they read the main stream's keys/values at positions ``<= t``
from the paged cache (after this step's writes) and their own anchor's streams ``<= j``;
nothing of the streams is written to the cache. The math is
:mod:`vllm_specstream.streams.stream_math` and the layer is
:func:`vllm_specstream.streams.stream_layer.stream_layer`, both shared with training; the attention
core (:func:`~vllm_specstream.streams.stream_math.joint_stream_attention`, one fused attention call)
is the piece a GPU kernel would replace. The matmuls are vLLM's modules or prepacked bf16
copies (:mod:`vllm_specstream.model_executor.stream_weights`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.fx.experimental._config
from torch import nn

from vllm_specstream.checkpoint.config import SpecStreamConfig
from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.lora.per_adapter_streams import AdapterStreams
from vllm_specstream.model_executor.lora.stream_row_lora import StreamLoRAWeights
from vllm_specstream.model_executor.lora.vllm_lora_layers import StreamLoRA, first_lora_module
from vllm_specstream.model_executor.paged_kv import PagedKVLayout, layer_kv_cache
from vllm_specstream.model_executor.stream_weights import StreamWeights, fused_rms_norm
from vllm_specstream.streams.stream_layer import (
    StreamLayer,
    StreamProjections,
    layer_forward,
    stream_layer,
)
from vllm_specstream.streams.stream_math import (
    anchor_main_mask,
    init_streams,
    joint_attention_mask,
    joint_stream_attention,
    stream_position_ids,
)

Tensor = torch.Tensor


def window_anchors(batch: ForwardBatch, max_anchors: int) -> Tensor:
    """``[R, A]`` flat token indices of the anchors: the last ``min(query_len, max_anchors)``
    scheduled tokens of each request (the whole window of a decode step, the last prompt
    tokens of a prefill chunk); -1 pads."""
    qsl = batch.query_start_loc
    ends = qsl[1:]
    counts = torch.minimum(ends - qsl[:-1], torch.full_like(ends, max_anchors))
    a = int(counts.max()) if counts.numel() else 0
    offsets = torch.arange(a)[None, :] - counts[:, None]  # negative offsets from each end
    idx = ends[:, None] + offsets
    return torch.where(offsets < 0, idx, torch.full_like(idx, -1)) if a else idx


def last_window_anchors(batch: ForwardBatch, max_anchors: int) -> Tensor:
    """Like :func:`window_anchors`, but a request scheduled for more than ``max_anchors``
    tokens (a prefill chunk) gets only its last token: the next step's drafts start there
    if the prefill is complete, and nowhere inside the chunk. Columns no request uses are
    dropped: the streams of a batch of prefills run at one anchor per request, not at
    ``max_anchors`` of which all but one are padding (every padded anchor costs its stream
    rows in each MSA layer)."""
    anchors = window_anchors(batch, max_anchors)
    qsl = batch.query_start_loc
    long = (qsl[1:] - qsl[:-1]) > max_anchors
    if anchors.numel() and bool(long.any()):
        anchors[long, 0] = qsl[1:][long] - 1
        anchors[long, 1:] = -1
        used = int((anchors >= 0).sum(dim=1).max())  # valid anchors lead every row
        anchors = anchors[:, : max(used, 1)]
    return anchors


def accepted_anchors(batch: ForwardBatch, rows: list[int], indices: list[int]) -> Tensor:
    """``[R, 1]`` flat token index of one anchor per request (``rows[i]`` gets
    ``indices[i]``); -1 for requests without one."""
    anchors = torch.full((batch.num_reqs, 1), -1, dtype=torch.long)
    if rows:
        anchors[torch.tensor(rows), 0] = torch.tensor(indices, dtype=torch.long)
    return anchors


class StreamParams(nn.Module):
    """The specstream tensors of a merged checkpoint (``specstream.*``)."""

    def __init__(
        self,
        config: SpecStreamConfig,
        hidden_size: int,
        own: bool = True,
        hf_config=None,
    ):
        super().__init__()
        if not own:  # a base served for adapters: nothing to load (vLLM checks every parameter)
            self.stream_embeddings = self.init_a = self.init_b = None
            return
        # One definition of names and shapes, shared with the front-end's checkpoint check.
        for name, shape in config.stream_tensor_shapes(hidden_size, hf_config).items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape), requires_grad=False))
        if config.init_rank == 0:
            self.init_a = self.init_b = None


def rms_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """vLLM's ``RMSNorm`` module (weight, ``variance_epsilon``) as one fused call (not the
    module itself: the fused pass wraps the first MSA layer's input norm)."""
    return fused_rms_norm(x, norm.weight, norm.variance_epsilon)


@dataclass
class StreamStart:
    """What every MSA layer of one stream pass shares."""

    s: Tensor
    """The streams entering L0, ``[R * A * G, h]`` (rows: request, anchor, stream)."""
    shape: torch.Size
    """``[R, A, G, h]``."""
    flat_pos: Tensor
    """Rotary position of each row."""
    mask: Tensor
    """:func:`~vllm_specstream.streams.stream_math.joint_attention_mask` of the pass."""
    kv_index: tuple[Tensor, Tensor, int]
    """Flat cache indices of the main keys/values the streams read."""


class StreamRunner:
    """Runs the streams for a batch of anchors through the model's MSA layers (a pass of
    its own here; :mod:`~vllm_specstream.model_executor.fused_streams` runs the same steps
    inside the main forward)."""

    def __init__(
        self,
        model: nn.Module,
        params: StreamParams,
        config: SpecStreamConfig,
        weights: StreamWeights | None = None,
        compiled: bool = False,
    ):
        self.model = model  # the SpecStream*ForCausalLM (has .model.layers, .model.norm)
        self.params = params
        self.config = config
        layers = model.model.layers
        self.first_msa_layer = config.first_msa_layer(len(layers))
        self.layers = list(layers)[self.first_msa_layer :]
        # Under vLLM multi-LoRA, each stream row gets its own request's adapter delta.
        lora_module = first_lora_module(self.layers)
        self.lora = (
            StreamLoRA(lora_module, getattr(model, "lora_manager", None))
            if lora_module is not None
            else None
        )
        #: The served checkpoint's own streams (None: a base model served for adapters).
        self.own = (
            AdapterStreams(
                "the served checkpoint",
                config,
                params.stream_embeddings,
                params.init_a,
                params.init_b,
            )
            if getattr(model, "own_streams", True)
            else None
        )
        #: Each request's streams in the current pass (under multi-LoRA; see
        #: :meth:`anchors_with_streams`).
        self._request_streams: list[AdapterStreams | None] | None = None
        if self.lora is not None:
            self.weights = self.lora.weights(self.layers, weights)
        else:
            self.weights = weights or StreamWeights.of_modules(self.layers)
        #: A streams-only checkpoint's delta on the stream rows (None: none).
        self.stream_lora = StreamLoRAWeights.of(params, config)
        if self.stream_lora is not None:  # never with LoRA: the model refuses that at init
            self.weights = self.stream_lora.for_ranks(self.layers).wrap(self.weights)
        #: One MSA layer of a pass: compiled where vLLM compiles the decoder (one graph,
        #: shared by every MSA layer, fuses the ~30 small ops between the matmuls), except
        #: for per-request (LoRA) or per-layer (unmerged stream LoRA) deltas, which stay eager.
        deltas = self.lora is not None or (
            self.stream_lora is not None and not self.weights.stream_delta_merged
        )
        use_compiled = compiled and not deltas
        self._msa_layer = compiled_msa_layer() if use_compiled else msa_layer

    def main_kv_index(self, batch: ForwardBatch, context: Tensor) -> tuple[Tensor, Tensor, int]:
        """Flat cache indices of the main keys/values of positions ``context`` (``[R, P]``),
        shared by all MSA layers (their caches have one shape and layout)."""
        kv_cache = layer_kv_cache(self.layers[0])
        layout = PagedKVLayout.of_cache(kv_cache, self.layers[0].self_attn.attn.isa)
        k_idx, v_idx = layout.position_indices(kv_cache.shape[1], batch.block_table, context)
        shape = (*context.shape, *k_idx.shape[1:])  # [R, P, K, D]
        return k_idx.view(shape), v_idx.view(shape), kv_cache.shape[1]

    @staticmethod
    def main_kv(cache: Tensor, index: tuple[Tensor, Tensor, int]) -> tuple[Tensor, Tensor]:
        """Main keys/values ``[R, K, P, D]`` in a layer's ``cache`` at the flat ``index``."""
        k_idx, v_idx, _ = index
        return torch.take(cache, k_idx).transpose(1, 2), torch.take(cache, v_idx).transpose(1, 2)

    def anchors_with_streams(self, batch: ForwardBatch, anchors: Tensor) -> Tensor:
        """``anchors`` (``[R, A]``) with -1 for requests that have no streams: under
        multi-LoRA each request drafts with its adapter's streams (or, without an adapter,
        the checkpoint's own), and an adapter may have none. Called before every pass: the
        pass's :meth:`start` reads the streams found here."""
        if self.lora is None:
            return anchors
        self._request_streams = self.lora.request_streams(batch, self.own)
        without = [i for i, s in enumerate(self._request_streams) if s is None]
        if without:
            anchors = anchors.clone()
            anchors[torch.tensor(without)] = -1
        return anchors

    def start(
        self, msa_input: Tensor, batch: ForwardBatch, anchors: Tensor, num_streams: int = 0
    ) -> StreamStart:
        """The first ``num_streams`` streams (0: all) at ``anchors`` (``[R, A]`` flat token
        indices into ``msa_input``, -1 pads), and what every layer needs for them. Stream
        ``j`` attends to streams ``<= j`` only, so the first ``G`` streams alone are exactly
        the first ``G`` of all."""
        valid = anchors >= 0
        idx = anchors.clamp(min=0)
        g = min(num_streams or self.config.num_streams, self.config.num_streams)
        r = anchors.shape[0]
        p = self.params
        anchor_pos = batch.positions[idx].long()  # [R, A]
        if self.lora is None:
            s = init_streams(msa_input[idx], p.stream_embeddings[:g], p.init_a, p.init_b)
            flat_pos = stream_position_ids(anchor_pos, g, self.config.stream_position).flatten()
        else:  # each request with its adapter's streams
            s, pos = self.lora.init_streams(msa_input[idx], anchor_pos, g, self._request_streams)
            flat_pos = pos.flatten()
        # Main context of each request: positions 0..(last anchor position).
        ctx_len = torch.where(valid, anchor_pos + 1, torch.zeros_like(anchor_pos)).max(dim=1).values
        p_max = max(int(ctx_len.max()), 1)  # >= 1 keeps the shapes valid without anchors
        context = torch.arange(p_max)[None, :].expand(r, p_max)
        context = torch.minimum(context, (ctx_len - 1).clamp(min=0)[:, None])
        main_mask = anchor_main_mask(anchor_pos, torch.arange(p_max)) & valid[..., None]
        if self.lora is not None:
            self.lora.begin(batch, s.shape[1] * s.shape[2], self._request_streams)
        return StreamStart(
            s=s.reshape(-1, s.shape[-1]),
            shape=s.shape,
            flat_pos=flat_pos,
            mask=joint_attention_mask(main_mask, g),
            kv_index=self.main_kv_index(batch, context),
        )

    @staticmethod
    def rotated_qkv(layer, qkv: Tensor, flat_pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A layer's ``qkv_proj`` output for the stream rows, split, with the per-head q/k
        norms of a layer that has them (Qwen3) and rotary applied, as vLLM's attention."""
        attn = layer.self_attn
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        if getattr(attn, "q_norm", None) is not None:
            d = attn.head_dim
            q = attn.q_norm(q.reshape(-1, q.shape[-1] // d, d)).view(q.shape)
            k = attn.k_norm(k.reshape(-1, k.shape[-1] // d, d)).view(k.shape)
        q, k = attn.rotary_emb(flat_pos, q, k)
        return q, k, v

    def attend(
        self,
        layer,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        start: StreamStart,
        cache: Tensor | None = None,
    ) -> Tensor:
        """Multi-stream attention of the stream rows in ``layer`` over the main keys/values
        in its paged ``cache`` (None: the layer's) and their own anchor's streams;
        ``[N, heads * head_dim]``, the input of ``o_proj``."""
        attn = layer.self_attn
        h_q, h_kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        # Sizes from the tensors, not from Python ints: a compiled pass then keeps requests,
        # anchors and streams symbolic instead of compiling again for each count.
        r, ag = start.mask.shape[:2]
        q = q.view(r, ag, h_q, d).transpose(1, 2)
        k = k.view(r, ag, h_kv, d).transpose(1, 2)
        v = v.view(r, ag, h_kv, d).transpose(1, 2)
        if cache is None:
            cache = layer_kv_cache(layer)
        k_main, v_main = self.main_kv(cache, start.kv_index)
        o = joint_stream_attention(q, k_main, v_main, k, v, start.mask, attn.scaling)
        return o.transpose(1, 2).reshape(r * ag, h_q * d)

    def layer(self, index: int, s: Tensor, start: StreamStart) -> StreamLayer:
        """The stream rows ``s`` through MSA layer ``index`` of the pass ``start``, as
        requests for its projections."""
        return stream_layer(s, VllmStreamOps(self, self.layers[index], start))

    @torch.no_grad()
    def __call__(
        self, msa_input: Tensor, batch: ForwardBatch, anchors: Tensor, num_streams: int = 0
    ) -> Tensor:
        """Stream hidden states after the final norm, ``[R, A, G, h]``, at ``anchors``
        (see :meth:`start`)."""
        start = self.start(msa_input, batch, anchors, num_streams)
        s = start.s
        for layer, mm in zip(self.layers, self.weights.layers, strict=True):
            s = self._msa_layer(self, layer, mm, s, start, layer_kv_cache(layer))
        return rms_norm(s, self.model.model.norm).view(start.shape)

    def compile(self) -> float:
        """Compile :func:`msa_layer` for this model now (seconds taken; 0: it runs eagerly),
        on stand-in rows of each shape class in :data:`COMPILED_SHAPES`, so that no request
        waits for a compilation."""
        if self._msa_layer is msa_layer:
            return 0.0
        layer, mm = self.layers[0], self.weights.layers[0]
        attn = layer.self_attn
        dtype = layer.input_layernorm.weight.dtype
        heads, d, p = attn.num_kv_heads, attn.head_dim, 7
        began = time.perf_counter()
        # Grad mode and inference tensors are part of a graph's guards: stand-ins made and
        # run as vLLM runs a step (the cache as vLLM allocates it, outside inference mode).
        cache = torch.zeros(5, heads, 16, 2 * d, dtype=dtype)  # [blocks, K, block size, 2D]
        # A symbol of its own for every size: with "equal sizes are one size", a stand-in
        # size equal to a model dimension would be fixed to it.
        with torch.inference_mode(), torch.fx.experimental._config.patch(use_duck_shape=False):
            for r, ag in COMPILED_SHAPES:
                index = torch.zeros(r, p, heads, d, dtype=torch.long)
                s = torch.zeros(r * ag, self.model.config.hidden_size, dtype=dtype)
                start = StreamStart(
                    s=s,
                    shape=torch.Size((r, 1, ag, s.shape[1])),
                    flat_pos=torch.arange(r * ag),
                    mask=torch.ones(r, ag, p + ag, dtype=torch.bool),
                    kv_index=(index, index.clone(), heads),
                )
                self._msa_layer(self, layer, mm, s, start, cache)
        return time.perf_counter() - began


#: (requests, stream rows per request) of the stand-ins :meth:`StreamRunner.compile` compiles
#: on. A compiled graph holds for a size of 1 or for every size from 2 up (sizes of 1 give
#: faster kernels: 12.5 against 14.2 ms a pass at batch 1, traced size-obliviously), so
#: these four cover every batch and stream count; context lengths are symbolic throughout.
COMPILED_SHAPES = ((1, 2), (1, 1), (2, 2), (2, 1))


def msa_layer(
    runner: StreamRunner,
    layer: nn.Module,
    mm: StreamProjections,
    s: Tensor,
    start: StreamStart,
    cache: Tensor,
) -> Tensor:
    """The stream rows ``s`` of the pass ``start`` through the MSA ``layer`` (projections
    ``mm``, paged KV cache ``cache``)."""
    return layer_forward(s, VllmStreamOps(runner, layer, start, cache), mm)


@cache
def compiled_msa_layer() -> Callable:
    """:func:`msa_layer` under ``torch.compile``. What differs between the MSA layers (the
    layer's modules, its weights' handles, its KV cache) is an input and every size
    is symbolic, so one graph serves every layer, request count, stream count and context
    length (:meth:`StreamRunner.compile`; ``tests/vllm/test_compiled_streams.py``)."""
    return torch.compile(msa_layer, dynamic=True)


@dataclass
class VllmStreamOps:
    """:class:`~vllm_specstream.streams.stream_layer.StreamLayerOps` of a vLLM decoder layer for the
    flat stream rows ``[N, h]`` of a pass, over the paged KV cache."""

    runner: StreamRunner
    layer: nn.Module
    start: StreamStart
    cache: Tensor | None = None
    """The layer's paged KV cache (None: read from the layer)."""

    def input_norm(self, s: Tensor) -> Tensor:
        return rms_norm(s, self.layer.input_layernorm)

    def rotate(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.runner.rotated_qkv(self.layer, qkv, self.start.flat_pos)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.runner.attend(self.layer, q, k, v, self.start, self.cache)

    def post_norm(self, s: Tensor) -> Tensor:
        return rms_norm(s, self.layer.post_attention_layernorm)

    def act(self, gate_up: Tensor) -> Tensor:
        act_fn = self.layer.mlp.act_fn
        if not torch.compiler.is_compiling():
            act_fn = eager_activation(act_fn)
        return act_fn(gate_up)


def eager_activation(act_fn: Callable) -> Callable:
    """``act_fn`` as vLLM dispatches it, without the ``torch.compile`` that a compiled
    engine wraps around a disabled custom op's ``forward_native`` (``CustomOp.maybe_compile``,
    for ops called outside the decoder's graphs). An eager stream pass (unmerged stream LoRA
    deltas, e.g. wherever it runs in the model's dtype: AVX2, AVX-512 without bf16) would
    otherwise compile ``SiluAndMul`` at its first pass, while serving the first request;
    the function vLLM compiled is the same math, run eagerly as the rest of the pass. Anything else (an enabled op's kernel, a plain module) is ``act_fn`` itself."""
    method = getattr(act_fn, "_forward_method", None)
    if method is None:
        return act_fn
    # torch.compile(fn) keeps fn here; maybe_compile's own wrapper (ops that mark dynamic
    # dimensions) wraps the compiled function with functools.wraps(fn).
    compiled_from = getattr(method, "_torchdynamo_orig_callable", None)
    if compiled_from is not None:
        return compiled_from
    native = getattr(act_fn, "forward_native", None)
    if native is not None and getattr(method, "__wrapped__", None) == native:
        return native
    return act_fn
