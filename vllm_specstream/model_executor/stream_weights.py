"""The stream pass's matmuls: vLLM's own layer modules, or prepacked bf16 or int8 copies.

The streams only propose tokens (vLLM verifies every draft with the main stream), so their
matmuls may run at a lower precision than the served model without changing any output.
On a CPU with native bf16 dot products (AVX512-BF16, AMX) an fp32 checkpoint's stream pass
then reads half the bytes of the top ``num_msa_layers`` layers and of the LM head: the LM head
over 4 stream rows drops from ~4.6 to ~1.9 ms on a Zen 4 core.

The engine's field ``stream_dtype`` (:class:`vllm_specstream.speculation.settings.EngineSettings`) chooses:

* ``auto`` (default): for an fp32 model on a CPU, not tensor-parallel, bf16 copies where the
  CPU has native bf16 and int8 copies where it has not; vLLM's modules otherwise.
* ``model``: always vLLM's modules (the served dtype; drafts equal the training
  implementation's up to summation order).
* ``bfloat16``: bf16 copies wherever vLLM's CPU oneDNN GEMM runs bf16. Where it cannot (on
  an AVX2-only CPU oneDNN has no bf16 matmul at all), the stream pass keeps vLLM's modules
  and says so once in a warning.
* ``int8``: int8 copies (weights per output channel, the stream rows per call) through
  PyTorch's fbgemm kernels, which every x86 CPU from AVX2 on runs: a quarter of the fp32
  bytes, and int8 dot products where fp32 ones are scarce. A few stream rows through a
  576 x 3072 projection on one core: fp32 oneDNN ~300-430 us, int8 ~60-160 us.

This module is the one touch point with vLLM's CPU kernels that the stream pass calls
directly (``vllm._custom_ops``: the GEMM ops ``create_onednn_mm`` / ``onednn_mm`` and the
fused ``rms_norm``); ``tests/vllm/test_stream_weights.py`` fails when they change.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from vllm_specstream.logger import init_logger
from vllm_specstream.machine import native_bf16
from vllm_specstream.streams.stream_layer import PROJECTIONS

logger = init_logger(__name__)

Tensor = torch.Tensor
Matmul = Callable[[Tensor], Tensor]
#: The dense delta ``B @ A`` (``[out, in]``) a streams-only checkpoint adds to projection
#: ``stage`` of MSA layer ``index`` for the stream rows (``(index, stage)``), or None.
StreamDelta = Callable[[int, str], Tensor]


def onednn_available() -> bool:
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return False
    return bool(getattr(ops, "_supports_onednn", False))


@cache
def bf16_gemm_available() -> bool:
    """Whether vLLM's oneDNN GEMM can multiply bf16 on this CPU. oneDNN needs AVX-512 (or
    AVX2-VNNI-2) for a bf16 matmul; elsewhere ``create_onednn_mm`` raises "could not create a
    primitive descriptor", so one tiny handle is the honest probe."""
    if not onednn_available():
        return False
    from vllm import _custom_ops as ops

    try:
        handle = ops.create_onednn_mm(torch.zeros(16, 16, dtype=torch.bfloat16).t(), 32)
        ops.onednn_mm(handle, torch.zeros(1, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


@cache
def _rms_norm_kernel(dtype: torch.dtype) -> Callable | None:
    """vLLM's fused CPU ``rms_norm(out, x, weight, eps)`` for rows of ``dtype``, or None where
    this vLLM has none or this CPU's build of it does not take ``dtype`` (one tiny call is
    the probe, as for the GEMM)."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    kernel = getattr(ops, "rms_norm", None)
    if kernel is None:
        return None
    try:
        kernel(
            torch.empty(1, 16, dtype=dtype),
            torch.ones(1, 16, dtype=dtype),
            torch.ones(16, dtype=dtype),
            1e-6,
        )
    except (RuntimeError, NotImplementedError, AttributeError):  # op not in this build
        return None
    return kernel


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMS norm of the stream rows ``x`` over their last dimension, scaled by ``weight``.

    On a CPU, vLLM's fused kernel: PyTorch's ``rms_norm`` runs there as about six small ops,
    each paying the OpenMP fork-join of the engine's threads (~65 us for 4 rows inside a
    2-thread engine, against ~3 us for the kernel), and a stream pass runs two norms a layer.
    Elsewhere (or for a dtype the kernel lacks), and under ``torch.compile`` (which fuses
    PyTorch's with the ops around it), PyTorch's."""
    w = weight.to(x.dtype)
    eager_cpu = x.is_cpu and not torch.compiler.is_compiling()
    kernel = _rms_norm_kernel(x.dtype) if eager_cpu and x.numel() else None
    if kernel is None:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    kernel(out, rows, w.contiguous(), eps)
    return out.view(x.shape)


def int8_gemm_available() -> bool:
    """Whether PyTorch has its x86 quantized kernels (fbgemm) in this build."""
    return "fbgemm" in torch.backends.quantized.supported_engines


#: fbgemm's prepacked int8 weights of each :class:`Int8Linear`, by the address of its key
#: tensor (a torchbind object cannot be a graph input; the key tensor can).
_INT8_PACKED: dict[int, object] = {}


@torch.library.custom_op("specstream::int8_linear", mutates_args=())
def int8_linear(x: Tensor, key: Tensor) -> Tensor:
    """``x`` through the int8 copy registered under ``key`` (float32 rows in and out)."""
    return torch.ops.quantized.linear_dynamic(x, _INT8_PACKED[key.data_ptr()], True)


@int8_linear.register_fake
def _int8_linear_shape(x: Tensor, key: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], key.shape[0]))


class Int8Linear:
    """``y = x W^T + b`` through fbgemm with ``W`` in int8 (symmetric, per output channel)
    and ``x`` quantized per call to 7-bit (fbgemm's ``reduce_range``, which keeps AVX2's
    16-bit pair sums from saturating); returns ``x``'s dtype."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # PyTorch marks its quantized tensors deprecated; the kernels are those of the
            # PyTorch vLLM pins (tests/vllm/test_stream_weights.py fails when they go).
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        b = None if bias is None else bias.detach().float()
        #: Stands for the packed weights inside graphs; its first size is the output's.
        self.key = torch.empty(w.shape[0], 1, dtype=torch.uint8)
        _INT8_PACKED[self.key.data_ptr()] = torch.ops.quantized.linear_prepack(q, b)
        weakref.finalize(self, _INT8_PACKED.pop, self.key.data_ptr(), None)

    def __call__(self, x: Tensor) -> Tensor:
        return int8_linear(x.float().contiguous(), self.key).to(x.dtype)


class PackedLinear:
    """``y = x W^T + b`` through a oneDNN handle over a bf16 copy of ``W``; returns ``x``'s
    dtype. The handle owns its packed copy, so ``W`` may be freed afterwards."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        from vllm import _custom_ops as ops

        self._ops = ops
        self.handle = ops.create_onednn_mm(weight.detach().to(torch.bfloat16).t(), 32)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)

    def __call__(self, x: Tensor) -> Tensor:
        y = self._ops.onednn_mm(self.handle, x.to(torch.bfloat16).contiguous(), self.bias)
        return y.to(x.dtype)


#: The copies' matmul classes by the ``stream_dtype`` they serve.
COPIES: dict[str, type] = {"bfloat16": PackedLinear, "int8": Int8Linear}


def copies_for(
    mode: str, platform_is_cpu: bool, model_dtype, tp_size: int
) -> tuple[str | None, str]:
    """The copies the stream pass runs under ``mode`` (``"bfloat16"``, ``"int8"``, or None
    for vLLM's modules), and why."""
    requested = mode
    if mode == "model":
        return None, "stream_dtype=model"
    if not platform_is_cpu:
        return None, "not a CPU platform"
    if tp_size != 1:
        return None, f"tensor parallel size {tp_size}"
    if mode == "auto":
        if model_dtype != torch.float32:
            return None, f"the model runs in {model_dtype} already"
        if not native_bf16():
            mode = "int8"  # where bf16 would be emulated, int8 dot products are not
    if mode == "int8":
        if not int8_gemm_available():
            return None, "this PyTorch build has no fbgemm int8 kernels"
        return "int8", "stream_dtype=int8" if mode == requested else "no native bf16 here"
    if not onednn_available():
        return None, "vLLM's oneDNN GEMM is not available"
    if not bf16_gemm_available():
        return None, "vLLM's oneDNN has no bf16 GEMM on this CPU (it needs AVX-512)"
    return "bfloat16", f"stream_dtype={mode}"


def module_matmul(module: nn.Module) -> Matmul:
    """A vLLM linear module as a function of its input (it all-reduces under TP itself)."""

    def run(x: Tensor) -> Tensor:
        return module(x)[0]

    return run


def layer_linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A decoder layer's four projections, in :class:`LayerMatmuls` field order (that of
    :data:`~vllm_specstream.streams.stream_layer.PROJECTIONS`)."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


@dataclass
class LayerMatmuls:
    """The four projections of one decoder layer, as the stream pass calls them."""

    qkv: Matmul
    o: Matmul
    gate_up: Matmul
    down: Matmul

    @classmethod
    def of_modules(cls, layer: nn.Module) -> LayerMatmuls:
        return cls(*(module_matmul(m) for m in layer_linears(layer)))

    def matmuls(self) -> tuple[Matmul, Matmul, Matmul, Matmul]:
        """The four, in :func:`layer_linears` order."""
        return self.qkv, self.o, self.gate_up, self.down

    @classmethod
    def packed(
        cls, layer: nn.Module, deltas: tuple[Tensor | None, ...] = (), linear: type = PackedLinear
    ) -> LayerMatmuls:
        """Copies (``linear``: bf16 or int8) of a layer's (loaded, not yet post-processed)
        weights, each plus its stream delta where ``deltas`` (one per projection) has one."""
        deltas = deltas or (None,) * 4
        return cls(
            *(
                linear(
                    m.weight if d is None else m.weight.float() + d.float(),
                    getattr(m, "bias", None),
                )
                for m, d in zip(layer_linears(layer), deltas, strict=True)
            )
        )


def plain_weights(modules: list[nn.Module]) -> bool:
    """Whether every module carries an unquantized 2-D floating-point weight."""
    for m in modules:
        w = getattr(m, "weight", None)
        if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_floating_point() or w.is_meta:
            return False
    return True


@dataclass
class StreamWeights:
    """Matmuls of the stream pass: one :class:`LayerMatmuls` per MSA layer and the LM head
    (``None``: the model's ``compute_logits``)."""

    layers: list[LayerMatmuls]
    lm_head: Matmul | None = None
    stream_delta_merged: bool = False
    """Whether the copies' weights already hold the checkpoint's stream delta (``W + B A``):
    a streams-only checkpoint's stream LoRA then costs no matmuls of its own."""
    dtype: str | None = None
    """The copies' dtype (``bfloat16``, ``int8``); None: vLLM's modules."""

    @classmethod
    def of_modules(cls, layers: list[nn.Module]) -> StreamWeights:
        return cls([LayerMatmuls.of_modules(layer) for layer in layers])

    @classmethod
    def pack(
        cls,
        layers: list[nn.Module],
        lm_head_weight: Tensor,
        delta: StreamDelta | None = None,
        dtype: str = "bfloat16",
    ) -> StreamWeights:
        """Copies in ``dtype`` (``bfloat16``, ``int8``) of the MSA ``layers`` and the LM head,
        with ``delta`` merged into the projections' weights where given."""
        linear = COPIES[dtype]
        packed = [
            LayerMatmuls.packed(
                layer, tuple(delta(i, stage) for stage in PROJECTIONS) if delta else (), linear
            )
            for i, layer in enumerate(layers)
        ]
        return cls(
            packed, linear(lm_head_weight), stream_delta_merged=delta is not None, dtype=dtype
        )


def build_stream_weights(
    layers: list[nn.Module],
    lm_head_weight: Tensor | None,
    *,
    mode: str,
    platform_is_cpu: bool,
    model_dtype: torch.dtype,
    tp_size: int,
    stream_delta: StreamDelta | None = None,
) -> StreamWeights | None:
    """bf16 or int8 copies for the stream pass if ``mode`` (field ``stream_dtype``) and the
    machine call for them and the weights are plain tensors; ``None`` keeps vLLM's modules.
    ``stream_delta``: a streams-only checkpoint's stream LoRA, merged into the copies (its
    two small matmuls per projection and row batch cost more than the projection itself
    for a few rows on a CPU)."""
    if not all(hasattr(x, "self_attn") for x in layers):
        return None  # a pipeline-parallel rank without the MSA layers runs no streams
    dtype, reason = copies_for(mode, platform_is_cpu, model_dtype, tp_size)
    if dtype is not None:
        linears = [m for layer in layers for m in layer_linears(layer)]
        if lm_head_weight is None or not plain_weights(linears):
            dtype, reason = None, "the stream layers' weights are not plain tensors (quantized?)"
    if dtype is None:
        if mode in COPIES:
            # Drafts only: the model's dtype gives the same outputs, so fall back, loudly.
            logger.warning(
                "stream_dtype=%s cannot be honoured: %s; the stream pass runs in the "
                "model's dtype (stream_dtype=auto picks the faster path by itself)",
                mode,
                reason,
            )
        else:
            logger.info("specstream stream pass in the model's dtype (%s)", reason)
        return None
    weights = StreamWeights.pack(layers, lm_head_weight, stream_delta, dtype)
    logger.info(
        "specstream stream pass in %s: copies of %d layers%s and the LM head (%s; drafts "
        "only, outputs stay the model's; stream_dtype=model turns it off)",
        dtype,
        len(layers),
        " (stream LoRA merged)" if stream_delta is not None else "",
        reason,
    )
    return weights


def draft_head(weight: Tensor, copies: str | None, platform_is_cpu: bool) -> Matmul:
    """The streams' LM head over the draft vocabulary: ``weight`` holds its rows of the LM
    head (``[V_d, h]``, a copy). In the stream pass's ``copies`` dtype where it has copies;
    on a CPU through vLLM's oneDNN matmul, as its own LM head runs; else ``F.linear``."""
    if copies is not None:
        return COPIES[copies](weight)
    weight = weight.detach().contiguous()
    if platform_is_cpu:
        from vllm import _custom_ops as ops

        if getattr(ops, "_supports_onednn", False):
            try:
                handle = ops.create_onednn_mm(weight.t(), 32)
            except RuntimeError as e:  # e.g. bf16 weights on a CPU without a bf16 GEMM
                logger.debug("draft head: no oneDNN matmul (%s); torch's linear", e)
            else:
                return lambda x: ops.onednn_mm(handle, x.to(weight.dtype).contiguous(), None)
    return lambda x: torch.nn.functional.linear(x.to(weight.dtype), weight)
