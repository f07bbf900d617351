"""The plugin's settings of one engine: each field defined once, resolved once per engine.

Every setting travels with vLLM's engine config, so that each engine of a process (and every
process of an engine) reads the same:

* vLLM's ``speculative_config`` where vLLM has the field: ``num_speculative_tokens`` and
  ``num_speculative_tokens_per_batch_size`` (a fixed schedule instead of the adaptive
  policy);
* vLLM's channel for out-of-tree settings for the plugin's own fields (the fields of
  :class:`EngineSettings` made with :func:`user_field`; :data:`FIELDS`):
  ``LLM(..., additional_config={"specstream": {...}})``,
  ``vllm serve --additional-config '{"specstream": {...}}'``;
* the checkpoint's ``specstream`` section for per-checkpoint defaults (``suffix_drafts``,
  ``prune.threshold``), which the fields above override.

:func:`resolve_settings` merges and validates them where vLLM builds its engine config (the
front-end, :mod:`vllm_specstream.patches.engine_config_check`), which writes the result into
the engine config (:func:`hand_down`, key :data:`SETTINGS_KEY` of ``additional_config``);
the model class and the proposer of every worker then take it from there
(:meth:`EngineSettings.of`).

Environment variables remain only for process-level switches (``SPECSTREAM_HOME``,
``SPECSTREAM_SKIP_VLLM_VERSION_CHECK``, ``SPECSTREAM_IOMP_PRELOAD``); a process that still sets
a per-engine variable of earlier releases is refused, naming the field that replaces it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from vllm_specstream import PROPOSER
from vllm_specstream.checkpoint.config import (
    SUFFIX_DRAFTS_VALUES,
    ConfigError,
    suffix_min_score_from,
)
from vllm_specstream.speculation.suffix_drafts import suffix_cache_class

#: The key of ``additional_config`` that holds the plugin's fields.
KEY = "specstream"
#: The key of ``additional_config`` where the front-end hands the resolved settings down.
SETTINGS_KEY = "specstream_settings"
#: Where the streams run (:mod:`vllm_specstream.model_executor.specstream`).
PLACEMENTS = ("window", "accepted")
STREAM_DTYPE_MODES = ("auto", "model", "bfloat16", "int8")
SCHEDULE_OPTION = "num_speculative_tokens_per_batch_size"

#: Per-engine variables of earlier releases and the field that replaces each.
RETIRED_VARIABLES = {
    "SPECSTREAM_STREAM_DTYPE": "stream_dtype",
    "SPECSTREAM_DRAFT_MIN_PROB": "draft_min_prob",
    "SPECSTREAM_TREE_TOP_K": "tree_top_k",
    "SPECSTREAM_TREE_PRUNE": "tree_prune",
    "SPECSTREAM_SUFFIX_DRAFTS": "suffix_drafts",
}
#: Proposer class paths of earlier releases, and the placement each pinned (None: none).
RETIRED_PROPOSERS = {
    "vllm_specstream.proposer.SpecStreamProposer": None,
    "vllm_specstream.proposer.WindowSpecStreamProposer": "window",
    "vllm_specstream.proposer.AcceptedSpecStreamProposer": "accepted",
}


def field_hint(name: str, value: object) -> str:
    """How a user sets field ``name`` to ``value``, in both of vLLM's spellings."""
    doc = json.dumps({KEY: {name: value}})
    return f"LLM(..., additional_config={doc}) or vllm serve --additional-config '{doc}'"


def _bad(name: str, value: object) -> ConfigError:
    return ConfigError(f"additional_config[{KEY!r}][{name!r}]={value!r}: expected {FIELDS[name]}")


def _probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise _bad(name, value)
    return float(value)


def placement_from(value: object) -> str | None:
    if value is None or value in PLACEMENTS:
        return value  # type: ignore[return-value]
    raise _bad("placement", value)


def stream_dtype_from(value: object) -> str:
    mode = "auto" if value is None else str(value).strip().lower()
    if mode not in STREAM_DTYPE_MODES:
        raise _bad("stream_dtype", value)
    return mode


def draft_min_prob_from(value: object) -> float:
    return 0.0 if value is None else _probability("draft_min_prob", value)


def tree_prune_from(value: object) -> float | None:
    """A threshold, ``off`` (returned as 0: prunes nothing), or None (unset)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "off":
        return 0.0
    return _probability("tree_prune", value)


def tree_top_k_from(value: object) -> tuple[int, ...] | None:
    """``2`` (two candidates from every stream) or one count per stream (``[3, 2, 1, 1]``);
    None, 0 or all ones: chains."""
    if value is None or value == 0:
        return None
    ks = value if isinstance(value, list | tuple) else [value]
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise _bad("tree_top_k", value)
    return None if all(k == 1 for k in ks) else tuple(ks)


def prompt_lookup_from(value: object) -> bool | None:
    """Field ``prompt_lookup``: ``on``/``off`` (or a bool); None: unset."""
    if value is None or isinstance(value, bool):
        return value
    mode = str(value).strip().lower()
    if mode not in ("on", "off"):
        raise _bad("prompt_lookup", value)
    return mode == "on"


def suffix_drafts_from(value: object) -> float | None:
    """Field ``suffix_drafts`` as :func:`~vllm_specstream.checkpoint.config.suffix_min_score_from`
    reads it (None: off)."""
    if value is None:
        return None
    try:
        return suffix_min_score_from(str(value))
    except ConfigError:
        raise _bad("suffix_drafts", value) from None


def user_field(default: object, takes: str, parse: Callable[[object], object]):
    """A field users set in ``additional_config["specstream"]``: ``takes`` says what it
    takes (error messages, docs), ``parse`` validates a value and returns the parsed one."""
    return dataclasses.field(default=default, metadata={"takes": takes, "parse": parse})


@dataclass(frozen=True)
class EngineSettings:
    """The settings of one engine, resolved (:func:`resolve_settings`): the user's fields
    (:func:`user_field`) merged with vLLM's speculative config and the checkpoint's
    defaults."""

    placement: str | None = user_field(
        None, f"one of {list(PLACEMENTS)}, or null for the faster on this engine", placement_from
    )
    """``window`` (streams for every position of the verified window, inside the forward) or
    ``accepted`` (streams at the last accepted position only); None: the model's default
    (window where the decoder runs eagerly, else accepted)."""
    stream_dtype: str = user_field("auto", f"one of {list(STREAM_DTYPE_MODES)}", stream_dtype_from)
    """The stream pass's matmuls: ``auto``, ``model``, ``bfloat16`` or ``int8``
    (:mod:`vllm_specstream.model_executor.stream_weights`)."""
    tree_top_k: tuple[int, ...] | None = user_field(
        None,
        "candidates per stream of a draft tree: an int for every stream or a list of one per "
        "stream, e.g. 2 or [3, 2, 1, 1]; 0 or null: chain drafts",
        tree_top_k_from,
    )
    """Candidates per stream of the draft tree (one for every stream, or one per stream);
    None: chain drafts. The tree's nodes are the first ``num_speculative_tokens`` of
    :func:`vllm_specstream.streams.draft_trees.tree_template`."""
    tree_prune: float | None = user_field(
        None,
        "the early-exit pruning threshold of draft trees, in [0, 1), or 'off'; null: the "
        "checkpoint's prune.threshold",
        tree_prune_from,
    )
    """Early-exit pruning threshold of the draft trees in ``[0, 1)`` (0: no pruning): the
    field, else the checkpoint's ``prune.threshold`` where it has a pruning adapter
    (:mod:`vllm_specstream.model_executor.trees.pruning`); None: unresolved (no trees)."""
    suffix_drafts: float | None = user_field(
        None, f"{SUFFIX_DRAFTS_VALUES}; null: the checkpoint's suffix_drafts", suffix_drafts_from
    )
    """The score a request's suffix-tree draft must reach to be drafted instead of the
    streams' (:mod:`vllm_specstream.speculation.suffix_drafts`; nan: where it yields as many
    tokens per step cost as the streams): the field, else the checkpoint's; None: the
    streams only."""
    draft_min_prob: float = user_field(
        0.0, "the confidence rule's threshold in [0, 1); 0: off", draft_min_prob_from
    )
    """The confidence rule: a draft stops where the streams' cumulative probability falls
    below it; 0 off."""
    prompt_lookup: bool = user_field(
        False,
        "'on' (drafts copied from the request's prompt and output where they yield as many "
        "tokens per step cost as the streams; the default) or 'off'",
        prompt_lookup_from,
    )
    """Whether a request's step may draft by prompt lookup instead of the streams
    (:mod:`vllm_specstream.model_executor.prompt_lookup`): on by default for chain drafts
    (draft trees draft without it)."""
    num_speculative_tokens: int = 0
    """Draft length at most (vLLM's ``num_speculative_tokens``); 0: speculation off, or by
    another method than the streams."""
    schedule: tuple[tuple[int, int, int], ...] | None = None
    """The user's ``num_speculative_tokens_per_batch_size``; None: the adaptive policy
    (:mod:`vllm_specstream.speculation.policy`)."""
    suffix_from_checkpoint: bool = False
    """Whether ``suffix_drafts`` is the checkpoint's default (the field unset)."""
    suffix_skipped: str | None = None
    """Why the checkpoint's suffix-drafts default is not followed (None: it is, or there is
    none, or the field is set): :func:`suffix_default_skipped`."""
    tree_prune_off: str | None = None
    """Why pruning is off although a threshold applies (None: it is not)."""

    @property
    def trees(self) -> bool:
        return self.tree_top_k is not None

    @classmethod
    def of(cls, vllm_config) -> EngineSettings:
        """The settings the front-end resolved for the engine of ``vllm_config``
        (:func:`hand_down`); resolved here where no front-end did (an engine config built
        without ``EngineArgs``)."""
        additional = getattr(vllm_config, "additional_config", None)
        record = additional.get(SETTINGS_KEY) if isinstance(additional, Mapping) else None
        if record is None:
            return resolve_settings(vllm_config)
        return cls.from_record(record)

    def to_record(self) -> dict:
        """The settings as plain JSON values (vLLM hashes and pickles its engine config)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: Mapping) -> EngineSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(record) != names:
            raise ConfigError(
                f"additional_config[{SETTINGS_KEY!r}] was not written by this vllm-specstream "
                f"(fields {sorted(record)}); leave that key to the plugin"
            )
        values = dict(record)
        if values["tree_top_k"] is not None:
            values["tree_top_k"] = tuple(values["tree_top_k"])
        if values["schedule"] is not None:
            values["schedule"] = tuple(tuple(e) for e in values["schedule"])
        return cls(**values)


#: The user's fields of ``additional_config["specstream"]`` and what each takes.
FIELDS = {
    f.name: f.metadata["takes"] for f in dataclasses.fields(EngineSettings) if "takes" in f.metadata
}


def hand_down(vllm_config, settings: EngineSettings) -> None:
    """Put ``settings`` into ``vllm_config`` for the engine's processes (a new
    ``additional_config`` dict: the user's may be shared with other engines)."""
    additional = dict(getattr(vllm_config, "additional_config", None) or {})
    additional[SETTINGS_KEY] = settings.to_record()
    vllm_config.additional_config = additional


def drafts_with_streams(spec) -> bool:
    """Whether vLLM's ``speculative_config`` drafts with this plugin's streams (its
    ``custom_class`` proposer). Another method on a specstream checkpoint (vLLM's ngram,
    suffix, Medusa, or another proposer class) leaves the streams idle: the model then runs
    as plain decoding does."""
    if spec is None or getattr(spec, "method", "custom_class") != "custom_class":
        return False
    return getattr(spec, "model", None) in (None, PROPOSER)


def check_proposer(path: str | None) -> None:
    """Refuse a proposer class path of an earlier release, naming its replacement."""
    if str(path) not in RETIRED_PROPOSERS:
        return
    placement = RETIRED_PROPOSERS[str(path)]
    raise ConfigError(
        f"speculative_config model={path!r} was moved: use {PROPOSER!r} (or the alias "
        "'specstream')"
        + (
            f" with field placement={placement!r}: {field_hint('placement', placement)}"
            if placement
            else ""
        )
    )


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse a per-engine variable of an earlier release, naming the field that replaces it."""
    for name, field_name in RETIRED_VARIABLES.items():
        text = environ.get(name, "").strip()
        if text:
            raise ConfigError(
                f"{name} is no longer read: set field {field_name!r} of the engine instead, "
                f"{field_hint(field_name, _as_field_value(text))}; unset {name}"
            )


def _as_field_value(text: str) -> object:
    """A retired variable's value as its field takes it (``3,2,1,1`` -> ``[3, 2, 1, 1]``)."""
    try:
        values = [json.loads(part) for part in text.split(",")]
    except ValueError:
        return text
    return values[0] if len(values) == 1 else values


def fields_of(vllm_config) -> dict:
    """``additional_config["specstream"]`` of vLLM's engine config ({} when absent); a
    malformed section or an unknown field raises ``ConfigError`` naming it."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    raw = additional.get(KEY, {}) if isinstance(additional, Mapping) else {}
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"additional_config[{KEY!r}] must be a mapping of fields, got {raw!r}; e.g. "
            f"{field_hint('tree_top_k', 2)}"
        )
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), FIELDS, n=1)
        raise ConfigError(
            f"additional_config[{KEY!r}]: unknown field(s) {unknown}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; the fields are {sorted(FIELDS)}"
        )
    return dict(raw)


def check_fields(additional_config: Mapping | None) -> EngineSettings:
    """Parse the plugin's fields of an ``additional_config`` (as ``LLM(...)`` takes it) as an
    engine would; raises ``ConfigError`` naming a bad field."""
    from types import SimpleNamespace

    return resolve_settings(SimpleNamespace(additional_config=additional_config or {}), {})


TREE_PRUNE_NO_ADAPTER = (
    "field tree_prune={threshold:g}: the checkpoint has no pruning adapter ({where}: "
    "specstream.prune.enabled is false); add one with `specstream train --objective prune "
    "--init-from ADAPTER` and export it again, or leave tree_prune out"
)
#: A field of copied drafts (``suffix_drafts``, ``prompt_lookup``) asked for beside trees.
CHAINS_ONLY = (
    "field {field} drafts chains beside the streams, not trees: leave out tree_top_k or {field}"
)


def draft_tree_of(settings: EngineSettings, num_streams: int):
    """The draft tree of ``settings``: the first ``num_speculative_tokens`` nodes of the
    template of ``num_streams`` streams and ``tree_top_k`` (its top-1 chain first)."""
    from vllm_specstream.streams.draft_trees import tree_template

    ks = settings.tree_top_k
    if ks is None:
        return None
    if len(ks) not in (1, num_streams):
        raise ConfigError(
            f"field tree_top_k={list(ks)}: give one count for all streams or one per stream "
            f"(the checkpoint has num_streams={num_streams})"
        )
    k = settings.num_speculative_tokens
    template = tree_template(num_streams, ks[0] if len(ks) == 1 else ks, max_nodes=k)
    if template.num_nodes < k:
        raise ConfigError(
            f"num_speculative_tokens={k} exceeds the {template.num_nodes} nodes of the draft "
            f"tree (field tree_top_k={list(ks)}, num_streams={num_streams})"
        )
    return template


def resolve_settings(vllm_config=None, environ: Mapping[str, str] | None = None) -> EngineSettings:
    """The settings of the engine of ``vllm_config`` (None, or speculation by another method:
    the streams are off): every field parsed, merged with the speculative config and the
    checkpoint's defaults; a bad value raises ``ConfigError`` naming the field. ``environ``
    (default: this process's) is checked for retired per-engine variables."""
    check_environment(os.environ if environ is None else environ)
    raw = fields_of(vllm_config)
    # Every field is parsed (a bad value fails even where speculation is off).
    parsed = {
        f.name: f.metadata["parse"](raw.get(f.name))
        for f in dataclasses.fields(EngineSettings)
        if f.name in FIELDS
    }
    trees = parsed["tree_top_k"] is not None
    if trees and parsed["suffix_drafts"] is not None:
        raise ConfigError(CHAINS_ONLY.format(field="suffix_drafts"))
    if trees and parsed["prompt_lookup"]:
        raise ConfigError(CHAINS_ONLY.format(field="prompt_lookup"))
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        check_proposer(getattr(spec, "model", None))
    if not drafts_with_streams(spec):
        spec = None
    k = int(spec.num_speculative_tokens or 0) if spec is not None else 0
    if not k:
        return EngineSettings(
            **parsed | dict(tree_top_k=None, suffix_drafts=None, prompt_lookup=False)
        )
    schedule = getattr(spec, SCHEDULE_OPTION, None)
    suffix = _suffix_drafts(vllm_config, raw, parsed["suffix_drafts"], trees)
    prune = (
        _tree_prune(vllm_config, parsed["tree_prune"]) if trees else (parsed["tree_prune"], None)
    )
    return EngineSettings(
        **parsed
        | dict(
            num_speculative_tokens=k,
            schedule=tuple(tuple(int(x) for x in e) for e in schedule) if schedule else None,
            prompt_lookup=not trees and parsed["prompt_lookup"] is not False,
            tree_prune=prune[0],
            tree_prune_off=prune[1],
        )
        | suffix
    )


def _suffix_drafts(vllm_config, raw: Mapping, user: float | None, trees: bool) -> dict:
    """The suffix-draft settings: the field where set, else the checkpoint's default where it
    can be followed (why not: ``suffix_skipped``, said by the proposer)."""
    default = checkpoint_suffix_drafts(vllm_config) if raw.get("suffix_drafts") is None else None
    if default is None:
        return dict(suffix_drafts=user)
    try:
        default_score = suffix_min_score_from(default)
    except ConfigError:
        raise ConfigError(
            f"{_model_name(vllm_config)} config.json (specstream): suffix_drafts "
            f"must be {SUFFIX_DRAFTS_VALUES}, got {default!r}"
        ) from None
    skipped = suffix_default_skipped(default, trees=trees) if default_score is not None else None
    score = None if skipped else default_score
    return dict(
        suffix_drafts=score, suffix_from_checkpoint=score is not None, suffix_skipped=skipped
    )


def _tree_prune(vllm_config, user: float | None) -> tuple[float, str | None]:
    """The draft trees' pruning threshold (0: none) and why it is off where one applies but
    cannot run here: the field, else the checkpoint's pruning adapter's ``threshold``."""
    from vllm_specstream.checkpoint.merged import adapter_streams_only, read_specstream_section

    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    if not isinstance(getattr(hf_config, "specstream", None), Mapping):
        return user or 0.0, None  # not a specstream checkpoint: refused by the preflight
    where = _config_file(vllm_config)
    try:
        prune = read_specstream_section(hf_config, where=where).prune
        has_adapter = prune.enabled and not adapter_streams_only(hf_config, where=where)
    except ConfigError:
        return user or 0.0, None  # a malformed section: the preflight names what is wrong
    if user is None:
        user = prune.threshold if has_adapter else 0.0
    elif user > 0 and not has_adapter:
        raise ConfigError(TREE_PRUNE_NO_ADAPTER.format(threshold=user, where=where))
    if user <= 0:
        return 0.0, None
    if not getattr(model_config, "enforce_eager", True):
        return 0.0, "the decoder is compiled (pruning runs its layers eagerly: enforce_eager=True)"
    if getattr(vllm_config, "lora_config", None):
        return 0.0, "LoRA serving (LoRA layers map every row of the batch)"
    return user, None  # on the CPU attention backend only (the model checks)


def _config_file(vllm_config) -> str:
    """The served checkpoint's ``config.json``, as error messages name it."""
    from pathlib import Path

    model = _model_name(vllm_config)
    return str(Path(model) / "config.json") if Path(model).is_dir() else f"{model} config.json"


def _model_name(vllm_config) -> str:
    return str(getattr(getattr(vllm_config, "model_config", None), "model", "the checkpoint's"))


def checkpoint_suffix_drafts(vllm_config) -> str | None:
    """The served checkpoint's ``specstream.suffix_drafts`` (None: it has none, or it is
    not a specstream checkpoint)."""
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    section = getattr(hf_config, "specstream", None)
    value = section.get("suffix_drafts") if isinstance(section, Mapping) else None
    return value if isinstance(value, str) else None


def suffix_default_skipped(checkpoint_default: str, *, trees: bool) -> str | None:
    """Why a checkpoint's ``suffix_drafts`` default (one that drafts) is not followed (None:
    it is): the user asked for draft trees, or arctic-inference is not importable. A default
    the user did not set is never an error; the engine serves the streams alone and says why
    once."""
    not_followed = (
        f"the checkpoint's specstream.suffix_drafts={checkpoint_default!r} is not followed"
    )
    if trees:
        return f"{not_followed}: field tree_top_k asks for draft trees, which draft without them"
    if not suffix_decoding_importable():
        return (
            f"{not_followed}: arctic-inference's suffix decoding is not importable, so the "
            "streams draft alone (`make suffix-decoding` builds it for this CPU where the "
            f"plugin finds it; {field_hint('suffix_drafts', 'off')} silences this)"
        )
    return None


def suffix_decoding_importable() -> bool:
    """Whether arctic-inference's suffix decoding (vLLM's ``suffix`` method's) imports."""
    try:
        suffix_cache_class()
    except ConfigError:
        return False
    return True
