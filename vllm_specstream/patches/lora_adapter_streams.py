"""Loads each LoRA adapter's stream tensors where vLLM loads the adapter.

vLLM's ``WorkerLoRAManager._load_adapter`` reads ``adapter_config.json`` and the adapter
weights from ``lora_request.lora_path`` and returns a ``LoRAModel``, which its LRU cache then
keeps, moves between slots and drops. The wrapper below lets it do that, then, when the
served model is a specstream model, reads the directory's ``specstream.safetensors`` too
(:func:`~vllm_specstream.model_executor.lora.per_adapter_streams.read_adapter_streams`) and sets it on
the returned object, so the streams follow the adapter through vLLM's cache. An adapter
whose streams do not fit the deployment fails to load as vLLM's own checks fail (an adapter
rank above ``max_lora_rank``): with the adapter named in the message.
"""

from __future__ import annotations

from vllm_specstream.patches import Patch

TARGET = "vllm.lora.worker_manager.WorkerLoRAManager._load_adapter"


def _apply() -> None:
    import functools

    from vllm.lora.utils import get_adapter_absolute_path
    from vllm.lora.worker_manager import WorkerLoRAManager

    from vllm_specstream.logger import init_logger
    from vllm_specstream.model_executor.lora.per_adapter_streams import (
        ATTRIBUTE,
        read_adapter_streams,
    )

    logger = init_logger(__name__)
    original = WorkerLoRAManager._load_adapter

    @functools.wraps(original)
    def _load_adapter(self, lora_request):
        lora = original(self, lora_request)
        model = self._adapter_manager.model
        deployment = getattr(model, "adapter_stream_deployment", None)
        if deployment is None:
            return lora  # not a specstream model: vLLM's adapter as it is
        path = get_adapter_absolute_path(lora_request.lora_path)
        streams = read_adapter_streams(
            path, lora_request.lora_name, deployment(), dtype=model.stream_dtype
        )
        setattr(lora, ATTRIBUTE, streams)
        if streams is None:
            logger.info(
                "LoRA adapter %r has no stream tensors (%s): its requests draft with the "
                "served checkpoint's streams if it has any, else not at all",
                lora_request.lora_name,
                path,
            )
        return lora

    WorkerLoRAManager._load_adapter = _load_adapter


LORA_ADAPTER_STREAMS = Patch(
    name="lora-adapter-streams",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="vLLM loads only a LoRA directory's adapter files; each adapter's streams live beside them",
    apply=_apply,
)
