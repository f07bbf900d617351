"""An AVX2-only CPU on a machine with AVX-512 or AMX, for running the suite as it runs there
(docs/testing.md, "Every CPU class"): on ``PYTHONPATH``, this module is imported at the start
of every Python process, the engines' included, and makes PyTorch's CPU-flag probes deny
AVX-512 and AMX. vLLM picks its kernel library (``_C_AVX2``), attention and small-GEMM paths
from these probes, and the plugin its stream-pass precision; ``ATEN_CPU_CAPABILITY=avx2``
(PyTorch's kernels and TorchInductor's vector width) and ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN)
cap the rest."""

import torch.cpu

for _probe in (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
