"""Checks a specstream setup where vLLM builds its engine config, before the engine spawns.

vLLM 0.32 builds and validates ``VllmConfig`` in the front-end process
(``EngineArgs.create_engine_config``, called by ``LLM(...)``, ``vllm serve`` and
``AsyncLLM.from_engine_args``) and only then starts the engine core and its workers, where
the model is built and the ``custom_class`` proposer imported. Errors raised there reach the
user inside several processes' tracebacks; raised here they are the last line printed. The
wrapper below lets vLLM build the config, then runs, for a specstream engine,
:func:`check_settings` (its settings, resolved once and handed down) and
:func:`vllm_specstream.speculation.preflight.check_setup` on it. For a specstream engine on a CPU
without native bf16 it also acts on the dtype (:func:`vllm_specstream.speculation.preflight.dtype_advice`):
with ``--dtype auto`` and a bf16 checkpoint the config is built in float32 (said once);
with an explicit ``--dtype bfloat16``, a warning with the fix. ``register()`` applies it in
every process; only the front-end builds an engine config.
"""

from __future__ import annotations

from vllm_specstream.patches import Patch

TARGET = "vllm.engine.arg_utils.EngineArgs.create_engine_config"


def check_vllm_config(vllm_config) -> None:
    """:func:`~vllm_specstream.speculation.preflight.check_setup` on vLLM's engine config (the only
    place that reads ``VllmConfig`` fields for it)."""
    from vllm.platforms import current_platform

    from vllm_specstream.speculation.preflight import check_setup

    model_config = vllm_config.model_config
    spec = vllm_config.speculative_config
    parallel = getattr(vllm_config, "parallel_config", None)
    pp = getattr(parallel, "pipeline_parallel_size", 1)
    settings = check_settings(vllm_config) if _serves_specstream(vllm_config) else None
    check_setup(
        model=model_config.model,
        hf_config=model_config.hf_config,
        spec_method=getattr(spec, "method", None),
        spec_model=getattr(spec, "model", None),
        num_speculative_tokens=getattr(spec, "num_speculative_tokens", None),
        platform=current_platform,
        load_format=vllm_config.load_config.load_format,
        lora_enabled=getattr(vllm_config, "lora_config", None) is not None,
        tensor_parallel_size=getattr(parallel, "tensor_parallel_size", 1),
        pipeline_parallel_size=pp,
        last_rank_start=last_rank_start_of(model_config.hf_config, pp),
        settings=settings,
    )
    if settings is not None and settings.num_speculative_tokens and current_platform.is_cpu():
        _bind_worker_threads(vllm_config)


def last_rank_start_of(hf_config, pp: int) -> int:
    """The first layer of the last of ``pp`` pipeline ranks, as vLLM splits the layers
    (``VLLM_PP_LAYER_PARTITION`` included)."""
    layers = getattr(hf_config, "num_hidden_layers", None)
    if pp <= 1 or not layers:
        return 0
    from vllm.distributed.utils import get_pp_indices

    return get_pp_indices(layers, pp - 1, pp)[0]


def check_settings(vllm_config, environ=None):
    """The engine's settings resolved once
    (:func:`~vllm_specstream.speculation.settings.resolve_settings`), here so that a bad field
    or a malformed ``num_speculative_tokens_per_batch_size`` (vLLM's own validator) is
    refused before the engine spawns; handed down to the engine's model and proposer in
    ``vllm_config`` (:func:`~vllm_specstream.speculation.settings.hand_down`)."""
    from vllm_specstream.checkpoint.config import ConfigError
    from vllm_specstream.patches.vllm_schedule import schedule_lookup
    from vllm_specstream.speculation.settings import hand_down, resolve_settings

    settings = resolve_settings(vllm_config, environ)
    if settings.schedule:
        scheduler = getattr(vllm_config, "scheduler_config", None)
        max_seqs = max(int(getattr(scheduler, "max_num_seqs", 0) or 0), 1)
        try:
            schedule_lookup(list(settings.schedule), max_seqs, settings.num_speculative_tokens)
        except ValueError as e:
            raise ConfigError(f"speculative_config {e}") from e
    hand_down(vllm_config, settings)
    return settings


def _bind_worker_threads(vllm_config) -> None:
    """Where the user chose no OpenMP binding and vLLM's would leave a speculating engine's
    worker one thread, the engine processes (spawned after this) get every core
    (:func:`vllm_specstream.patches.cpu_env.speculation_binding`); said once."""
    import os

    from vllm_specstream.logger import init_logger
    from vllm_specstream.patches.cpu_env import ENV_OMP_BIND, physical_cores, speculation_binding

    cores = physical_cores()
    world = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)
    binding = speculation_binding(os.environ, cores, world)
    if binding is None:
        return
    os.environ[ENV_OMP_BIND] = binding
    init_logger(__name__).info(
        "vllm-specstream: %s=%s: vLLM's 'auto' binding would leave this speculating engine "
        "1 OpenMP thread of %d cores, and speculative steps need more (set %s to choose)",
        ENV_OMP_BIND,
        binding,
        cores,
        ENV_OMP_BIND,
    )


def _serves_specstream(vllm_config) -> bool:
    """:func:`~vllm_specstream.speculation.preflight.serves_specstream` of vLLM's engine config."""
    from vllm_specstream.speculation.preflight import serves_specstream

    spec = vllm_config.speculative_config
    architectures = getattr(vllm_config.model_config.hf_config, "architectures", None)
    return serves_specstream(
        architectures, getattr(spec, "method", None), getattr(spec, "model", None)
    )


def _local_config(engine_args) -> dict:
    """A local checkpoint's ``config.json`` ({} where there is none or it is not JSON)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(str(engine_args.model)) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def engine_args_serve_specstream(engine_args) -> bool:
    """Whether ``engine_args`` (before vLLM builds their config) ask for a specstream engine:
    a local specstream checkpoint (or a base given the architecture by ``hf_overrides``, as
    ``specstream deploy`` does), or the proposer (or its ``specstream`` alias) in the
    speculative config."""
    from vllm_specstream.patches.spec_alias import ALIAS
    from vllm_specstream.speculation.preflight import serves_specstream

    spec = engine_args.speculative_config
    spec = spec if isinstance(spec, dict) else {}
    method, model = spec.get("method"), spec.get("model")
    if ALIAS in (method, model):
        return True
    overrides = getattr(engine_args, "hf_overrides", None)
    overrides = overrides if isinstance(overrides, dict) else {}
    architectures = overrides.get("architectures") or _local_config(engine_args).get(
        "architectures"
    )
    return serves_specstream(architectures, method, model)


def _checkpoint_dtype(engine_args) -> str | None:
    """``torch_dtype`` of a local checkpoint's ``config.json`` if it is a specstream
    checkpoint or the speculative config names this package's proposer (else None)."""
    if not engine_args_serve_specstream(engine_args):
        return None
    config = _local_config(engine_args)
    return str(config.get("torch_dtype") or config.get("dtype") or "")


def _advise_dtype(engine_args, vllm_config=None) -> None:
    """Before the config is built (``vllm_config`` None): ``--dtype auto`` with a bf16
    specstream checkpoint on a CPU without native bf16 becomes float32, said once. After:
    an explicit bf16 there gets a warning with the fix."""
    from vllm.platforms import current_platform

    from vllm_specstream.logger import init_logger
    from vllm_specstream.speculation.preflight import dtype_advice

    if not current_platform.is_cpu():
        return
    requested = str(engine_args.dtype)
    if vllm_config is None:
        if requested != "auto" or _checkpoint_dtype(engine_args) != "bfloat16":
            return
        dtype, message = dtype_advice("bfloat16", requested)
    else:
        if requested == "auto" or not _serves_specstream(vllm_config):
            return
        resolved = str(vllm_config.model_config.dtype).removeprefix("torch.")
        dtype, message = dtype_advice(resolved, requested)
    if message:
        logger = init_logger(__name__)
        (logger.info if dtype else logger.warning)("vllm-specstream: %s", message)
    if dtype:
        engine_args.dtype = dtype


def _scope_process(engine_args) -> None:
    """The plugin's process-level changes for a specstream engine only
    (:mod:`vllm_specstream.patches.engine_scope`)."""
    from vllm_specstream.patches import engine_scope
    from vllm_specstream.patches.vllm_version import ensure_supported_vllm

    if engine_args_serve_specstream(engine_args):
        engine_scope.enter_specstream_engine(ensure_supported_vllm())
    else:
        engine_scope.enter_plain_engine()


def _apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        # Before vLLM's platform reads LD_PRELOAD (while it builds the config).
        _scope_process(self)
        _advise_dtype(self)
        config = original(self, *args, **kwargs)
        _advise_dtype(self, config)
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
