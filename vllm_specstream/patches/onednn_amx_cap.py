"""With oneDNN capped below AMX, vLLM 0.32 runs no AMX kernel (it took them and died).

vLLM chooses its AMX kernels on CPU (bf16 attention, ``cpu_attn._get_attn_isa``; small bf16
GEMMs, ``layers.utils.check_cpu_sgl_kernel``) by ``torch.cpu._is_amx_tile_supported()``,
which reads the CPU's flags. Those kernels run PyTorch's brgemm, which asks oneDNN whether
it may use AMX, and oneDNN is also what asks Linux for the tiles. Under
``ONEDNN_MAX_CPU_ISA`` below AMX (this project's way to measure the CPU classes it lacks on
an AMX CPU, and a user's way to keep oneDNN off AMX) oneDNN says no, and a bf16 engine's
worker died at its first step: ``BFloat16 Brgemm VNNI format is only supported ... when
`amx` is supported`` at a prefill, SIGILL at a short one. Under such a cap the replacement
answers as oneDNN does (no AMX), so vLLM runs the kernels of a CPU without AMX. Applied
only where the cap takes AMX away (:func:`capped_below_amx`).
"""

from __future__ import annotations

from vllm_specstream import machine
from vllm_specstream.patches import Patch

TARGET = "torch.cpu._is_amx_tile_supported"


def capped_below_amx(flags: frozenset[str], onednn_max_isa: str | None) -> bool:
    """Whether the CPU has AMX tiles but ``onednn_max_isa`` keeps oneDNN off them."""
    return "amx_tile" in flags and machine.cpu_class(flags, onednn_max_isa) != "amx"


def no_amx_tiles() -> bool:
    """``torch.cpu._is_amx_tile_supported`` as oneDNN sees the CPU under the cap."""
    return False


def _apply() -> None:
    import torch.cpu

    torch.cpu._is_amx_tile_supported = no_amx_tiles


ONEDNN_AMX_CAP = Patch(
    name="onednn-amx-cap",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="vLLM picks AMX kernels from the CPU's flags, which oneDNN capped below AMX cannot "
    "run: the worker dies at its first bf16 step",
    apply=_apply,
)
