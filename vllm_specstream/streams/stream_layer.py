"""One multi-stream-attention layer for the stream states, written once (docs/method.md).

Training (``training/model.py``, HF modules, dense main keys/values) and serving
(``model_executor/``, vLLM's modules or prepacked copies, the paged KV cache) run the
streams through the same layer steps in the same order; they differ only in how the four
projections are computed and in the layer-specific steps of :class:`StreamLayerOps`.

:func:`stream_layer` is a generator: it yields each request ``(stage, rows)`` and is sent
the result, so that a caller may compute a projection on its own (:func:`run_layer`) or
inside a call that also carries the main rows (the fused pass of
:mod:`vllm_specstream.model_executor.fused_streams`). :func:`layer_forward` is the same steps
as one straight call, for a compiled pass. Pure PyTorch, no vLLM import.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

import torch

Tensor = torch.Tensor

#: The requests of one layer, in order. ``attend`` is a barrier with no projection: the
#: caller sends ``None`` once the main stream's keys/values of the layer are readable (at
#: once in training; in the fused pass, only after vLLM's attention has written this step's
#: keys to the paged cache).
STAGES = ("qkv", "attend", "o", "gate_up", "down")
ATTEND = "attend"
#: The stages that are projections (a matmul over the yielded rows).
PROJECTIONS = tuple(stage for stage in STAGES if stage != ATTEND)

#: Yields ``(stage, rows)`` (``rows`` is None at ``attend``), is sent the stage's result
#: and returns the stream states leaving the layer.
StreamLayer = Generator[tuple[str, Tensor | None], Any, Tensor]


class StreamLayerOps(Protocol):
    """The steps of one decoder layer between its projections, for the stream rows."""

    def input_norm(self, s: Tensor) -> Tensor:
        """The layer's input norm of the residual stream ``s``: the ``qkv`` projection's input."""
        ...

    def rotate(self, qkv: Any) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of the ``qkv`` result (whatever the caller's ``qkv``
        projection returns), with rotary applied at the streams' positions."""
        ...

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Multi-stream attention over the main keys/values at positions ``<= t`` and the
        anchor's own streams ``<= j``: the ``o`` projection's input."""
        ...

    def post_norm(self, s: Tensor) -> Tensor:
        """The post-attention norm of ``s``: the ``gate_up`` projection's input."""
        ...

    def act(self, gate_up: Any) -> Tensor:
        """``act(gate) * up`` of the ``gate_up`` result: the ``down`` projection's input."""
        ...


class StreamProjections(Protocol):
    """The four projections of one decoder layer, one method per stage of
    :data:`PROJECTIONS` (``LayerMatmuls`` of the serving side has this shape)."""

    def qkv(self, x: Tensor) -> Any: ...

    def o(self, x: Tensor) -> Tensor: ...

    def gate_up(self, x: Tensor) -> Any: ...

    def down(self, x: Tensor) -> Tensor: ...


def stream_layer(s: Tensor, ops: StreamLayerOps) -> StreamLayer:
    """The stream states ``s`` through one layer: pre-norm, q/k/v, rotary, multi-stream
    attention, o, residual, post-norm, gate/up, activation, down, residual."""
    qkv = yield "qkv", ops.input_norm(s)
    q, k, v = ops.rotate(qkv)
    yield ATTEND, None
    s = s + (yield "o", ops.attend(q, k, v))
    gate_up = yield "gate_up", ops.post_norm(s)
    s = s + (yield "down", ops.act(gate_up))
    return s


def layer_forward(s: Tensor, ops: StreamLayerOps, projections: StreamProjections) -> Tensor:
    """:func:`stream_layer`'s steps in one straight call, with ``projections`` computed on
    their own: the form a compiler traces as one graph (it cannot trace a generator)."""
    q, k, v = ops.rotate(projections.qkv(ops.input_norm(s)))
    s = s + projections.o(ops.attend(q, k, v))
    return s + projections.down(ops.act(projections.gate_up(ops.post_norm(s))))


def run_layer(layer: StreamLayer, projections: StreamProjections) -> Tensor:
    """Drive ``layer`` with ``projections`` computed on their own (the main keys/values are
    already readable); returns the stream states leaving the layer."""
    answer = None
    try:
        while True:
            stage, rows = layer.send(answer)
            answer = None if stage == ATTEND else getattr(projections, stage)(rows)
    except StopIteration as done:
        return done.value
