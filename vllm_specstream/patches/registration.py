"""vLLM plugin entry point (``vllm.general_plugins``): registers vllm-specstream with vLLM.

vLLM calls :func:`register` in every process it starts (front-end, engine core, each
worker, registry-inspection subprocesses), so it is idempotent and cheap: model classes are
registered by ``"module:Class"`` string and imported only when a checkpoint asks for them.
"""

from __future__ import annotations

import os

from vllm_specstream.logger import init_logger

logger = init_logger(__name__)

#: Architectures this plugin adds to vLLM's ModelRegistry, by lazy import path.
MODEL_CLASSES: dict[str, str] = {
    "SpecStreamForCausalLM": "vllm_specstream.model_executor.specstream:SpecStreamForCausalLM",
}

_registered = False


def _apply_patches(vllm_version: str) -> None:
    """Fixes for vLLM itself, each guarded by its version range (see patches/)."""
    from vllm.platforms import current_platform

    from vllm_specstream.patches import apply_patch
    from vllm_specstream.patches.engine_config_check import ENGINE_CONFIG_CHECK
    from vllm_specstream.patches.lora_adapter_streams import LORA_ADAPTER_STREAMS
    from vllm_specstream.patches.spec_alias import SPEC_ALIAS

    apply_patch(SPEC_ALIAS, vllm_version)
    apply_patch(ENGINE_CONFIG_CHECK, vllm_version)
    apply_patch(LORA_ADAPTER_STREAMS, vllm_version)
    if current_platform.is_cpu():
        from vllm_specstream.machine import cpu_info
        from vllm_specstream.patches.cpu_expand_kernel import EXPAND_KERNEL
        from vllm_specstream.patches.cpu_kernel_registration import CPU_KERNEL_REGISTRATION
        from vllm_specstream.patches.cpu_lora_linear import CPU_LORA_LINEAR
        from vllm_specstream.patches.cpu_lora_ops import CPU_LORA_OPS
        from vllm_specstream.patches.onednn_amx_cap import ONEDNN_AMX_CAP, capped_below_amx

        apply_patch(EXPAND_KERNEL, vllm_version)
        apply_patch(CPU_KERNEL_REGISTRATION, vllm_version)
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
        if capped_below_amx(cpu_info()[1], cap) and apply_patch(ONEDNN_AMX_CAP, vllm_version):
            logger.debug("ONEDNN_MAX_CPU_ISA=%s keeps oneDNN off AMX: so are vLLM's kernels", cap)
        apply_patch(CPU_LORA_OPS, vllm_version)
        apply_patch(CPU_LORA_LINEAR, vllm_version)
    # The runner patches of draft trees and suffix drafts are applied by the proposer that
    # asks for them: they depend on the engine's config, which registration does not see.


def register() -> None:
    """Check the vLLM version and register vllm-specstream's model classes. Idempotent."""
    global _registered
    if _registered:
        return
    from vllm_specstream.patches.vllm_version import UnsupportedVLLMVersion, ensure_supported_vllm

    try:
        vllm_version = ensure_supported_vllm()
    except UnsupportedVLLMVersion as e:
        # vLLM only logs a plugin's exception with a long traceback; one line says it better.
        logger.error("%s The plugin is not loaded.", e)
        return

    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, path in MODEL_CLASSES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, path)

    from vllm_specstream.patches.cpu_env import apply_cpu_env

    apply_cpu_env()
    _apply_patches(vllm_version)
    _registered = True
    logger.debug(
        "vllm-specstream registered with vLLM %s in process %d (%s)",
        vllm_version,
        os.getpid(),
        ", ".join(MODEL_CLASSES) or "no model classes",
    )
