"""A smaller CPU class on a machine with AVX-512 or AMX, for running the suite as it runs
there (docs/testing.md, "Every CPU class on one machine"): on ``PYTHONPATH``, this module is
imported at the start of every Python process, the engines' included, and makes PyTorch's
CPU-flag probes deny AVX-512 and AMX (``EMULATE_CPU_CLASS=avx512``: deny only AVX512-BF16 and
AMX, an AVX-512 CPU without native bf16). vLLM picks its kernel library (``_C_AVX2``,
``_C_AVX512``), attention and small-GEMM paths from these probes, and the plugin its
stream-pass precision; ``ATEN_CPU_CAPABILITY`` (PyTorch's kernels and TorchInductor's vector
width) and ``ONEDNN_MAX_CPU_ISA`` (oneDNN) cap the rest, and this module caps PyTorch's fbgemm
(the int8 stream pass) with ``FBGEMM_ENABLE_INSTRUCTIONS``, read at its first call.

Compile caches of their own: TorchInductor's and vLLM's cache keys do not name the vector
width, so a graph traced here (AVX2 tiling) and reloaded by a native run would have its
kernels built for AVX-512 vectors and write past its buffers."""

import os
import tempfile

import torch.cpu

_DENIED = ["_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"]
_AVX2 = os.environ.get("EMULATE_CPU_CLASS", "avx2") == "avx2"
if _AVX2:
    _DENIED += ["_is_avx512_supported", "_is_avx512_vnni_supported"]
os.environ.setdefault("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2" if _AVX2 else "AVX512")
_CLASS = "avx2" if _AVX2 else "avx512"
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"torchinductor-emulated-{_CLASS}"),
)
os.environ.setdefault(
    "VLLM_CACHE_ROOT", os.path.join(os.path.expanduser("~/.cache"), f"vllm-emulated-{_CLASS}")
)
for _probe in _DENIED:
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
