"""The plugin's process-level changes, only where a specstream engine runs.

vLLM loads the plugin in every process, for every engine; registration installs only two
front-end hooks that leave other engines alone. The rest (the fixes of vLLM in
``patches/``, the Intel OpenMP preload) is applied only for an engine that speculates with
specstream or serves a specstream checkpoint: when the config hook sees one (before vLLM
builds its config), :func:`enter_specstream_engine` applies it in that process and sets
:data:`ENV_PATCHES`, so that the engine's own processes, spawned after, apply the fixes at
registration. A plain engine built later in the same process takes back the preload and the
variable (:func:`enter_plain_engine`; patches applied in a process stay).
``SPECSTREAM_VLLM_PATCHES=1`` set by the user applies the fixes to every engine (e.g. vLLM's
CPU multi-LoRA fix for plain engines).
"""

from __future__ import annotations

import os

from vllm_specstream.logger import init_logger

logger = init_logger(__name__)

#: "1" in the processes of a specstream engine (set by the plugin) or of every engine (set
#: by the user): vLLM's plugin loading applies :func:`apply_engine_patches` there.
ENV_PATCHES = "SPECSTREAM_VLLM_PATCHES"

#: What :func:`enter_specstream_engine` set in this process, to take back for a plain engine.
_set_here: dict[str, str] = {}


def apply_engine_patches(vllm_version: str) -> None:
    """Fixes for vLLM itself that a specstream engine needs, each guarded by its version
    range (see patches/)."""
    from vllm.platforms import current_platform

    from vllm_specstream.patches import apply_patch
    from vllm_specstream.patches.lora_adapter_streams import LORA_ADAPTER_STREAMS

    apply_patch(LORA_ADAPTER_STREAMS, vllm_version)
    if current_platform.is_cpu():
        from vllm_specstream.machine import cpu_info
        from vllm_specstream.patches.cpu_expand_kernel import EXPAND_KERNEL
        from vllm_specstream.patches.cpu_kernel_registration import CPU_KERNEL_REGISTRATION
        from vllm_specstream.patches.cpu_lora_linear import CPU_LORA_LINEAR
        from vllm_specstream.patches.cpu_lora_ops import CPU_LORA_OPS
        from vllm_specstream.patches.onednn_amx_cap import ONEDNN_AMX_CAP, capped_below_amx
        from vllm_specstream.patches.pipeline_speculation import PIPELINE_SPECULATION

        apply_patch(EXPAND_KERNEL, vllm_version)
        apply_patch(CPU_KERNEL_REGISTRATION, vllm_version)
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
        if capped_below_amx(cpu_info()[1], cap) and apply_patch(ONEDNN_AMX_CAP, vllm_version):
            logger.debug("ONEDNN_MAX_CPU_ISA=%s keeps oneDNN off AMX: so are vLLM's kernels", cap)
        apply_patch(CPU_LORA_OPS, vllm_version)
        apply_patch(CPU_LORA_LINEAR, vllm_version)
        apply_patch(PIPELINE_SPECULATION, vllm_version)
    # The runner patches of draft trees and suffix drafts are applied by the proposer that
    # asks for them: they depend on the engine's config, which registration does not see.


def enter_specstream_engine(vllm_version: str) -> None:
    """A specstream engine is being built in this process (before vLLM builds its config):
    patch this process, preload Intel OpenMP and mark the environment for the engine's
    processes."""
    from vllm_specstream.patches.cpu_env import apply_cpu_env

    if os.environ.get(ENV_PATCHES) != "1":
        os.environ[ENV_PATCHES] = "1"
        _set_here[ENV_PATCHES] = "1"
    if "LD_PRELOAD" not in _set_here:
        preloaded = apply_cpu_env()
        if preloaded:
            _set_here["LD_PRELOAD"] = preloaded
    apply_engine_patches(vllm_version)


def enter_plain_engine() -> None:
    """Another engine is being built in this process: take back what
    :func:`enter_specstream_engine` set here, so that its processes start as vLLM's own."""
    from vllm_specstream.patches.cpu_env import without_preload

    if _set_here.pop(ENV_PATCHES, None):
        os.environ.pop(ENV_PATCHES, None)
    preloaded = _set_here.pop("LD_PRELOAD", None)
    if preloaded:
        os.environ["LD_PRELOAD"] = without_preload(os.environ.get("LD_PRELOAD", ""), preloaded)
