"""Checks of a specstream setup that run in vLLM's front-end, before the engine spawns.

An exception raised in vLLM's engine core or worker reaches the user buried in several
processes' tracebacks; one raised while the front-end builds the engine config is the last
thing printed. So everything knowable from the settings, the platform and the checkpoint's
``config.json`` and safetensors headers is checked here (the hook that calls
:func:`check_setup` is ``patches/engine_config_check.py``). The model class and the proposer
check the same things again at load time, for engines built without the front-end.
"""

from __future__ import annotations

from pathlib import Path

from vllm_specstream.checkpoint.config import MERGED_ARCHITECTURE, ConfigError
from vllm_specstream.checkpoint.merged import (
    ADAPTER_STREAMS_ONLY,
    adapter_streams_only,
    check_stream_tensors,
    read_specstream_section,
)
from vllm_specstream.machine import cpu_class, native_bf16
from vllm_specstream.speculation.settings import (
    EngineSettings,
    check_proposer,
    draft_tree_of,
)
from vllm_specstream.speculation.suffix_drafts import suffix_cache_class

#: Any ``custom_class`` proposer of this package (``--spec-model vllm_specstream.model_executor.proposer.X``;
#: the ``specstream`` alias resolves to one before the check runs).
PROPOSER_PREFIX = "vllm_specstream."

#: vLLM load formats that read the checkpoint's safetensors files (others: no tensor check).
SAFETENSORS_LOAD_FORMATS = ("auto", "safetensors")


def platform_error(platform_name: str) -> str:
    return (
        "vllm-specstream's stream pass runs on vLLM's CPU backend only (verified on vLLM 0.32 "
        f"CPU); platform {platform_name} is not supported yet: serve without --spec-model "
        "(LLM(...) without speculative_config) to run the checkpoint as a plain model"
    )


def check_platform(platform) -> None:
    """Refuse speculation on any platform but vLLM's CPU backend (``platform``: vLLM's
    ``current_platform``). The stream pass calls CPU-only cache kernels and reads the CPU
    KV-cache layout; on CUDA it would fail at the first speculative step, unclearly."""
    if not platform.is_cpu():
        name = getattr(platform, "device_name", None) or type(platform).__name__
        raise ConfigError(platform_error(name))


#: A streams-only checkpoint's stream LoRA applies to its own streams; under multi-LoRA a
#: request's adapter brings its own streams (and their LoRA), so the two do not combine.
STREAM_LORA_WITH_LORA = (
    "a streams-only checkpoint (config.json: specstream.stream_lora_rank > 0) cannot be "
    "served with LoRA adapters (--enable-lora): serve it without --enable-lora"
)

#: Under pipeline parallelism the streams run on the last rank, beside the main keys and
#: values of the MSA layers they attend to; tree rows would need their masks on every rank.
PP_MSA_SPAN_ERROR = (
    "{config_file}: specstream.num_msa_layers={msa} puts the MSA layers at {first}-{last}, but "
    "at pipeline_parallel_size {pp} the last rank holds layers {start}-{last}: the streams "
    "attend to the main keys and values of every MSA layer and run on the last rank only; "
    "give the last rank at least {msa} layers (VLLM_PP_LAYER_PARTITION, e.g. {partition}), or "
    "speculate with tensor parallelism (-tp) instead"
)
PP_TREES_ERROR = (
    "draft trees (specstream.tree_top_k) run with pipeline_parallel_size 1 only, got {pp}: "
    "the tree rows' attention is set up on the last rank, which holds the proposer; "
    "speculate with chains at -pp {pp} (leave tree_top_k unset) or with trees at -tp"
)
PP_ADAPTER_STREAMS_ERROR = (
    "{config_file}: per-adapter streams under multi-LoRA run with pipeline_parallel_size 1 "
    "only, got {pp}: serve the adapters at -tp instead, or a merged checkpoint at -pp"
)

#: A base served for adapters has no streams of its own: without LoRA nothing drafts.
ADAPTER_STREAMS_NEED_LORA = (
    f"{{where}}: specstream.{ADAPTER_STREAMS_ONLY} is set (a base model whose requests draft "
    "with their LoRA adapter's streams) but LoRA is off; serve it with --enable-lora "
    "(LLM(..., enable_lora=True))"
)


def uses_specstream_proposer(method: str | None, model: str | None) -> bool:
    return method == "custom_class" and str(model or "").startswith(PROPOSER_PREFIX)


def check_setup(
    *,
    model: str,
    hf_config,
    spec_method: str | None,
    spec_model: str | None,
    num_speculative_tokens: int | None,
    platform,
    load_format: str = "auto",
    lora_enabled: bool = False,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    last_rank_start: int = 0,
    settings: EngineSettings | None = None,
) -> None:
    """Raise :class:`ConfigError` naming the file, field or flag and the fix, if this
    engine config cannot serve: ``model`` is vLLM's model path, ``hf_config`` its parsed
    ``config.json``, ``spec_*`` the resolved speculative config (None without one),
    ``last_rank_start`` the first layer of the last pipeline rank (vLLM's split),
    ``settings`` the engine's settings
    (:func:`~vllm_specstream.patches.engine_config_check.check_settings`; None: the defaults).
    The fields themselves were validated when they were resolved."""
    if spec_method == "custom_class":
        check_proposer(spec_model)
    speculating = uses_specstream_proposer(spec_method, spec_model)
    settings = settings or EngineSettings(num_speculative_tokens=num_speculative_tokens or 0)
    if speculating:
        check_platform(platform)
    model_dir = Path(model)
    local = model_dir.is_dir()
    config_file = f"{model_dir / 'config.json'}" if local else f"{model} config.json"
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if MERGED_ARCHITECTURE not in architectures:
        if speculating:
            raise ConfigError(
                f"the specstream proposer needs a {MERGED_ARCHITECTURE} checkpoint, got "
                f"{model} ({config_file}: architectures {architectures}); export one with "
                "`specstream export ADAPTER OUT`, or serve this model without "
                "--spec-model (LLM(...) without speculative_config)"
            )
        return
    config = read_specstream_section(hf_config, where=config_file)
    pipelined = speculating and bool(num_speculative_tokens) and pipeline_parallel_size > 1
    if adapter_streams_only(hf_config, where=config_file):
        if pipelined:
            raise ConfigError(
                PP_ADAPTER_STREAMS_ERROR.format(config_file=config_file, pp=pipeline_parallel_size)
            )
        if speculating and not lora_enabled:
            raise ConfigError(ADAPTER_STREAMS_NEED_LORA.format(where=config_file))
        return  # no stream tensors of its own to check
    if speculating and config.stream_lora_rank and lora_enabled:
        raise ConfigError(f"{config_file}: {STREAM_LORA_WITH_LORA}")
    if speculating and num_speculative_tokens:
        _check_drafts(num_speculative_tokens, settings, config.num_streams, config_file)
    if pipelined:
        _check_pipeline(
            pipeline_parallel_size, last_rank_start, settings, config, hf_config, config_file
        )
    if local and str(load_format) in SAFETENSORS_LOAD_FORMATS:
        check_stream_tensors(model_dir, config, hf_config)


def _check_drafts(k: int, settings: EngineSettings, num_streams: int, config_file: str) -> None:
    """What a speculating engine's drafts need: arctic-inference for suffix drafts the user
    asked for, a tree that fills ``k`` nodes, or at most ``num_streams`` chain drafts."""
    if settings.suffix_drafts is not None and not settings.suffix_from_checkpoint:
        suffix_cache_class()  # raises, naming the field, where arctic-inference is missing
    if settings.trees:
        draft_tree_of(settings, num_streams)  # raises on a size the tree cannot fill
    elif k > num_streams:
        raise ConfigError(
            f"num_speculative_tokens={k} exceeds the checkpoint's num_streams={num_streams} "
            f"({config_file}: specstream.num_streams); ask for at most {num_streams} drafts: "
            f"--spec-tokens {num_streams}, or speculative_config({num_streams})"
        )


def _check_pipeline(
    pp: int, start: int, settings: EngineSettings, config, hf_config, config_file: str
) -> None:
    """Speculation at ``pp`` pipeline ranks, the last holding the layers from ``start`` on:
    chains, with every MSA layer on the last rank."""
    if settings.trees:
        raise ConfigError(PP_TREES_ERROR.format(pp=pp))
    layers = hf_config.num_hidden_layers
    first = config.first_msa_layer(layers)
    if first < start:  # the layers below the MSA layers, spread over the other ranks:
        partition = ",".join(str(first // (pp - 1) + (i < first % (pp - 1))) for i in range(pp - 1))
        raise ConfigError(
            PP_MSA_SPAN_ERROR.format(
                config_file=config_file,
                msa=config.num_msa_layers,
                first=first,
                last=layers - 1,
                pp=pp,
                start=start,
                partition=f"{partition},{config.num_msa_layers}",
            )
        )


def serves_specstream(architectures, spec_method: str | None, spec_model: str | None) -> bool:
    """Whether an engine of a model with ``architectures`` (``config.json``) serves a
    specstream checkpoint or speculates with the proposer."""
    return MERGED_ARCHITECTURE in (architectures or []) or uses_specstream_proposer(
        spec_method, spec_model
    )


def dtype_advice(resolved: str, requested: str, cls: str | None = None) -> tuple[str | None, str]:
    """What to do about serving in ``resolved`` (vLLM's dtype from ``requested``, the
    user's ``--dtype``) on a CPU of class ``cls`` (default: this CPU's): ``(dtype to build
    the engine with instead or None, message or "")``.

    Where the CPU has no native bf16 (AVX2, or AVX-512 without AVX512-BF16/AMX), oneDNN
    emulates bf16 and a bf16 model runs slower than the same weights in fp32 (measured on an
    AVX2-only CPU: specstream 0.67x of plain, plain itself slower than fp32). With
    ``--dtype auto`` the engine is built in float32 (bf16 weights widen to fp32 exactly);
    with an explicit ``--dtype bfloat16`` the user's choice stands and the message says how
    to get the fast path.
    """
    cls = cls or cpu_class()
    if resolved != "bfloat16" or native_bf16(cls):
        return None, ""
    why = f"this CPU ({cls}) has no native bf16 matmul, so bf16 is emulated and slower than fp32"
    if requested in ("auto", "", None):
        return "float32", (
            f"serving the bf16 checkpoint in float32: {why} (the bf16 weights widen to fp32 "
            "exactly; pass --dtype bfloat16, LLM(dtype='bfloat16'), to keep bf16)"
        )
    return None, (
        f"--dtype bfloat16 on a CPU without native bf16: {why}; pass --dtype float32 "
        "(LLM(dtype='float32')) for the faster path"
    )
