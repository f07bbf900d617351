"""vLLM plugin entry point (``vllm.general_plugins``): registers vllm-specstream with vLLM.

vLLM calls :func:`register` in every process it starts (front-end, engine core, each
worker, registry-inspection subprocesses), for every engine, so it is idempotent and cheap:
model classes are registered by ``"module:Class"`` string and imported only when a
checkpoint asks for them, and it installs only the two front-end hooks that read an engine's
arguments (``spec-model-alias``, ``engine-config-check``), which leave other engines' configs as
they are.

Everything else the plugin changes in a process (the fixes of vLLM in ``patches/``, the
Intel OpenMP preload) comes only with an engine that speculates with specstream or serves a
specstream checkpoint (:mod:`vllm_specstream.patches.engine_scope`); registration applies
the fixes where that module's marker is set.
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


def _install_hooks(vllm_version: str) -> None:
    """The front-end hooks, in every process: they act only on a specstream engine's config."""
    from vllm_specstream.patches import apply_patch
    from vllm_specstream.patches.engine_config_check import ENGINE_CONFIG_CHECK
    from vllm_specstream.patches.spec_alias import SPEC_ALIAS

    apply_patch(SPEC_ALIAS, vllm_version)
    apply_patch(ENGINE_CONFIG_CHECK, vllm_version)


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

    from vllm_specstream.patches.engine_scope import ENV_PATCHES, apply_engine_patches

    _install_hooks(vllm_version)
    if os.environ.get(ENV_PATCHES) == "1":
        apply_engine_patches(vllm_version)
    _registered = True
    from vllm_specstream.patches import applied_patches

    logger.debug(
        "vllm-specstream registered with vLLM %s in process %d (%s; patches: %s)",
        vllm_version,
        os.getpid(),
        ", ".join(MODEL_CLASSES) or "no model classes",
        ", ".join(sorted(applied_patches())),
    )
