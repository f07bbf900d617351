"""Stream rows through vLLM's LoRA-wrapped layers (``enable_lora``): the one touch point.

Under multi-LoRA serving every linear of the decoder is a vLLM ``*WithLoRA`` wrapper whose
adapter deltas follow one per-token slot mapping for the main batch (the punica wrapper's
``token_lora_indices``); stream rows pushed through the wrapper would break that mapping (a
crash, or at batch 1 the one request's slot applied by accident). So a stream row takes the
wrapper's *base* layer, in the same call as the main rows where the pass is fused, plus its
own request's adapter delta computed here from the wrapper's stacked slot buffers: the
streams then run through the MSA layers with the request's LoRA, as in training. The main
rows get exactly what the wrapper gives them (base output, then vLLM's own LoRA call).

Facts relied on (vLLM 0.32; ``tests/vllm/test_lora_serving.py`` fails when they change):
``base_layer``, ``lora_a_stacked`` / ``lora_b_stacked`` (one ``[slots, 1, rank, in]`` /
``[slots, 1, out_j, rank]`` pair per output slice, ``B`` already scaled by alpha / r),
``output_slices``, ``punica_wrapper.token_lora_indices`` (slot per main token, -1 none) and
``_apply_lora_to_output`` on each wrapper; ``LogitsProcessorWithLoRA.base_layer``.

Under tensor parallelism a row-parallel wrapper (``o_proj``, ``down_proj``) adds each
rank's partial LoRA delta *before* the all-reduce (its ``lora_a`` is sliced to the rank's
input shard), so here too: the base layer's local product (``_get_quant_method().apply``,
bias on rank 0 only, as ``RowParallelLinearWithLoRA.forward``), plus the rows' partial
deltas, then one all-reduce for the main rows (exactly vLLM's) and one for the stream rows.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_specstream.model_executor.forward_batch import ForwardBatch
from vllm_specstream.model_executor.lora.per_adapter_streams import (
    AdapterStreams,
    group_requests,
    request_streams,
)
from vllm_specstream.model_executor.lora.stream_row_lora import StreamLoRAWeights
from vllm_specstream.model_executor.stream_weights import (
    LayerMatmuls,
    Matmul,
    StreamWeights,
    layer_linears,
    module_matmul,
)
from vllm_specstream.patches.cpu_lora_ops import lora_matmul
from vllm_specstream.streams.stream_layer import PROJECTIONS
from vllm_specstream.streams.stream_math import init_streams, stream_position_ids

Tensor = torch.Tensor


def is_lora_wrapped(module: nn.Module) -> bool:
    """Whether ``module`` is a vLLM LoRA wrapper of a linear layer."""
    return all(
        hasattr(module, name)
        for name in ("base_layer", "lora_a_stacked", "lora_b_stacked", "punica_wrapper")
    )


def request_slots(lora_module: nn.Module, batch: ForwardBatch) -> Tensor:
    """``[R]`` LoRA slot of each request of the running forward (-1: no adapter), read from
    the slot of its first scheduled token."""
    indices = lora_module.punica_wrapper.token_lora_indices
    return indices[batch.query_start_loc[:-1]].long()


def stream_delta(module: nn.Module, s: Tensor, slots: Tensor, dtype: torch.dtype) -> Tensor:
    """``[N, sum(output_slices)]``: each stream row's adapter delta (zero for slot -1), as
    vLLM's CPU ops compute it for main rows (shrink in fp32, expand in the output dtype)."""
    out = s.new_zeros(s.shape[0], sum(module.output_slices), dtype=dtype)
    offset = 0
    for a, b, width in zip(module.lora_a_stacked, module.lora_b_stacked, module.output_slices):
        shrunk = lora_matmul(s, a, slots, torch.float32)
        out[:, offset : offset + width] = lora_matmul(shrunk, b, slots, dtype)
        offset += width
    return out


def split_output(out):
    """A vLLM linear's result as ``(output, the rest of its tuple or None)``."""
    return (out[0], out[1:]) if isinstance(out, tuple) else (out, None)


def join_output(y: Tensor, rest):
    """``y`` in the form :func:`split_output` took apart."""
    return (y, *rest) if rest is not None else y


def is_row_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is a LoRA wrapper of a row-parallel linear sharded over ranks: its
    output is a sum over ranks, its LoRA delta one rank's part of it."""
    base = module.base_layer
    return getattr(module, "tp_size", 1) > 1 and hasattr(base, "reduce_results")


def _local_input(module: nn.Module, x: Tensor) -> Tensor:
    """This rank's shard of a row-parallel layer's input."""
    if module.base_layer.input_is_parallel:
        return x
    width = x.shape[-1] // module.tp_size
    return x[..., module.tp_rank * width : (module.tp_rank + 1) * width].contiguous()


def _local_product(module: nn.Module, x: Tensor) -> Tensor:
    """A row-parallel base layer's product on this rank, before the all-reduce."""
    base = module.base_layer
    bias = None if (module.tp_rank > 0 or base.skip_bias_add) else base.bias
    return module._get_quant_method().apply(base, x, bias)


def _reduce(module: nn.Module, y: Tensor) -> Tensor:
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(y) if module.base_layer.reduce_results else y


def _row_parallel_output(module: nn.Module, y: Tensor):
    """``y`` in the form a row-parallel wrapper returns (with its bias if it returns one)."""
    base = module.base_layer
    if not base.return_bias:
        return y
    return y, (base.bias if base.skip_bias_add else None)


def fused_row_parallel_lora_linear(module: nn.Module, x: Tensor, s: Tensor, slots: Tensor):
    """:func:`fused_lora_linear` for a row-parallel wrapper under tensor parallelism."""
    n = x.shape[0]
    x_local = _local_input(module, x)
    s_local = _local_input(module, s.to(x.dtype))
    y = _local_product(module, torch.cat((x_local, s_local)))
    main = _reduce(module, module._apply_lora_to_output(x_local, y[:n]))
    stream = _reduce(module, y[n:] + stream_delta(module, s_local, slots, y.dtype))
    return _row_parallel_output(module, main), stream


def fused_lora_linear(module: nn.Module, x: Tensor, s: Tensor, slots: Tensor, *args, **kwargs):
    """A LoRA-wrapped linear over the main rows ``x`` and the stream rows ``s`` (request slot
    per stream row: ``slots``) in one base call. Returns ``(main output as the wrapper returns
    it, stream rows' output)``."""
    if is_row_parallel(module):
        return fused_row_parallel_lora_linear(module, x, s, slots)
    n = x.shape[0]
    y, rest = split_output(module.base_layer(torch.cat((x, s.to(x.dtype))), *args, **kwargs))
    main = module._apply_lora_to_output(x, y[:n])
    stream = y[n:] + stream_delta(module, s, slots, y.dtype)
    return join_output(main, rest), stream


class StreamLoRA:
    """The adapter slot of each stream row of the current pass, and the stream rows'
    projections through a LoRA-wrapped layer with them."""

    def __init__(self, lora_module: nn.Module, lora_manager=None):
        self.lora_module = lora_module  # any wrapper: they share one punica wrapper
        self.lora_manager = lora_manager  # vLLM's LoRA model manager (slots -> adapters)
        self.row_slots: Tensor | None = None
        #: Streams-only adapters of the current pass: their stream LoRA and stream rows.
        self.stream_loras: list[tuple[StreamLoRAWeights, Tensor]] = []
        #: The MSA layers (:meth:`weights`).
        self.layers: list[nn.Module] = []

    def request_streams(
        self, batch: ForwardBatch, own: AdapterStreams | None
    ) -> list[AdapterStreams | None]:
        """Each request's streams: its adapter's (:mod:`.per_adapter_streams`), ``own`` for
        requests without an adapter."""
        slots = request_slots(self.lora_module, batch).tolist()
        if self.lora_manager is None:
            return [own if slot < 0 else None for slot in slots]
        return request_streams(self.lora_manager, slots, own)

    @staticmethod
    def init_streams(
        x: Tensor, anchor_pos: Tensor, g: int, streams: list[AdapterStreams | None]
    ) -> tuple[Tensor, Tensor]:
        """The ``g`` streams entering the first MSA layer at anchors whose residual states
        are ``x`` (``[R, A, h]``), ``[R, A, g, h]``, and their rotary positions ``[R, A, g]``:
        each request with its own streams (zero where it has none; its anchors are -1)."""
        r, a, h = x.shape
        s = x.new_zeros(r, a, g, h)
        pos = anchor_pos.new_zeros(r, a, g)
        for own, rows in group_requests(streams):
            idx = torch.tensor(rows)
            s[idx] = init_streams(x[idx], own.stream_embeddings[:g], own.init_a, own.init_b)
            pos[idx] = stream_position_ids(anchor_pos[idx], g, own.config.stream_position)
        return s, pos

    def begin(
        self,
        batch: ForwardBatch,
        rows_per_request: int,
        streams: list[AdapterStreams | None] | None = None,
    ) -> None:
        """Slots of a pass whose rows are ``rows_per_request`` per request, request-major,
        and the rows of requests whose ``streams`` carry a stream LoRA."""
        self.row_slots = request_slots(self.lora_module, batch).repeat_interleave(rows_per_request)
        self.stream_loras = []
        for own, requests in group_requests(streams or []):
            if own.stream_lora is not None:
                first = torch.tensor(requests)[:, None] * rows_per_request
                rows = (first + torch.arange(rows_per_request)).flatten()
                self.stream_loras.append((own.stream_lora.for_ranks(self.layers), rows))

    def add_stream_lora(self, y: Tensor, index: int, stage: str, s: Tensor) -> Tensor:
        """``y`` (stream rows' output of ``stage`` in MSA layer ``index``, input ``s``) plus
        each streams-only adapter's delta on its own rows."""
        for weights, rows in self.stream_loras:
            y = y.index_add(0, rows, weights.delta(index, stage, s[rows]).to(y.dtype))
        return y

    def weights(self, layers: list[nn.Module], packed: StreamWeights | None) -> StreamWeights:
        """The second pass's matmuls: each wrapped projection's base (``packed``'s copy if
        given, else the base layer) plus the stream rows' adapter deltas."""
        self.layers = layers  # streams-only adapters' stream LoRA splits over their ranks
        out = []
        for i, layer in enumerate(layers):
            modules = layer_linears(layer)
            bases = (
                packed.layers[i].matmuls()
                if packed is not None
                else [module_matmul(getattr(m, "base_layer", m)) for m in modules]
            )
            out.append(
                LayerMatmuls(
                    *(
                        self._with_delta(m, base, i, stage) if is_lora_wrapped(m) else base
                        for m, base, stage in zip(modules, bases, PROJECTIONS)
                    )
                )
            )
        if packed is None:
            return StreamWeights(out)
        return StreamWeights(out, packed.lm_head, dtype=packed.dtype)

    def _with_delta(self, module: nn.Module, base: Matmul, index: int, stage: str) -> Matmul:
        if is_row_parallel(module):  # the partial delta before the all-reduce

            def run_sharded(x: Tensor) -> Tensor:
                x = _local_input(module, x)
                y = _local_product(module, x)
                y = _reduce(module, y + stream_delta(module, x, self.row_slots, y.dtype))
                return self.add_stream_lora(y, index, stage, x)  # its A x summed over ranks

            return run_sharded

        def run(x: Tensor) -> Tensor:
            y = base(x)
            y = y + stream_delta(module, x, self.row_slots, y.dtype)
            return self.add_stream_lora(y, index, stage, x)

        return run


def first_lora_module(layers: list[nn.Module]) -> nn.Module | None:
    """A LoRA wrapper among the MSA layers' projections (None: LoRA is off)."""
    for layer in layers:
        for module in layer_linears(layer):
            if is_lora_wrapped(module):
                return module
    return None


def base_logits_processor(processor: nn.Module) -> nn.Module:
    """vLLM's plain logits processor under a ``LogitsProcessorWithLoRA`` (whose LoRA mapping
    has one index per sampled main row)."""
    return getattr(processor, "base_layer", processor)
