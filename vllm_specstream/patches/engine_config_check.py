"""Checks a specstream setup where vLLM builds its engine config, before the engine spawns.

vLLM 0.32 builds and validates ``VllmConfig`` in the front-end process
(``EngineArgs.create_engine_config``, called by ``LLM(...)``, ``vllm serve`` and
``AsyncLLM.from_engine_args``) and only then starts the engine core and its workers, where
the model is built and the ``custom_class`` proposer imported. Errors raised there reach the
user inside several processes' tracebacks; raised here they are the last line printed. The
wrapper below lets vLLM build the config unchanged, then runs
:func:`vllm_specstream.preflight.check_setup` on it. ``register()`` applies it in every
process; only the front-end builds an engine config.
"""

from __future__ import annotations

from vllm_specstream.patches import Patch

TARGET = "vllm.engine.arg_utils.EngineArgs.create_engine_config"


def check_vllm_config(vllm_config) -> None:
    """:func:`~vllm_specstream.preflight.check_setup` on vLLM's engine config (the only
    place that reads ``VllmConfig`` fields for it)."""
    from vllm.platforms import current_platform

    from vllm_specstream.preflight import check_setup

    model_config = vllm_config.model_config
    spec = vllm_config.speculative_config
    check_setup(
        model=model_config.model,
        hf_config=model_config.hf_config,
        spec_method=getattr(spec, "method", None),
        spec_model=getattr(spec, "model", None),
        num_speculative_tokens=getattr(spec, "num_speculative_tokens", None),
        platform=current_platform,
        load_format=vllm_config.load_config.load_format,
    )


def _apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        check_vllm_config(config)
        return config

    create_engine_config.__wrapped__ = original
    EngineArgs.create_engine_config = create_engine_config


ENGINE_CONFIG_CHECK = Patch(
    name="engine-config-check",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="vLLM has no plugin hook that sees the model and speculative config in the "
    "front-end; errors raised in the engine's processes are buried in their tracebacks",
    apply=_apply,
)
