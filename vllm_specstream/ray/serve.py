"""Ray Serve application for a specstream checkpoint: N vLLM replicas behind one endpoint.

Built on Ray Serve's LLM support (``ray.serve.llm``) rather than a hand-written deployment:

* it runs vLLM's ``AsyncLLM`` in each replica and serves vLLM's own OpenAI layer
  (``/v1/completions``, ``/v1/chat/completions``, streaming, ``/v1/models``) through one
  ingress that spreads requests over the replicas: the same API as ``vllm serve``;
* on GPUs it starts each replica's engine with ``distributed_executor_backend="ray"`` in a
  placement group sized by tensor x pipeline parallelism: vLLM's Ray executor, whose workers
  run the same model code as the multiprocessing executor's;
* on CPUs (``accelerator_config={"kind": "cpu"}``) it uses vLLM's multiprocessing executor,
  the only one vLLM allows there (its Ray executor refuses the CPU platform);
* ``speculative_config`` passes through ``engine_kwargs`` untouched, and each engine
  process loads this plugin through the ``vllm.general_plugins`` entry point, so nothing
  has to be shipped to the replicas beyond the installed package.

What this module adds is :class:`SpecStreamLLMServer`, an ``LLMServer`` that on CPUs binds
each replica's OpenMP threads to cores of its own (vLLM's automatic binding puts every
engine of a machine on the same cores) and reports its replica id, process id and the
requests it served (:meth:`SpecStreamLLMServer.replica_info`), and :class:`LocalCheckpoint`,
which skips Ray Serve LLM's model-download step (an internal Ray hook: the ``ray`` extra pins
Ray 2.60).

    from ray import serve
    from vllm_specstream.ray.serve import SpecStreamServeConfig, build_app

    serve.run(build_app(SpecStreamServeConfig("runs/sql-merged", num_replicas=2)))
    # POST http://127.0.0.1:8000/v1/completions {"model": "specstream", "prompt": ...}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.serve.llm import LLMConfig, LLMServer, build_openai_app

from vllm_specstream import speculative_config
from vllm_specstream.logger import init_logger

logger = init_logger(__name__)

#: Set in a replica's environment (``SpecStreamServeConfig.env``) to keep vLLM's own binding.
ENV_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass
class SpecStreamServeConfig:
    """What to serve and how; everything else is Ray Serve LLM's and vLLM's defaults."""

    checkpoint: str | Path
    """Merged specstream checkpoint directory (``specstream export``)."""
    num_replicas: int = 2
    """vLLM engines behind the endpoint, each a Ray Serve replica."""
    num_speculative_tokens: int | None = None
    """Drafts per step; default: the checkpoint's ``specstream.num_streams``."""
    specstream: dict = field(default_factory=dict)
    """The plugin's fields for every replica's engine (``additional_config["specstream"]``,
    :mod:`vllm_specstream.speculation.settings`), e.g. ``{"placement": "window"}``."""
    model_id: str = "specstream"
    """The ``model`` name clients send."""
    dtype: str | None = None
    """vLLM dtype; default: the checkpoint's on GPUs, float32 on CPUs (bf16 verification
    costs more than speculation saves on CPUs without native bf16 matmuls, see README)."""
    max_model_len: int = 2048
    kv_cache_bytes: int | None = 1 << 30
    """KV cache per replica on CPUs (``kv_cache_memory_bytes``); a fixed size keeps replicas
    small, where ``gpu_memory_utilization`` would reserve a share of the machine's RAM each.
    None: vLLM's ``gpu_memory_utilization`` sizing. GPUs always use the latter."""
    cpus_per_replica: float = 1.0
    """Ray CPUs each replica reserves on CPU machines, and the cores its engine binds its
    OpenMP threads to (at least 1): 1 lets one replica per core schedule."""
    tensor_parallel_size: int = 1
    """GPU ranks per replica (vLLM's Ray executor runs them in the replica's placement group)."""
    ingress_replicas: int = 1
    """OpenAI ingress replicas in front of the engines (they only route: no CPUs reserved)."""
    ingress_actor_options: dict[str, Any] = field(default_factory=dict)
    """Further Ray actor options of the ingress, e.g. ``{"resources":
    {"node:__internal_head__": 0.001}}`` keeps it on the head node of a cluster, so that it
    outlives the worker nodes."""
    replica_resources: dict[str, float] = field(default_factory=dict)
    """Further Ray resources each replica's bundle reserves on CPU machines (Serve refuses
    ``max_replicas_per_node`` beside placement groups): ``{"specstream": 1}``, with each
    node started with ``ray start --resources '{"specstream": 1}'``, places one replica per
    node."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of the replicas and their engine processes."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further vLLM engine arguments; they override the ones derived above."""
    llm_config: dict[str, Any] = field(default_factory=dict)
    """Further ``LLMConfig`` fields (e.g. ``log_engine_metrics``)."""


def checkpoint_num_streams(checkpoint: str | Path) -> int:
    """``specstream.num_streams`` from a merged checkpoint's ``config.json``."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    section = config.get("specstream")
    if not isinstance(section, dict) or "num_streams" not in section:
        raise ValueError(
            f"{checkpoint}/config.json has no specstream.num_streams: not a merged specstream "
            "checkpoint (`specstream export`); or pass num_speculative_tokens"
        )
    return int(section["num_streams"])


class LocalCheckpoint(CallbackBase):
    """Skips Ray Serve LLM's node initialization, which only downloads remote models: for a
    local checkpoint directory it still starts one Ray task per node, importing vLLM there,
    to find nothing to download (about 20 s per replica start on a busy 2-core machine)."""

    async def on_before_node_init(self) -> None:
        self.ctx.run_init_node = False


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def llm_config(config: SpecStreamServeConfig, *, cpu: bool | None = None) -> LLMConfig:
    """The ``LLMConfig`` of a specstream deployment (``cpu``: default, vLLM's platform)."""
    cpu = _on_cpu() if cpu is None else cpu
    k = config.num_speculative_tokens or checkpoint_num_streams(config.checkpoint)
    engine: dict[str, Any] = {
        "max_model_len": config.max_model_len,
        "speculative_config": speculative_config(k),
    }
    if config.specstream:
        from vllm_specstream.speculation.settings import KEY

        engine["additional_config"] = {KEY: dict(config.specstream)}
    if cpu:
        from vllm_specstream.patches.cpu_env import cpu_engine_kwargs

        engine = cpu_engine_kwargs(dtype=config.dtype or "float32", **engine)
        if config.kv_cache_bytes is not None:
            engine["kv_cache_memory_bytes"] = config.kv_cache_bytes
        # vLLM's Ray executor refuses the CPU platform: Ray Serve LLM uses mp there.
        accelerator = {"accelerator_config": {"kind": "cpu"}}
        resources = {
            "placement_group_config": {
                "bundles": [{"CPU": config.cpus_per_replica, **config.replica_resources}]
            },
        }
        actor_options: dict[str, Any] = {"num_cpus": 0}  # the engine's bundle holds the CPU
    else:
        if config.dtype:
            engine["dtype"] = config.dtype
        engine["tensor_parallel_size"] = config.tensor_parallel_size
        accelerator, resources, actor_options = {}, {}, {}
    engine.update(config.engine_kwargs)
    fields: dict[str, Any] = {
        "model_loading_config": {
            "model_id": config.model_id,
            "model_source": str(Path(config.checkpoint).resolve()),
        },
        "engine_kwargs": engine,
        "deployment_config": {
            "num_replicas": config.num_replicas,
            "ray_actor_options": actor_options,
        },
        "server_cls": SpecStreamLLMServer,
        "callback_config": {"callback_class": LocalCheckpoint},
        **accelerator,
        **resources,
    }
    if config.env:
        fields["runtime_env"] = {"env_vars": dict(config.env)}
    fields.update(config.llm_config)
    return LLMConfig(**fields)


def build_app(config: SpecStreamServeConfig, *, cpu: bool | None = None):
    """The Ray Serve application: an OpenAI ingress over ``config.num_replicas`` engines."""
    return build_openai_app(
        {
            "llm_configs": [llm_config(config, cpu=cpu)],
            "ingress_deployment_config": {
                "num_replicas": config.ingress_replicas,
                "ray_actor_options": {"num_cpus": 0, **config.ingress_actor_options},
            },
        }
    )


def server_deployment_name(config: SpecStreamServeConfig) -> str:
    """Name of the engine deployment inside the application (for ``serve.get_deployment_handle``)."""
    return f"{SpecStreamLLMServer.__name__}:{config.model_id.replace('/', '--').replace('.', '_')}"


def replica_cores(local_rank: int, cores: list[int], per_replica: int) -> list[int]:
    """The cores a replica's engine binds its threads to: consecutive blocks of
    ``per_replica`` cores, one block per replica on the machine, wrapping around."""
    start = local_rank * per_replica
    return [cores[(start + i) % len(cores)] for i in range(min(per_replica, len(cores)))]


def claim_cores(local_rank: int, cores: list[int], per_replica: int, lock_dir: Path):
    """A block of cores no other replica on this host holds, and the open lock file that
    holds it for this process's lifetime (released when the process ends).

    Ray numbers replicas per Ray node, and several nodes may share a host (a cluster on one
    machine, containers): their replicas would all start at the same block. Blocks are
    claimed with ``flock`` on files in ``lock_dir``, starting at the replica's own
    (:func:`replica_cores`); where every block is held, the replica's own is shared."""
    import fcntl

    lock_dir.mkdir(parents=True, exist_ok=True)
    blocks = max(1, len(cores) // max(1, per_replica))
    for i in range(blocks):
        chosen = replica_cores((local_rank + i) % blocks, cores, per_replica)
        lock = open(lock_dir / f"cores-{'-'.join(map(str, chosen))}.lock", "w")  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        return chosen, lock
    return replica_cores(local_rank, cores, per_replica), None


class SpecStreamLLMServer(LLMServer):
    """Ray Serve LLM's server with OpenMP cores of its own per replica on CPUs, and a
    self-report."""

    async def __init__(self, llm_config: LLMConfig, **kwargs: Any):
        from ray import serve

        context = serve.get_replica_context()
        self._replica_id = context.replica_tag
        self._served = 0
        self._omp_bind = self._bind_threads(llm_config, context.rank.local_rank)
        await super().__init__(llm_config, **kwargs)

    def _bind_threads(self, llm_config: LLMConfig, local_rank: int) -> str | None:
        """Give this replica's engine its own cores (CPU, one rank per engine): as many as
        the replica reserves Ray CPUs (at least one).

        vLLM's ``auto`` binding reserves a core for the front-end and binds the worker to
        the others, the same ones in every engine of a machine: replicas would compete
        for them. The engine processes inherit this process's environment; replicas of
        other Ray nodes on the same host hold other cores (:func:`claim_cores`).
        """
        from vllm.platforms import current_platform

        engine = llm_config.engine_kwargs
        ranks = engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)
        if not current_platform.is_cpu() or ranks != 1 or ENV_OMP_BIND in os.environ:
            return os.environ.get(ENV_OMP_BIND)
        import tempfile

        bundles = (llm_config.placement_group_config or {}).get("bundles") or [{}]
        per_replica = max(1, int(bundles[0].get("CPU", 1)))
        lock_dir = Path(tempfile.gettempdir()) / "vllm-specstream-replica-cores"
        cores, self._cores_lock = claim_cores(
            local_rank, sorted(os.sched_getaffinity(0)), per_replica, lock_dir
        )
        os.environ[ENV_OMP_BIND] = ",".join(map(str, cores))
        logger.info("vllm-specstream: replica %d computes on cores %s", local_rank, cores)
        return os.environ[ENV_OMP_BIND]

    async def completions(self, request, raw_request_info=None):
        self._served += 1
        return await super().completions(request, raw_request_info)

    async def chat(self, request, raw_request_info=None):
        self._served += 1
        return await super().chat(request, raw_request_info)

    async def replica_info(self) -> dict[str, Any]:
        """This replica: id, pid, Ray node, whether the plugin loaded here, OpenMP binding,
        requests served, the running engine's speculative config."""
        spec = None
        client = getattr(self.engine, "_engine_client", None)
        vllm_config = getattr(client, "vllm_config", None)
        if vllm_config is not None and vllm_config.speculative_config is not None:
            sc = vllm_config.speculative_config
            spec = {
                "method": sc.method,
                "model": sc.model,
                "num_speculative_tokens": sc.num_speculative_tokens,
            }
        import ray

        from vllm_specstream.patches import registration as plugin

        return {
            "replica_id": self._replica_id,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "plugin_loaded": plugin._registered,
            "omp_bind": self._omp_bind,
            "served": self._served,
            "speculative_config": spec,
        }


__all__ = [
    "SpecStreamLLMServer",
    "SpecStreamServeConfig",
    "build_app",
    "checkpoint_num_streams",
    "claim_cores",
    "llm_config",
    "replica_cores",
    "server_deployment_name",
]
