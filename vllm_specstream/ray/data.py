"""Ray Data batch inference with a specstream checkpoint over a JSONL of prompts.

Built on Ray Data's LLM processors (``ray.data.llm``), two ways to run the engines:

* :func:`engine_processor`: a batch job of its own; each Ray Data actor starts a vLLM engine
  (``vLLMEngineProcessorConfig``) with the specstream speculative config, one actor per
  ``SpecStreamServeConfig.num_replicas``;
* :func:`serve_processor`: batches go to a running specstream Ray Serve application
  (:func:`vllm_specstream.ray.serve.build_app`, ``ServeDeploymentProcessorConfig``), which
  spreads them over its replicas: no engine starts, and batch jobs share the serving fleet.

:func:`generate_jsonl` reads ``{"prompt": ...}`` records (a ``max_tokens`` field per record
overrides the default), runs a processor and writes one JSON line per record, in input order,
with ``generated_text`` and ``generated_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_specstream.logger import init_logger
from vllm_specstream.ray.serve import SpecStreamServeConfig, llm_config, server_deployment_name

logger = init_logger(__name__)


@dataclass
class BatchConfig:
    """Sampling and batching of a batch-inference run."""

    max_tokens: int = 128
    """Tokens per record unless the record has ``max_tokens``."""
    temperature: float = 0.0
    batch_size: int = 16
    """Records per Ray Data batch sent to one engine (or deployment call group)."""
    prompt_key: str = "prompt"
    """The JSONL field holding the prompt."""


def _sampling(row: dict[str, Any], batch: BatchConfig) -> dict[str, Any]:
    return {
        "temperature": batch.temperature,
        "max_tokens": int(row.get("max_tokens") or batch.max_tokens),
    }


def engine_processor(config: SpecStreamServeConfig, batch: BatchConfig | None = None):
    """A processor whose ``config.num_replicas`` Ray Data actors each run a specstream engine.

    The engine arguments are those of the Serve deployment (:func:`ray_serve.llm_config`):
    CPU settings, the KV cache size and the speculative config.
    """
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    batch = batch or BatchConfig()
    cfg = llm_config(config)
    engine = dict(cfg.engine_kwargs)
    options: dict[str, Any] = {}
    env = dict(config.env)
    if cfg.placement_group_config:  # CPU: one bundle per engine, as for Serve replicas
        options["placement_group_config"] = cfg.placement_group_config
        # vLLM's automatic binding would put every engine on the same core; unbound, each
        # engine runs the threads of its actor's CPU share and the OS spreads them.
        threads = str(max(1, int(config.cpus_per_replica)))
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": threads, **env}
    processor_config = vLLMEngineProcessorConfig(
        model_source=str(Path(config.checkpoint).resolve()),
        engine_kwargs=engine,
        concurrency=config.num_replicas,
        batch_size=batch.batch_size,
        # vLLM tokenizes and detokenizes in the engine: no extra actor pools.
        chat_template_stage=False,
        tokenize_stage=False,
        detokenize_stage=False,
        runtime_env={"env_vars": env} if env else None,
        **options,
    )
    key = batch.prompt_key
    return build_processor(
        processor_config,
        preprocess=lambda row: {"prompt": row[key], "sampling_params": _sampling(row, batch)},
        postprocess=lambda row: {
            key: row["prompt"],
            "generated_text": row["generated_text"],
            "generated_tokens": [int(t) for t in row["generated_tokens"]],
        },
    )


def serve_processor(
    config: SpecStreamServeConfig, batch: BatchConfig | None = None, *, app_name: str
):
    """A processor that sends each record to the running Serve application ``app_name``,
    built from ``config`` with :func:`vllm_specstream.ray.serve.build_app`."""
    from ray.data.llm import ServeDeploymentProcessorConfig, build_processor
    from ray.serve.llm.openai_api_models import CompletionRequest

    batch = batch or BatchConfig()
    processor_config = ServeDeploymentProcessorConfig(
        deployment_name=server_deployment_name(config),
        app_name=app_name,
        dtype_mapping={"CompletionRequest": CompletionRequest},
        batch_size=batch.batch_size,
        concurrency=1,  # one client actor: the deployment's replicas do the work
    )
    key, model = batch.prompt_key, config.model_id
    return build_processor(
        processor_config,
        preprocess=lambda row: {
            "method": "completions",
            "dtype": "CompletionRequest",
            "request_kwargs": {
                "model": model,
                "prompt": row[key],
                "stream": False,
                "return_token_ids": True,
                **_sampling(row, batch),
            },
            key: row[key],
        },
        postprocess=lambda row: {
            key: row[key],
            "generated_text": row["choices"][0]["text"],
            "generated_tokens": [int(t) for t in row["choices"][0]["token_ids"]],
        },
    )


def generate_jsonl(processor, input_path: str | Path, output_path: str | Path) -> int:
    """Run ``processor`` over the JSONL at ``input_path``; write results in input order."""
    import ray

    options = ray.data.DataContext.get_current().execution_options
    preserve_order, options.preserve_order = options.preserve_order, True
    written = 0
    try:
        dataset = processor(ray.data.read_json(str(input_path)))
        with open(output_path, "w") as out:
            for row in dataset.iter_rows():
                out.write(json.dumps(row) + "\n")
                written += 1
    finally:
        options.preserve_order = preserve_order
    logger.info("vllm-specstream: %d records -> %s", written, output_path)
    return written


__all__ = [
    "BatchConfig",
    "engine_processor",
    "generate_jsonl",
    "serve_processor",
]
