"""SpecStreamConfig: the multi-stream settings shared by training, checkpoints and vLLM."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

#: Checkpoint format this code writes; it reads this version and older ones.
FORMAT_VERSION = 1
CONFIG_FILE = "specstream_config.json"
#: A merged checkpoint (``specstream export``): its architecture in ``config.json``,
#: the file of its stream tensors and their name prefix.
MERGED_ARCHITECTURE = "SpecStreamForCausalLM"
STREAM_FILE = "specstream.safetensors"
STREAM_PREFIX = "specstream."


#: The four projections of a decoder layer as vLLM merges them (q/k/v, o, gate/up, down):
#: a stream LoRA has one ``A``/``B`` pair per MSA layer and projection.
STREAM_LORA_STAGES = ("qkv", "o", "gate_up", "down")


def stream_lora_name(layer: int, stage: str, which: str) -> str:
    """Name of a stream-LoRA tensor: ``which`` "a" or "b" of ``stage`` in MSA layer ``layer``
    (counted from the first MSA layer)."""
    return f"stream_lora_{layer}_{stage}_{which}"


#: The stream tensor marking the draft vocabulary (``SpecStreamConfig.draft_vocab_size``).
DRAFT_VOCAB_MASK = "draft_vocab_mask"


def counts_as_parameters(name: str) -> bool:
    """Whether the stream tensor ``name`` (unprefixed) holds parameters: the draft
    vocabulary's mask is a token set (reported apart from a checkpoint's extra parameters)."""
    return name != DRAFT_VOCAB_MASK


def config_value(hf_config: Any, key: str) -> Any:
    """``key`` of a model's ``config.json`` given as a dict or a config object."""
    if isinstance(hf_config, Mapping):
        return hf_config.get(key)
    return getattr(hf_config, key, None)


def projection_dims(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) sizes of each of :data:`STREAM_LORA_STAGES` for a Llama-family model's
    ``config.json`` (a dict or a config object); merged outputs in vLLM's order (q, k, v;
    gate, up)."""

    def get(key: str) -> Any:
        return config_value(hf_config, key)

    h, heads = get("hidden_size"), get("num_attention_heads")
    kv = get("num_key_value_heads") or heads
    d = get("head_dim") or h // heads
    inter = get("intermediate_size")
    return {
        "qkv": (h, (heads + 2 * kv) * d),
        "o": (heads * d, h),
        "gate_up": (h, 2 * inter),
        "down": (inter, h),
    }


class ConfigError(ValueError):
    """A specstream config is invalid; the message names the file and field."""


#: What a JSON value of each annotated type may be.
_JSON_TYPES = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}


def check_json_types(data: Mapping[str, Any], cls: type, where: str, prefix: str = "") -> None:
    """Each value of ``data`` must have its dataclass field's type (``int | None``,
    ``float | list[float]``, ``Literal[...]``): a mistyped field is named, not left to fail
    later as a comparison of a string with a number."""
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        options = _union_options(hints[name])
        if not any(_json_value_is(value, option) for option in options):
            want = " or ".join(_type_name(option) for option in options)
            raise ConfigError(f"{where}: {prefix}{name} must be {want}, got {value!r}")


def _union_options(hint: Any) -> tuple:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return typing.get_args(hint) if union else (hint,)


def _json_value_is(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint) or hint
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in typing.get_args(hint)
    if isinstance(value, bool) and origin is not bool:  # JSON's true is no number
        return False
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and (
            item is Any or all(_json_value_is(x, item) for x in value)
        )
    return isinstance(value, _JSON_TYPES.get(origin, ()))


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is Literal:
        return " or ".join(repr(x) for x in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        hint, str(hint)
    )


#: What a ``suffix_drafts`` setting takes (the engine field and the checkpoint's default).
SUFFIX_DRAFTS_VALUES = (
    "'on' (suffix drafts where they yield as many tokens per step cost as the streams), a "
    "score threshold >= 0, or 'off'"
)


def suffix_min_score_from(text: str) -> float | None:
    """A ``suffix_drafts`` setting: empty or ``off`` (None: streams only), ``on`` (nan: the
    threshold follows the streams' expected tokens per step cost) or a score threshold
    ``>= 0``."""
    text = text.strip().lower()
    if text in ("", "off"):
        return None
    if text == "on":
        return float("nan")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"suffix_drafts={text!r}: expected {SUFFIX_DRAFTS_VALUES}")
    return value


@dataclass
class PruneConfig:
    """Tree-pruning adapter (paper 3.2.3): early-exit logits at layer ``layer``."""

    enabled: bool = False
    """Train the pruning adapter (needed for tree drafting with pruning)."""
    layer: int | None = None
    """Early-exit layer ``Lp``; None means the first MSA layer ``N - num_msa_layers``."""
    rank: int = 8
    """Rank of the low-rank adapter ``Bp(Ap(x))``."""
    threshold: float = 0.01
    """A tree node is pruned when its early-exit probability given its parent is below this."""


@dataclass
class LossConfig:
    """Weights of paper eq. 5: ``a0 * CE(main) + sum_j a_j * CE(stream j)``."""

    a0: float = 1.0
    """Weight of the main stream's next-token loss."""
    a_j: float | list[float] = 0.1
    """Weight of each stream's loss: one number for all streams, or one per stream."""

    def stream_weights(self, num_streams: int) -> list[float]:
        if isinstance(self.a_j, (int, float)):
            return [float(self.a_j)] * num_streams
        return [float(w) for w in self.a_j]


@dataclass
class SpecStreamConfig:
    """How the speculative streams are built (docs/method.md).

    Example::

        SpecStreamConfig(num_streams=4, num_msa_layers=6)
    """

    num_streams: int = 4
    """gamma: speculative streams per position; stream j predicts the token j+1 steps after
    the next one. vLLM's ``num_speculative_tokens`` may be at most this."""
    num_msa_layers: int = 6
    """N_s: the top N_s decoder layers carry the streams (multi-stream attention)."""
    stream_position: Literal["shifted", "anchor"] = "shifted"
    """Rotary position of stream j at anchor t: ``t + j`` ("shifted") or ``t`` ("anchor")."""
    init_rank: int = 0
    """eta: rank of the stream-initialisation adapter f(x) = x + B(A(x)); 0 = identity."""
    stream_lora_rank: int = 0
    """Rank of a LoRA applied to the stream rows only, in each MSA layer's four projections
    (a streams-only adapter: the main stream stays the base model, so outputs are the base
    model's by construction); 0 = the streams use the main stream's weights."""
    draft_vocab_size: int = 0
    """Tokens the streams draft from (0: the whole vocabulary). The checkpoint's
    ``draft_vocab_mask`` (``[vocab_size]``, 1 at each of them, 0 elsewhere) marks them; the
    streams' LM head then reads only their rows (drafts are still verified by the whole
    model: outputs do not change, only which tokens can be drafted)."""
    suffix_drafts: str | None = None
    """Serving default of the engine field ``suffix_drafts`` for this checkpoint (``on``, a score
    threshold, or ``off``): suffix-tree drafts beside the streams, where they were measured
    to pay on its task (:mod:`vllm_specstream.speculation.suffix_drafts`). The field, when set, wins;
    without arctic-inference the engine serves the streams alone and says so once. None:
    the streams alone."""
    prune: PruneConfig = field(default_factory=PruneConfig)
    """Tree-pruning adapter."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Loss weights (training only)."""
    base_model: str | None = None
    """Path or name of the base checkpoint the adapter was trained on."""
    format_version: int = FORMAT_VERSION
    """Checkpoint format version."""

    def validate(self, num_hidden_layers: int | None = None, where: str = "config") -> None:
        """Raise :class:`ConfigError` naming ``where`` and the field if anything is off."""

        def bad(field_name: str, msg: str) -> ConfigError:
            return ConfigError(f"{where}: {field_name} {msg}")

        if not isinstance(self.num_streams, int) or self.num_streams < 1:
            raise bad("num_streams", f"must be an integer >= 1, got {self.num_streams!r}")
        if not isinstance(self.num_msa_layers, int) or self.num_msa_layers < 1:
            raise bad("num_msa_layers", f"must be an integer >= 1, got {self.num_msa_layers!r}")
        if num_hidden_layers is not None and self.num_msa_layers > num_hidden_layers:
            raise bad(
                "num_msa_layers",
                f"is {self.num_msa_layers} but the model has only {num_hidden_layers} layers",
            )
        if self.stream_position not in ("shifted", "anchor"):
            raise bad(
                "stream_position", f"must be 'shifted' or 'anchor', got {self.stream_position!r}"
            )
        if not isinstance(self.init_rank, int) or self.init_rank < 0:
            raise bad("init_rank", f"must be an integer >= 0, got {self.init_rank!r}")
        if not isinstance(self.stream_lora_rank, int) or self.stream_lora_rank < 0:
            raise bad("stream_lora_rank", f"must be an integer >= 0, got {self.stream_lora_rank!r}")
        if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 0:
            raise bad("draft_vocab_size", f"must be an integer >= 0, got {self.draft_vocab_size!r}")
        if self.suffix_drafts is not None:
            try:
                suffix_min_score_from(self.suffix_drafts)
            except (ConfigError, AttributeError):
                raise bad(
                    "suffix_drafts", f"must be {SUFFIX_DRAFTS_VALUES}, got {self.suffix_drafts!r}"
                ) from None
        if self.prune.rank < 1:
            raise bad("prune.rank", f"must be >= 1, got {self.prune.rank!r}")
        if not 0.0 <= self.prune.threshold < 1.0:
            raise bad("prune.threshold", f"must be in [0, 1), got {self.prune.threshold!r}")
        if (
            self.prune.layer is not None
            and num_hidden_layers is not None
            and not (0 <= self.prune.layer < num_hidden_layers)
        ):
            raise bad("prune.layer", f"must be in [0, {num_hidden_layers}), got {self.prune.layer}")
        weights = self.loss.stream_weights(self.num_streams)
        if len(weights) != self.num_streams:
            raise bad("loss.a_j", f"has {len(weights)} weights for {self.num_streams} streams")
        if self.loss.a0 < 0 or any(w < 0 for w in weights):
            raise bad("loss", "weights must be >= 0")
        if not isinstance(self.format_version, int) or self.format_version < 1:
            raise bad("format_version", f"must be an integer >= 1, got {self.format_version!r}")
        if self.format_version > FORMAT_VERSION:
            raise bad(
                "format_version",
                f"is {self.format_version}, newer than this "
                f"vllm-specstream understands ({FORMAT_VERSION}); upgrade vllm-specstream",
            )

    def stream_tensor_shapes(
        self, hidden_size: int, hf_config: Any = None
    ) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every stream tensor (``P`` and the optional adapters) for a
        model of ``hidden_size`` (and ``hf_config``, its ``config.json`` as a dict or config
        object: the stream LoRA's shapes follow its projections): what a checkpoint must
        carry, nothing more."""
        h = hidden_size
        shapes: dict[str, tuple[int, ...]] = {"stream_embeddings": (self.num_streams, h)}
        if self.init_rank > 0:
            shapes["init_a"] = (self.init_rank, h)
            shapes["init_b"] = (h, self.init_rank)
        if self.prune.enabled:
            shapes["prune_a"] = (self.prune.rank, h)
            shapes["prune_b"] = (h, self.prune.rank)
        if self.draft_vocab_size > 0:
            if hf_config is None:
                raise ConfigError("draft_vocab_size > 0: the shapes need the model's config")
            shapes[DRAFT_VOCAB_MASK] = (config_value(hf_config, "vocab_size"),)
        if self.stream_lora_rank > 0:
            if hf_config is None:
                raise ConfigError("stream_lora_rank > 0: the shapes need the model's config")
            projections = projection_dims(hf_config)
            r = self.stream_lora_rank
            for i in range(self.num_msa_layers):
                for stage in STREAM_LORA_STAGES:
                    d_in, d_out = projections[stage]
                    shapes[stream_lora_name(i, stage, "a")] = (r, d_in)
                    shapes[stream_lora_name(i, stage, "b")] = (d_out, r)
        return shapes

    def first_msa_layer(self, num_hidden_layers: int) -> int:
        """L0 = N - N_s."""
        return num_hidden_layers - self.num_msa_layers

    def prune_layer(self, num_hidden_layers: int) -> int:
        return (
            self.first_msa_layer(num_hidden_layers)
            if self.prune.layer is None
            else self.prune.layer
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        # Left out at their defaults: readable by versions before the fields.
        if not self.draft_vocab_size:
            del data["draft_vocab_size"]
        if self.suffix_drafts is None:
            del data["suffix_drafts"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> SpecStreamConfig:
        """Build from JSON data; unknown or mistyped fields are errors, not ignored."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
        data = dict(data)
        sub = {"prune": PruneConfig, "loss": LossConfig}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        for key, sub_cls in sub.items():
            if key in data:
                value = data[key]
                sub_known = {f.name for f in dataclasses.fields(sub_cls)}
                if not isinstance(value, dict) or set(value) - sub_known:
                    raise ConfigError(
                        f"{where}: {key} must be an object with fields "
                        f"{sorted(sub_known)}, got {value!r}"
                    )
                check_json_types(value, sub_cls, where, prefix=f"{key}.")
                data[key] = sub_cls(**value)
        check_json_types({k: v for k, v in data.items() if k not in sub}, cls, where)
        config = cls(**data)
        config.validate(where=where)
        return config

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> SpecStreamConfig:
        path = Path(directory) / CONFIG_FILE
        if not path.is_file():
            raise ConfigError(f"{path}: missing; not a specstream adapter checkpoint")
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(data, where=str(path))


def check_stream_tensors(
    tensors: Mapping[str, Any],
    config: SpecStreamConfig,
    hidden_size: int,
    where: str,
    hf_config: Any = None,
) -> None:
    """Names and shapes of the stream tensors (``name -> tensor``, unprefixed) must match the
    config exactly: an adapter's, or a merged checkpoint's without ``specstream.``."""
    expected = config.stream_tensor_shapes(hidden_size, hf_config)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ConfigError(
            f"{where}: missing stream tensor(s) {missing} (config: num_streams="
            f"{config.num_streams}, init_rank={config.init_rank}, prune.enabled="
            f"{config.prune.enabled}, stream_lora_rank={config.stream_lora_rank})"
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ConfigError(
            f"{where}: unexpected tensor(s) {unexpected}; expected {sorted(expected)}"
        )
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            hint = (
                f" (the model's hidden size is {hidden_size})"
                if (got[-1] != shape[-1] or got[0] != shape[0])
                and not name.startswith("stream_lora_")
                else ""
            )
            raise ConfigError(
                f"{where}: tensor {name} has shape {list(got)}, expected {list(shape)}{hint}"
            )
