"""``--spec-model specstream``: the short spelling of the specstream proposer.

vLLM 0.32 selects a ``custom_class`` proposer from any dotted path (``--spec-model
vllm_specstream.model_executor.proposer.SpecStreamProposer`` works unpatched) but has no way to register a
name. This wraps ``EngineArgs.create_speculative_config`` (it runs in the front-end, before
``SpeculativeConfig`` is validated) to rewrite ``model: "specstream"`` to the proposer path
and to default ``num_speculative_tokens`` to the checkpoint's ``specstream.num_streams``.
Engine and workers receive the resolved path, so only the front-end needs this.
"""

from __future__ import annotations

from vllm_specstream.patches import Patch

ALIAS = "specstream"
TARGET = "vllm.engine.arg_utils.EngineArgs.create_speculative_config"


def resolve_alias(spec: dict | None, hf_config) -> dict | None:
    """The speculative config with the ``specstream`` alias expanded (pure function)."""
    from vllm_specstream import PROPOSER

    if not spec or ALIAS not in (spec.get("model"), spec.get("method")):
        return spec
    spec = dict(spec)
    spec["model"] = PROPOSER
    spec["method"] = "custom_class"
    if spec.get("num_speculative_tokens") is None:
        section = getattr(hf_config, "specstream", None)
        if not isinstance(section, dict) or "num_streams" not in section:
            raise ValueError(
                "--spec-model specstream needs --spec-tokens N, or a specstream checkpoint "
                "whose config.json has specstream.num_streams"
            )
        spec["num_speculative_tokens"] = int(section["num_streams"])
    return spec


def _apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        if self.spec_model == ALIAS:
            self.spec_model = None
            self.speculative_config = {**(self.speculative_config or {}), "model": ALIAS}
        if isinstance(self.speculative_config, dict):
            if (
                self.spec_tokens is not None
                and "num_speculative_tokens" not in self.speculative_config
            ):
                self.speculative_config["num_speculative_tokens"] = self.spec_tokens
                self.spec_tokens = None
            self.speculative_config = resolve_alias(
                self.speculative_config, target_model_config.hf_config
            )
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config.__wrapped__ = original
    EngineArgs.create_speculative_config = create_speculative_config


SPEC_ALIAS = Patch(
    name="spec-model-alias",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="vLLM has no registry of custom proposer names; `--spec-model specstream` needs one",
    apply=_apply,
)
