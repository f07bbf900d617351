"""The stream pass's bf16 matmuls: vLLM's oneDNN GEMM ops still behave as the plugin uses
them, and the choice between bf16 copies and vLLM's modules follows the rules."""

import pytest
import torch

from vllm_specstream.config import ConfigError
from vllm_specstream.model_executor.stream_weights import (
    ENV_STREAM_DTYPE,
    PackedLinear,
    onednn_available,
    packed_reason,
    stream_dtype_mode,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="vLLM without oneDNN GEMM")


@needs_onednn
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


def test_stream_dtype_mode_reads_and_checks_the_variable(monkeypatch):
    monkeypatch.delenv(ENV_STREAM_DTYPE, raising=False)
    assert stream_dtype_mode() == "auto"
    monkeypatch.setenv(ENV_STREAM_DTYPE, "BFloat16")
    assert stream_dtype_mode() == "bfloat16"
    monkeypatch.setenv(ENV_STREAM_DTYPE, "fp8")
    with pytest.raises(ConfigError, match=f"{ENV_STREAM_DTYPE}='fp8'.*auto"):
        stream_dtype_mode()


def test_packed_reason_rules(monkeypatch):
    import vllm_specstream.model_executor.stream_weights as sw

    monkeypatch.setattr(sw, "onednn_available", lambda: True)
    monkeypatch.setattr(sw, "native_bf16_cpu", lambda: True)
    f32, bf16 = torch.float32, torch.bfloat16
    assert packed_reason("auto", True, f32, 1) is None
    assert "model" in packed_reason("model", True, f32, 1)
    assert "CPU" in packed_reason("auto", False, f32, 1)
    assert "tensor parallel" in packed_reason("bfloat16", True, f32, 2)
    assert "bfloat16" in packed_reason("auto", True, bf16, 1)
    assert packed_reason("bfloat16", True, bf16, 1) is None  # forced: no dtype rule
    monkeypatch.setattr(sw, "native_bf16_cpu", lambda: False)
    assert "native bf16" in packed_reason("auto", True, f32, 1)
    assert packed_reason("bfloat16", True, f32, 1) is None
    monkeypatch.setattr(sw, "onednn_available", lambda: False)
    assert "oneDNN" in packed_reason("bfloat16", True, f32, 1)
