"""The stream pass's bf16 and int8 matmuls: vLLM's oneDNN GEMM ops and PyTorch's fbgemm ones
still behave as the plugin uses them, and the choice between the copies and vLLM's modules
follows the rules."""

import pytest
import torch

from vllm_specstream.model_executor.stream_weights import (
    Int8Linear,
    PackedLinear,
    bf16_gemm_available,
    build_stream_weights,
    copies_for,
    int8_gemm_available,
    onednn_available,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="vLLM without oneDNN GEMM")
needs_bf16_gemm = pytest.mark.skipif(
    not bf16_gemm_available(),
    reason="vLLM's oneDNN has no bf16 GEMM on this CPU (AVX2 only): the packed path cannot run",
)


@needs_onednn
def test_bf16_probe_agrees_with_onednn():
    """The probe says yes exactly where a real layer-sized handle can be made and run."""
    try:
        PackedLinear(torch.randn(96, 64))(torch.randn(3, 64))
    except RuntimeError as e:
        assert not bf16_gemm_available(), e
        assert "primitive descriptor" in str(e)  # oneDNN's words when the ISA lacks bf16
    else:
        assert bf16_gemm_available()


@needs_bf16_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_fp32_linear_and_owns_its_copy(bias):
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    b = torch.randn(96) if bias else None
    x = torch.randn(5, 64)
    lin = PackedLinear(w, b)
    want = torch.nn.functional.linear(x, w, b)
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    # bf16 inputs and weights, fp32 accumulation: ~3 significant digits.
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.02)
    w.zero_()  # the handle packed its own copy when it was made
    torch.testing.assert_close(lin(x), got)


def test_copies_rules(monkeypatch):
    import vllm_specstream.model_executor.stream_weights as sw

    monkeypatch.setattr(sw, "onednn_available", lambda: True)
    monkeypatch.setattr(sw, "bf16_gemm_available", lambda: True)
    monkeypatch.setattr(sw, "int8_gemm_available", lambda: True)
    monkeypatch.setattr(sw, "native_bf16", lambda cls=None: True)
    f32, bf16 = torch.float32, torch.bfloat16

    def kind(*args):
        return copies_for(*args)[0]

    assert kind("auto", True, f32, 1) == "bfloat16"
    assert kind("int8", True, f32, 1) == "int8"
    assert "model" in copies_for("model", True, f32, 1)[1]
    assert "CPU" in copies_for("auto", False, f32, 1)[1]
    assert "tensor parallel" in copies_for("int8", True, f32, 2)[1]
    assert "bfloat16" in copies_for("auto", True, bf16, 1)[1]
    assert kind("bfloat16", True, bf16, 1) == "bfloat16"  # forced: no dtype rule
    assert kind("int8", True, bf16, 1) == "int8"
    monkeypatch.setattr(sw, "native_bf16", lambda cls=None: False)
    assert copies_for("auto", True, f32, 1) == ("int8", "no native bf16 here")
    assert kind("auto", True, bf16, 1) is None
    assert kind("bfloat16", True, f32, 1) == "bfloat16"
    monkeypatch.setattr(sw, "bf16_gemm_available", lambda: False)
    assert "no bf16 GEMM" in copies_for("bfloat16", True, f32, 1)[1]
    monkeypatch.setattr(sw, "onednn_available", lambda: False)
    assert "oneDNN" in copies_for("bfloat16", True, f32, 1)[1]
    assert kind("int8", True, f32, 1) == "int8"  # PyTorch's kernels, not vLLM's
    monkeypatch.setattr(sw, "int8_gemm_available", lambda: False)
    assert "fbgemm" in copies_for("int8", True, f32, 1)[1]
    assert kind("auto", True, f32, 1) is None


@pytest.mark.skipif(not int8_gemm_available(), reason="PyTorch without fbgemm")
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_close_to_fp32_eagerly_and_compiled(bias):
    """The int8 copy computes the projection to ~1-2% of its largest output, keeps its
    own packed weights, and one compiled graph serves copies of every layer (the packed
    weights stand behind a key tensor, a graph input)."""
    torch.manual_seed(0)
    weights = [torch.randn(96, 64) * 0.1 for _ in range(3)]
    b = torch.randn(96) if bias else None
    lins = [Int8Linear(w, b) for w in weights]
    compiled = torch.compile(lambda lin, x: lin(x), dynamic=True)
    for n in (1, 4):
        x = torch.randn(n, 64)
        for lin, w in zip(lins, weights):
            want = torch.nn.functional.linear(x, w, b)
            got = lin(x)
            assert got.dtype == torch.float32 and got.shape == (n, 96)
            assert (got - want).abs().max() < 0.05 * want.abs().max()
            torch.testing.assert_close(compiled(lin, x), got)
    weights[0].zero_()  # the copy is its own
    x = torch.randn(2, 64)
    assert lins[0](x).abs().max() > 0.1


def test_forced_bf16_falls_back_with_one_warning_where_it_cannot_run(monkeypatch, caplog):
    """Field ``stream_dtype=bfloat16`` on a CPU without a bf16 GEMM: vLLM's modules, and
    a warning that names the field and the reason (was: the worker died in oneDNN)."""
    import logging

    import vllm_specstream.model_executor.stream_weights as sw

    monkeypatch.setattr(sw, "onednn_available", lambda: True)
    monkeypatch.setattr(sw, "bf16_gemm_available", lambda: False)
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    with caplog.at_level(logging.INFO, logger="vllm"):
        got = build_stream_weights(
            [layer],
            torch.randn(8, 4),
            mode="bfloat16",
            platform_is_cpu=True,
            model_dtype=torch.float32,
            tp_size=1,
        )
    assert got is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "stream_dtype=bfloat16 cannot be honoured" in warnings[0].getMessage()
    assert "no bf16 GEMM" in warnings[0].getMessage()


def test_vllm_has_the_fused_rms_norm_the_stream_pass_calls():
    """The stream pass's norms call ``vllm._custom_ops.rms_norm(out, x, weight, eps)``; if a
    vLLM release drops or renames it, the pass would quietly fall back to PyTorch's slower
    norm: fail here instead."""
    from vllm import _custom_ops as ops

    from vllm_specstream.model_executor.stream_weights import _rms_norm_kernel

    assert callable(getattr(ops, "rms_norm", None))
    assert _rms_norm_kernel(torch.float32) is ops.rms_norm  # fp32 rows: every CPU build
    x, w, out = torch.randn(3, 64), torch.randn(64), torch.empty(3, 64)
    ops.rms_norm(out, x, w, 1e-6)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (64,), w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 576), (2, 5, 576), (0, 576)])
def test_fused_rms_norm_matches_pytorchs(dtype, shape):
    from vllm_specstream.model_executor.stream_weights import fused_rms_norm

    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype)
    weight = torch.randn(576)  # the model's (fp32) weight, whatever the rows' dtype
    got = fused_rms_norm(x, weight, 1e-5)
    want = torch.nn.functional.rms_norm(x, (576,), weight.to(dtype), 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    # a non-contiguous view of the rows gives the same as its contiguous copy
    if x.dim() == 2 and x.shape[0] > 1:
        wide = torch.randn(shape[0], 2 * shape[1], dtype=dtype)
        view = wide[:, ::2]
        torch.testing.assert_close(
            fused_rms_norm(view, weight, 1e-5), fused_rms_norm(view.contiguous(), weight, 1e-5)
        )


class _Linear(torch.nn.Module):
    """A projection as vLLM's linear layers return it: ``(y, bias)``."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


def _decoder_layer(hidden: int, intermediate: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
    layer.self_attn.qkv_proj = _Linear(3 * hidden, hidden)
    layer.self_attn.o_proj = _Linear(hidden, hidden)
    layer.mlp.gate_up_proj = _Linear(2 * intermediate, hidden)
    layer.mlp.down_proj = _Linear(hidden, intermediate)
    return layer


@needs_bf16_gemm
def test_stream_rows_get_the_stream_lora_once_with_bf16_copies_or_vllms_modules():
    """A streams-only checkpoint's stream rows compute ``W x + B A x`` in every projection:
    with the bf16 copies (the delta merged into them) as with vLLM's modules (the delta
    added per call); a delta left out or added twice is off by far more than bf16's error."""
    from types import SimpleNamespace

    from vllm_specstream.checkpoint.config import STREAM_LORA_STAGES, stream_lora_name
    from vllm_specstream.model_executor.lora.stream_row_lora import StreamLoRAWeights
    from vllm_specstream.model_executor.stream_weights import StreamWeights, layer_linears

    torch.manual_seed(0)
    layers = [_decoder_layer(64, 96) for _ in range(2)]
    tensors = {}
    for i, layer in enumerate(layers):
        for stage, module in zip(STREAM_LORA_STAGES, layer_linears(layer)):
            out_features, in_features = module.weight.shape
            tensors[stream_lora_name(i, stage, "a")] = torch.randn(4, in_features)
            tensors[stream_lora_name(i, stage, "b")] = torch.randn(out_features, 4)
    lora = StreamLoRAWeights(tensors.__getitem__, SimpleNamespace(num_msa_layers=len(layers)))
    packed = build_stream_weights(
        layers,
        torch.randn(32, 64),
        mode="bfloat16",
        platform_is_cpu=True,
        model_dtype=torch.float32,
        tp_size=1,
        stream_delta=lora.dense,
    )
    assert packed is not None
    for weights in (lora.wrap(packed), lora.wrap(StreamWeights.of_modules(layers))):
        for i, (matmuls, layer) in enumerate(zip(weights.layers, layers)):
            for run, module, stage in zip(
                matmuls.matmuls(), layer_linears(layer), STREAM_LORA_STAGES
            ):
                a = tensors[stream_lora_name(i, stage, "a")]
                b = tensors[stream_lora_name(i, stage, "b")]
                x = torch.randn(3, module.weight.shape[1])
                want = x @ (module.weight + b @ a).T
                torch.testing.assert_close(run(x), want, atol=0.5, rtol=0.02)
