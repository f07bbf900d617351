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
back to vLLM and sends the stream rows' result to the layer's
:func:`~vllm_specstream.streams.stream_layer.stream_layer` generator, which does the steps between
the calls (rotary, multi-stream attention over the paged cache, residuals, norms,
activation) and asks for the next projection: the same layer as the stream pass of
:class:`~vllm_specstream.model_executor.stream_forward.StreamRunner`.
The model's ``compute_logits`` then multiplies the main rows and the streams' final states
with the LM head in one call. Row-wise matmuls make the main rows' results those of a
plain forward; the engine tests check outputs token by token against plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.lora.vllm_lora_layers import (
    fused_lora_linear,
    is_lora_wrapped,
    join_output,
    split_output,
)
from vllm_specstream.model_executor.stream_forward import StreamRunner, StreamStart, rms_norm
from vllm_specstream.model_executor.stream_weights import layer_linears
from vllm_specstream.streams.stream_layer import ATTEND, PROJECTIONS, StreamLayer

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
    """What the layer waits for: a :data:`~vllm_specstream.streams.stream_layer.STAGES` name
    ("" not started, "done" after the last layer)."""
    start: StreamStart | None = None
    gen: StreamLayer | None = None
    """The current layer's :func:`~vllm_specstream.streams.stream_layer.stream_layer`."""
    pending: Tensor | None = None
    """Input of the next projection call for the stream rows."""
    final: Tensor | None = None
    """Stream states after the final norm, ``[N, h]``, once the last layer ran."""


class FusedStreams:
    """Wraps the MSA layers' projections so that a pass's stream rows ride along."""

    def __init__(self, runner: StreamRunner):
        self.runner = runner  # its layers, layouts, params and config
        self.active: _Pass | None = None
        layers = runner.layers
        for i, layer in enumerate(layers):
            for module, stage in zip(layer_linears(layer), PROJECTIONS):
                self._wrap(module, i, stage)
        self._wrap_entry(layers[0].input_layernorm)

    # -- installing the wrappers --------------------------------------------------------------
    def _wrap(self, module: nn.Module, index: int, stage: str) -> None:
        """Make ``module`` carry the stream rows when the active pass is at ``stage`` of
        MSA layer ``index`` (vLLM calls each projection once per layer and forward)."""
        original = module.forward
        # A vLLM LoRA wrapper: the stream rows take its base layer and their own delta.
        lora = is_lora_wrapped(module)

        def forward(x, *args, **kwargs):
            p = self.active
            if p is None or p.layer != index:
                return original(x, *args, **kwargs)
            if stage == "o" and p.stage == ATTEND:
                # vLLM's attention, which writes this step's keys/values to the paged cache,
                # runs between qkv_proj and o_proj: only now may the streams read them.
                self._advance(p, None)
            if p.stage != stage:
                return original(x, *args, **kwargs)
            if lora:
                lora_rows = self.runner.lora
                main, stream = fused_lora_linear(
                    module, x, p.pending, lora_rows.row_slots, *args, **kwargs
                )
                self._advance(p, lora_rows.add_stream_lora(stream, index, stage, p.pending))
                return main
            n = x.shape[0]
            out = original(torch.cat((x, p.pending.to(x.dtype))), *args, **kwargs)
            y, rest = split_output(out)
            stream = y[n:]
            if self.runner.stream_lora is not None:  # a streams-only checkpoint's delta
                stream = stream + self.runner.stream_lora.delta(index, stage, p.pending)
            self._advance(p, stream)
            return join_output(y[:n], rest)

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
        p.start = self.runner.start(msa_input, p.batch, p.anchors, p.num_streams)
        self._enter(p, 0, p.start.s)

    def _enter(self, p: _Pass, index: int, s: Tensor) -> None:
        """The stream states ``s`` enter MSA layer ``index``: its input norm runs now, its
        ``qkv`` request waits for the layer's ``qkv_proj`` call."""
        p.layer, p.gen = index, self.runner.layer(index, s, p.start)
        p.stage, p.pending = next(p.gen)

    def _advance(self, p: _Pass, result: Tensor | None) -> None:
        """Send the current stage's result; the layer runs to its next request, or ends and
        the streams enter the next layer (or the final norm after the last one)."""
        try:
            p.stage, p.pending = p.gen.send(result)
        except StopIteration as done:
            s = done.value
            if p.layer + 1 < len(self.runner.layers):
                self._enter(p, p.layer + 1, s)
            else:
                p.final = rms_norm(s, self.runner.model.model.norm)
                p.gen, p.pending, p.stage = None, None, "done"
