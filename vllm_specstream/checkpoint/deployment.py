"""One base model served for many specstream LoRA adapters (each task drafts with its own
streams).

The base is served under the specstream architecture with no streams of its own
(``config.json: specstream.adapter_streams_only``), given to vLLM as ``hf_overrides`` so the
base directory stays untouched::

    vllm serve BASE --enable-lora --max-lora-rank 32 \\
        --lora-modules sql=ADAPTER1 e2e=ADAPTER2 \\
        --hf-overrides '<base_deployment_overrides(...) as JSON>' \\
        --spec-model specstream --spec-tokens 4

``specstream deploy BASE ADAPTER...`` prints that command for a set of adapters. The
deployment fixes ``num_msa_layers`` (the decoder hands every request the residual stream
entering that layer), so adapters served together must share it; each request then drafts
with its adapter's streams (:mod:`vllm_specstream.model_executor.lora.per_adapter_streams`) and a
request without an adapter decodes without drafts. Reads JSON only (no torch, no vLLM).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from vllm_specstream.checkpoint.config import (
    CONFIG_FILE,
    MERGED_ARCHITECTURE,
    STREAM_FILE,
    ConfigError,
    SpecStreamConfig,
)
from vllm_specstream.checkpoint.families import BASE_CLASSES, check_base_config
from vllm_specstream.checkpoint.merged import ADAPTER_STREAMS_ONLY


def base_deployment_overrides(base: str | Path, num_msa_layers: int, num_streams: int) -> dict:
    """vLLM ``hf_overrides`` that serve the base model in ``base`` for specstream adapters
    trained with ``num_msa_layers``, drafting up to ``num_streams`` tokens."""
    config_file = Path(base) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{config_file}: unreadable ({e})") from e
    architectures = config.get("architectures") or []
    if not architectures or architectures[0] not in BASE_CLASSES:
        raise ConfigError(
            f"{config_file}: architectures {architectures}; vllm-specstream serves "
            f"{list(BASE_CLASSES)}"
        )
    check_base_config(config, str(config_file))
    section = {
        "num_streams": num_streams,
        "num_msa_layers": num_msa_layers,
        "base_architectures": [architectures[0]],
        ADAPTER_STREAMS_ONLY: True,
    }
    # The same checks the served model runs, now, with the file named.
    SpecStreamConfig(num_streams=num_streams, num_msa_layers=num_msa_layers).validate(
        config.get("num_hidden_layers"), where=f"{config_file} (deployment)"
    )
    return {"architectures": [MERGED_ARCHITECTURE], "specstream": section}


@dataclass(frozen=True)
class AdapterDeployment:
    """A base and the specstream adapters served on it."""

    base: str
    adapters: dict[str, str]
    """Name (what requests ask for as ``model``) -> adapter directory."""
    num_msa_layers: int
    num_streams: int
    """The fewest streams of any adapter: the most drafts every adapter can make."""
    max_lora_rank: int

    def overrides(self) -> dict:
        return base_deployment_overrides(self.base, self.num_msa_layers, self.num_streams)

    def serve_command(self, num_speculative_tokens: int | None = None) -> str:
        """The ``vllm serve`` command line (``num_speculative_tokens`` default: all streams)."""
        k = num_speculative_tokens or self.num_streams
        modules = [f"{name}={path}" for name, path in self.adapters.items()]
        args = [
            "vllm", "serve", self.base, "--enable-lora",
            "--max-loras", str(len(self.adapters)),
            "--max-lora-rank", str(self.max_lora_rank),
            "--lora-modules", *modules,
            "--hf-overrides", json.dumps(self.overrides(), separators=(",", ":")),
            "--spec-model", "specstream", "--spec-tokens", str(k),
        ]  # fmt: skip
        return shlex.join(args)


def plan_deployment(base: str | Path, adapters: dict[str, str | Path]) -> AdapterDeployment:
    """Check that ``adapters`` (name -> directory written by ``specstream train``) can be
    served together on ``base`` and return the deployment; errors name the adapter."""
    if not adapters:
        raise ConfigError("no adapters given: name at least one specstream adapter directory")
    layers: dict[int, list[str]] = {}
    streams, ranks = [], []
    for name, path in adapters.items():
        path = Path(path)
        where = f"adapter {name!r} ({path})"
        if not (path / STREAM_FILE).is_file():
            raise ConfigError(f"{where}: no {STREAM_FILE}; not a specstream adapter directory")
        try:
            config = SpecStreamConfig.load(path)
            peft = json.loads((path / "adapter_config.json").read_text())
        except (ConfigError, OSError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from e
        layers.setdefault(config.num_msa_layers, []).append(name)
        streams.append(config.num_streams)
        ranks.append(int(peft.get("r", 16)))
    if len(layers) > 1:
        groups = "; ".join(f"num_msa_layers={n}: {names}" for n, names in sorted(layers.items()))
        raise ConfigError(
            f"adapters trained with different num_msa_layers cannot share a deployment ({groups}"
            f", from each {CONFIG_FILE}); serve each group on its own"
        )
    return AdapterDeployment(
        base=str(base),
        adapters={name: str(path) for name, path in adapters.items()},
        num_msa_layers=next(iter(layers)),
        num_streams=min(streams),
        max_lora_rank=lora_rank_setting(max(ranks)),
    )


#: The values vLLM accepts for ``max_lora_rank``.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_setting(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that fits adapters of ``rank``."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ConfigError(
            f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}"
        )
    return fits[0]
