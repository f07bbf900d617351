"""A merged checkpoint as vLLM sees it: the ``specstream`` section and the stream tensors.

Everything here reads ``config.json`` values and safetensors *headers* only (names and
shapes, no tensor data, no torch, no vLLM), so the front-end can check a checkpoint in
milliseconds before vLLM spawns its engine (:mod:`vllm_specstream.speculation.preflight`), and the
model class reads its section through the same functions at load time.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_specstream.base_model import read_safetensors_shapes
from vllm_specstream.checkpoint.config import (
    DRAFT_VOCAB_MASK,
    MERGED_ARCHITECTURE,
    STREAM_FILE,
    STREAM_PREFIX,
    ConfigError,
    SpecStreamConfig,
)
from vllm_specstream.checkpoint.families import BASE_CLASSES, SUPPORTED

#: vLLM's index of a sharded safetensors checkpoint: it loads only the files listed there.
SAFETENSORS_INDEX = "model.safetensors.index.json"

EXPORT_HINT = "export it again with `specstream export ADAPTER OUT`"

#: ``config.json: specstream.adapter_streams_only``: a base model served for specstream LoRA
#: adapters, with no streams of its own (:mod:`vllm_specstream.checkpoint.deployment`).
ADAPTER_STREAMS_ONLY = "adapter_streams_only"


def specstream_section(hf_config, where: str = "config.json") -> dict:
    """A copy of ``config.json``'s ``specstream`` section (``hf_config`` is vLLM's
    ``PretrainedConfig``, or any object with the same attributes)."""
    section = getattr(hf_config, "specstream", None)
    if not isinstance(section, dict):
        raise ConfigError(
            f"{where}: architectures is ['{MERGED_ARCHITECTURE}'] but there is no "
            "'specstream' section; export the checkpoint with `specstream export`"
        )
    return dict(section)


def base_architecture(hf_config, where: str = "config.json") -> str:
    """The checkpoint's base architecture (``specstream.base_architectures[0]``), checked."""
    base = specstream_section(hf_config, where).get("base_architectures")
    if not base or base[0] not in BASE_CLASSES:
        raise ConfigError(
            f"{where}: specstream.base_architectures is {base!r}; vllm-specstream serves "
            f"checkpoints trained on {list(BASE_CLASSES)} bases ({SUPPORTED}): train the "
            "adapter on one of those"
        )
    return base[0]


def read_specstream_section(hf_config, where: str = "config.json") -> SpecStreamConfig:
    """The ``specstream`` section as a validated :class:`SpecStreamConfig`."""
    base_architecture(hf_config, where)
    section = specstream_section(hf_config, where)
    section.pop("base_architectures", None)
    section.pop(ADAPTER_STREAMS_ONLY, None)
    config = SpecStreamConfig.from_dict(section, where=f"{where} (specstream)")
    config.validate(hf_config.num_hidden_layers, where=f"{where} (specstream)")
    return config


def adapter_streams_only(hf_config, where: str = "config.json") -> bool:
    """Whether the served model carries no streams of its own: its requests draft with
    their LoRA adapter's streams only."""
    value = specstream_section(hf_config, where).get(ADAPTER_STREAMS_ONLY, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: specstream.{ADAPTER_STREAMS_ONLY} must be true or false")
    return value


def loaded_weight_files(model_dir: Path) -> list[Path]:
    """The ``*.safetensors`` files vLLM's default loader reads from ``model_dir``: all of
    them, or only those listed in ``model.safetensors.index.json`` when there is one."""
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            listed = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"{index}: unreadable ({e})") from e
        files = [f for f in files if f.name in listed]
    return files


def check_stream_tensors(model_dir: Path, config: SpecStreamConfig, hf_config) -> None:
    """Every stream tensor is in a file vLLM will load, with the shape the config implies
    for the model of ``hf_config`` (``config.json``)."""
    expected = {
        STREAM_PREFIX + name: shape
        for name, shape in config.stream_tensor_shapes(hf_config.hidden_size, hf_config).items()
    }
    stream_file = model_dir / STREAM_FILE
    files = loaded_weight_files(model_dir)
    if stream_file.is_file() and stream_file not in files:
        raise ConfigError(
            f"{stream_file}: not listed in {model_dir / SAFETENSORS_INDEX} (weight_map), so "
            f"vLLM will not load the stream tensors; {EXPORT_HINT}"
        )
    found: dict[str, tuple[Path, list[int]]] = {}
    for f in files:
        try:
            shapes = read_safetensors_shapes([f])
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{f}: unreadable safetensors header ({e})") from e
        found.update({name: (f, shape) for name, shape in shapes.items() if name in expected})
    missing = sorted(set(expected) - set(found))
    if missing:
        absent = "" if stream_file.is_file() else " (the file does not exist)"
        raise ConfigError(
            f"{stream_file}: missing stream tensor(s) {missing}{absent}; the merged "
            f"checkpoint must carry them: {EXPORT_HINT}"
        )
    for name, shape in expected.items():
        where, got = found[name]
        if tuple(got) != shape:
            raise ConfigError(
                f"{where}: tensor {name} has shape {got}, expected {list(shape)} "
                f"(config.json: specstream.num_streams={config.num_streams}, "
                f"hidden_size={hf_config.hidden_size}); {EXPORT_HINT} from an adapter trained on "
                "this base model"
            )
    if config.draft_vocab_size > 0:
        from safetensors import safe_open

        from vllm_specstream.checkpoint.draft_vocab import mask_token_ids

        name = STREAM_PREFIX + DRAFT_VOCAB_MASK
        where = found[name][0]
        with safe_open(str(where), framework="pt") as f:
            mask = f.get_tensor(name)
        mask_token_ids(mask, config.draft_vocab_size, f"{where} (config.json: specstream)")
