"""The window placement in one pass: stream rows ride along the main rows' matmuls.

The paper's design runs the streams inside the main forward, so that the top
``num_msa_layers`` layers read their weights once for the main rows and the stream rows
together. At batch 1 a CPU step is bound by reading weights, so a second pass over the top
layers and the LM head (the ``accepted`` placement) costs nearly half a plain step;
riding along costs only the extra rows.

vLLM's own layer modules run unchanged for the main rows. :class:`FusedStreams` wraps the
four projections of each MSA layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) and the first MSA layer's input norm: while a pass is active, each
projection call multiplies ``[main rows; stream rows]`` in one call, hands the main rows
back to vLLM, and advances the streams between the calls (rotary, the multi-stream
attention over the paged cache after vLLM has written this step's keys, residuals, norms,
activation), exactly the math of :class:`~vllm_specstream.model_executor.stream_forward.StreamRunner`.
The model's ``compute_logits`` then multiplies the main rows and the streams' final states
with the LM head in one call. Row-wise matmuls make the main rows' results those of a
plain forward; the engine tests check outputs token by token against plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.stream_forward import StreamRunner, StreamStart, rms_norm

Tensor = torch.Tensor


@dataclass
class _Pass:
    """One forward's streams, advanced call by call."""

    batch: ForwardBatch
    anchors: Tensor
    """``[R, A]`` flat token indices (-1 pads)."""
    num_streams: int
    layer: int = 0
    """Index (among the MSA layers) of the layer the streams are in."""
    stage: str = ""
    """The projection call the streams wait for: qkv, o, gate_up, down ("" not started)."""
    start: StreamStart | None = None
    s: Tensor | None = None
    """Residual stream of the stream rows, ``[N, h]`` (request, anchor, stream)."""
    pending: Tensor | None = None
    """Input of the next projection call for the stream rows."""
    qkv: tuple[Tensor, Tensor, Tensor] | None = None
    final: Tensor | None = None
    """Stream states after the final norm, ``[N, h]``, once the last layer ran."""


class FusedStreams:
    """Wraps the MSA layers' projections so that a pass's stream rows ride along."""

    def __init__(self, runner: StreamRunner):
        self.runner = runner  # its layers, layouts, params and config
        self.active: _Pass | None = None
        layers = runner.layers
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            self._wrap(attn.qkv_proj, i, "qkv", self._after_qkv)
            self._wrap(attn.o_proj, i, "o", self._after_o, before=self._attention)
            self._wrap(mlp.gate_up_proj, i, "gate_up", self._after_gate_up)
            self._wrap(mlp.down_proj, i, "down", self._after_down)
        self._wrap_entry(layers[0].input_layernorm)

    # -- installing the wrappers --------------------------------------------------------------
    def _wrap(self, module: nn.Module, index: int, stage: str, after, before=None) -> None:
        """Make ``module`` carry the stream rows when the active pass is at ``stage`` of
        MSA layer ``index`` (vLLM calls each projection once per layer and forward)."""
        original = module.forward

        def forward(x, *args, **kwargs):
            p = self.active
            if p is None or p.layer != index or p.stage != stage:
                return original(x, *args, **kwargs)
            if before is not None:
                before(p, index)
            n = x.shape[0]
            out = original(torch.cat((x, p.pending.to(x.dtype))), *args, **kwargs)
            y, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
            after(p, index, y[n:])
            main = y[:n]
            return (main, *rest) if rest is not None else main

        module.forward = forward

    def _wrap_entry(self, norm: nn.Module) -> None:
        """The first MSA layer's input norm: the residual stream entering L0 (the sum it
        returns with the fused residual add, else its input) starts the streams."""
        original = norm.forward

        def forward(x, residual=None, *args, **kwargs):
            out = original(x, residual, *args, **kwargs) if residual is not None else original(x)
            p = self.active
            if p is not None and p.stage == "":
                entering = out[1] if residual is not None else x
                self._start(p, entering)
            return out

        norm.forward = forward

    # -- one pass -----------------------------------------------------------------------------
    def begin(self, batch: ForwardBatch, anchors: Tensor, num_streams: int) -> None:
        self.active = _Pass(batch, anchors, num_streams) if bool((anchors >= 0).any()) else None

    def finish(self) -> tuple[Tensor, Tensor] | None:
        """``(anchors, stream states after the final norm [R, A, G, h])`` of the pass, or
        None when it did not run through every MSA layer."""
        p, self.active = self.active, None
        if p is None or p.final is None:
            return None
        return p.anchors, p.final.view(p.start.shape)

    def _start(self, p: _Pass, msa_input: Tensor) -> None:
        runner = self.runner
        p.start = runner.start(msa_input, p.batch, p.anchors, p.num_streams)
        p.s = p.start.s
        p.pending = rms_norm(p.s, runner.layers[0].input_layernorm)
        p.stage = "qkv"

    def _after_qkv(self, p: _Pass, i: int, qkv: Tensor) -> None:
        p.qkv = self.runner.rotated_qkv(self.runner.layers[i], qkv, p.start.flat_pos)
        p.pending, p.stage = None, "o"

    def _attention(self, p: _Pass, i: int) -> None:
        """Before ``o_proj``: vLLM has written this layer's keys for the step; the streams
        attend to them and to their own anchor's streams."""
        p.pending = self.runner.attend(self.runner.layers[i], *p.qkv, p.start)
        p.qkv = None

    def _after_o(self, p: _Pass, i: int, y: Tensor) -> None:
        p.s = p.s + y
        p.pending = rms_norm(p.s, self.runner.layers[i].post_attention_layernorm)
        p.stage = "gate_up"

    def _after_gate_up(self, p: _Pass, i: int, y: Tensor) -> None:
        p.pending = self.runner.layers[i].mlp.act_fn(y)
        p.stage = "down"

    def _after_down(self, p: _Pass, i: int, y: Tensor) -> None:
        p.s = p.s + y
        layers = self.runner.layers
        if i + 1 < len(layers):
            p.layer, p.stage = i + 1, "qkv"
            p.pending = rms_norm(p.s, layers[i + 1].input_layernorm)
        else:
            p.final = rms_norm(p.s, self.runner.model.model.norm)
            p.pending, p.stage = None, "done"
