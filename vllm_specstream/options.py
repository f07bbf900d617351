"""The plugin's runtime settings, in one typed dataclass read once per engine.

Two come from vLLM's ``speculative_config`` (so they travel with the engine's config to
every process): the stream *placement* (which proposer class ``model`` names) and the
user's batch-size schedule. The others come from the environment, which vLLM's engine
processes inherit: the stream pass's dtype, the confidence rule's threshold, the draft
tree's shape and suffix drafts beside the streams. Suffix drafts also have a default in the
checkpoint (``specstream.suffix_drafts`` of ``config.json``), which the variable overrides.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_specstream import PLACEMENT_PROPOSERS, PROPOSER
from vllm_specstream.config import ConfigError
from vllm_specstream.suffix_drafts import (
    ENV_SUFFIX_DRAFTS,
    suffix_cache_class,
    suffix_min_score_from,
)

ENV_STREAM_DTYPE = "SPECSTREAM_STREAM_DTYPE"
STREAM_DTYPE_MODES = ("auto", "model", "bfloat16")
ENV_DRAFT_MIN_PROB = "SPECSTREAM_DRAFT_MIN_PROB"
ENV_TREE_TOP_K = "SPECSTREAM_TREE_TOP_K"
ENV_TREE_PRUNE = "SPECSTREAM_TREE_PRUNE"
SCHEDULE_OPTION = "num_speculative_tokens_per_batch_size"


@dataclass(frozen=True)
class SpecStreamOptions:
    """Runtime settings of one engine (see :func:`read_options`)."""

    num_speculative_tokens: int = 0
    """Draft length at most (vLLM's ``num_speculative_tokens``); 0: speculation off."""
    placement: str | None = None
    """``window`` or ``accepted`` (:mod:`vllm_specstream.model_executor.specstream`); None:
    the model's default (window where the decoder runs eagerly, else accepted)."""
    schedule: tuple[tuple[int, int, int], ...] | None = None
    """The user's ``num_speculative_tokens_per_batch_size``; None: the adaptive cost model
    (:mod:`vllm_specstream.policy`)."""
    stream_dtype: str = "auto"
    """``$SPECSTREAM_STREAM_DTYPE``: ``auto``, ``model`` or ``bfloat16``
    (:mod:`vllm_specstream.model_executor.stream_weights`)."""
    draft_min_prob: float = 0.0
    """``$SPECSTREAM_DRAFT_MIN_PROB``: the confidence rule's threshold in ``[0, 1)``; 0 off."""
    tree_top_k: tuple[int, ...] | None = None
    """``$SPECSTREAM_TREE_TOP_K``: candidates per stream of the draft tree (one int for every
    stream, or one per stream); None: chain drafts. The tree's nodes are the first
    ``num_speculative_tokens`` of :func:`vllm_specstream.draft_trees.tree_template`."""

    tree_prune: float | None = None
    """``$SPECSTREAM_TREE_PRUNE``: early-exit pruning threshold of draft trees in ``[0, 1)``
    (``off``: no pruning); None: the checkpoint's ``prune.threshold`` where it has a pruning
    adapter (:mod:`vllm_specstream.model_executor.tree_pruning`), else no pruning."""

    suffix_min_score: float | None = None
    """``$SPECSTREAM_SUFFIX_DRAFTS``, else the checkpoint's ``suffix_drafts``
    (:mod:`vllm_specstream.suffix_drafts`): a request's step drafts from the suffix trees
    where their draft's score reaches this (nan: where they yield as many tokens per step
    cost as the streams); None: the streams only."""
    suffix_from_checkpoint: bool = False
    """Whether ``suffix_min_score`` is the checkpoint's default (the variable unset)."""
    suffix_skipped: str | None = None
    """Why the checkpoint's suffix-drafts default is not followed (None: it is, or there is
    none, or the variable is set): :func:`suffix_default_skipped`."""

    @property
    def trees(self) -> bool:
        return self.tree_top_k is not None


def placement_of(proposer_path: str | None) -> str | None:
    """The placement a ``custom_class`` proposer path pins (None: the model's default)."""
    for placement, path in PLACEMENT_PROPOSERS.items():
        if proposer_path == path:
            return placement
    if proposer_path not in (None, PROPOSER):
        raise ConfigError(
            f"speculative_config model={proposer_path!r} is not a specstream proposer; use "
            f"{PROPOSER!r} or one of {sorted(PLACEMENT_PROPOSERS.values())}"
        )
    return None


def drafts_with_streams(spec) -> bool:
    """Whether vLLM's ``speculative_config`` drafts with this plugin's streams (a specstream
    ``custom_class`` proposer). Another method on a specstream checkpoint (vLLM's ngram,
    suffix, Medusa, or another proposer class) leaves the streams idle: the model then runs
    as plain decoding does."""
    if spec is None or getattr(spec, "method", "custom_class") != "custom_class":
        return False
    return getattr(spec, "model", None) in (None, PROPOSER, *PLACEMENT_PROPOSERS.values())


def stream_dtype_from(environ: Mapping[str, str]) -> str:
    raw = environ.get(ENV_STREAM_DTYPE, "")
    mode = raw.strip().lower() or "auto"
    if mode not in STREAM_DTYPE_MODES:
        raise ConfigError(f"{ENV_STREAM_DTYPE}={raw!r}: choose one of {list(STREAM_DTYPE_MODES)}")
    return mode


def _probability(name: str, text: str, meaning: str) -> float:
    """``text`` of variable ``name`` as a probability in ``[0, 1)``; else a ConfigError that
    says what the value means."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{name}={text!r}: expected a probability in [0, 1) {meaning}")
    return value


def draft_min_prob_from(environ: Mapping[str, str]) -> float:
    text = environ.get(ENV_DRAFT_MIN_PROB, "").strip()
    if not text:
        return 0.0
    return _probability(ENV_DRAFT_MIN_PROB, text, "(0 turns the confidence rule off)")


def tree_prune_from(environ: Mapping[str, str]) -> float | None:
    """``$SPECSTREAM_TREE_PRUNE``: a threshold, ``off`` (returned as 0: prunes nothing), or
    unset (None)."""
    text = environ.get(ENV_TREE_PRUNE, "").strip().lower()
    if not text:
        return None
    if text == "off":
        return 0.0
    return _probability(
        ENV_TREE_PRUNE,
        text,
        "or 'off' (a draft tree node is pruned when its early-exit probability is below it)",
    )


#: ``$SPECSTREAM_TREE_PRUNE`` set on a checkpoint without a pruning adapter.
TREE_PRUNE_NO_ADAPTER = (
    ENV_TREE_PRUNE + "={threshold:g}: the checkpoint has no pruning adapter ({where}: "
    "specstream.prune.enabled is false); add one with `specstream train --objective prune "
    "--init-from ADAPTER` and export it again, or unset " + ENV_TREE_PRUNE
)


def tree_top_k_from(environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """``$SPECSTREAM_TREE_TOP_K``: ``"2"`` (two candidates from every stream) or one count
    per stream (``"3,2,1,1"``); unset, ``0`` or all ones: chains."""
    text = environ.get(ENV_TREE_TOP_K, "").strip()
    if not text or text == "0":
        return None
    try:
        ks = tuple(int(x) for x in text.split(","))
    except ValueError:
        ks = (0,)
    if any(k < 1 for k in ks):
        raise ConfigError(
            f"{ENV_TREE_TOP_K}={text!r}: expected a candidate count >= 1 per stream, one for "
            "all (e.g. 2) or one per stream (e.g. 3,2,1,1); unset or 0 for chain drafts"
        )
    return None if all(k == 1 for k in ks) else ks


TREES_TP_ERROR = (
    f"{ENV_TREE_TOP_K} (draft trees) needs tensor_parallel_size 1, got {{tp}}; unset it to "
    "draft chains"
)


def draft_tree_of(options: SpecStreamOptions, num_streams: int):
    """The draft tree of ``options``: the first ``num_speculative_tokens`` nodes of the
    template of ``num_streams`` streams and ``tree_top_k`` (its top-1 chain first)."""
    from vllm_specstream.draft_trees import tree_template

    ks = options.tree_top_k
    if ks is None:
        return None
    if len(ks) not in (1, num_streams):
        raise ConfigError(
            f"{ENV_TREE_TOP_K}={','.join(map(str, ks))}: give one count for all streams or one "
            f"per stream (the checkpoint has num_streams={num_streams})"
        )
    k = options.num_speculative_tokens
    template = tree_template(num_streams, ks[0] if len(ks) == 1 else ks, max_nodes=k)
    if template.num_nodes < k:
        raise ConfigError(
            f"num_speculative_tokens={k} exceeds the {template.num_nodes} nodes of the draft "
            f"tree ({ENV_TREE_TOP_K}={','.join(map(str, ks))}, num_streams={num_streams})"
        )
    return template


#: Every variable :func:`read_options` reads.
ENV_OPTIONS = (
    ENV_STREAM_DTYPE,
    ENV_DRAFT_MIN_PROB,
    ENV_TREE_TOP_K,
    ENV_TREE_PRUNE,
    ENV_SUFFIX_DRAFTS,
)

#: The last read of this process's environment: (engine config, the variables' values,
#: options), so that the model and the proposer of one worker share one read.
_last_read: tuple[object, tuple, SpecStreamOptions] | None = None


def read_options(vllm_config=None, environ: Mapping[str, str] | None = None) -> SpecStreamOptions:
    """The settings of the engine of ``vllm_config`` (None, or speculation by another
    method: the streams are off) and
    ``environ`` (default: this process's environment, read once per engine config while
    its variables keep their values); bad values raise ``ConfigError`` naming the variable
    or option."""
    global _last_read
    if environ is not None or vllm_config is None:
        return _read_options(vllm_config, os.environ if environ is None else environ)
    values = tuple(os.environ.get(name) for name in ENV_OPTIONS)
    if _last_read is not None and _last_read[0] is vllm_config and _last_read[1] == values:
        return _last_read[2]
    options = _read_options(vllm_config, os.environ)
    _last_read = (vllm_config, values, options)
    return options


def _read_options(vllm_config, environ: Mapping[str, str]) -> SpecStreamOptions:
    spec = getattr(vllm_config, "speculative_config", None)
    if not drafts_with_streams(spec):
        spec = None
    k = spec.num_speculative_tokens if spec is not None else 0
    schedule = getattr(spec, SCHEDULE_OPTION, None) if spec is not None else None
    # Suffix drafts: the variable where set, else the checkpoint's default where it can be
    # followed (why not, said by the proposer).
    user_suffix = bool(environ.get(ENV_SUFFIX_DRAFTS, "").strip())
    default = checkpoint_suffix_drafts(vllm_config) if k and not user_suffix else None
    suffix_skipped = suffix_default_skipped(environ, default) if default is not None else None
    if default is None or suffix_skipped:
        suffix_min_score = suffix_drafts_from(environ) if k else None
    else:
        suffix_min_score = suffix_min_score_from(default)
    return SpecStreamOptions(
        num_speculative_tokens=k or 0,
        placement=placement_of(getattr(spec, "model", None)) if spec is not None else None,
        schedule=tuple(tuple(int(x) for x in e) for e in schedule) if schedule else None,
        stream_dtype=stream_dtype_from(environ),
        draft_min_prob=draft_min_prob_from(environ) if k else 0.0,
        tree_top_k=tree_top_k_from(environ) if k else None,
        tree_prune=tree_prune_from(environ) if k else None,
        suffix_min_score=suffix_min_score,
        suffix_from_checkpoint=suffix_min_score is not None and not user_suffix,
        suffix_skipped=suffix_skipped,
    )


SUFFIX_WITH_TREES = (
    f"{ENV_SUFFIX_DRAFTS} drafts chains beside the streams, not trees; unset "
    f"{ENV_TREE_TOP_K} or {ENV_SUFFIX_DRAFTS}"
)


def suffix_drafts_from(environ: Mapping[str, str]) -> float | None:
    """``$SPECSTREAM_SUFFIX_DRAFTS`` (:func:`~vllm_specstream.suffix_drafts.suffix_min_score_from`);
    refused beside draft trees."""
    score = suffix_min_score_from(environ.get(ENV_SUFFIX_DRAFTS, ""))
    if score is not None and tree_top_k_from(environ) is not None:
        raise ConfigError(SUFFIX_WITH_TREES)
    return score


def checkpoint_suffix_drafts(vllm_config) -> str | None:
    """The served checkpoint's ``specstream.suffix_drafts`` (None: it has none, or it is
    not a specstream checkpoint)."""
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    section = getattr(hf_config, "specstream", None)
    value = section.get("suffix_drafts") if isinstance(section, Mapping) else None
    return value if isinstance(value, str) else None


def suffix_default_skipped(environ: Mapping[str, str], checkpoint_default: str) -> str | None:
    """Why a checkpoint's ``suffix_drafts`` default is not followed (None: it is): the user
    asked for draft trees, or arctic-inference is not importable. A default the user did not
    set is never an error; the engine serves the streams alone and says why once."""
    if suffix_min_score_from(checkpoint_default) is None:
        return None
    if tree_top_k_from(environ) is not None:
        return (
            f"the checkpoint's specstream.suffix_drafts={checkpoint_default!r} is not followed: "
            f"{ENV_TREE_TOP_K} asks for draft trees, which draft without suffix drafts"
        )
    if not suffix_decoding_importable():
        return (
            f"the checkpoint's specstream.suffix_drafts={checkpoint_default!r} is not followed: "
            "arctic-inference's suffix decoding is not importable, so the streams draft alone "
            "(`make suffix-decoding` builds it for this CPU where the plugin finds it, or set "
            f"{ENV_SUFFIX_DRAFTS}=off to silence this)"
        )
    return None


def suffix_decoding_importable() -> bool:
    """Whether arctic-inference's suffix decoding (vLLM's ``suffix`` method's) imports."""
    try:
        suffix_cache_class()
    except ConfigError:
        return False
    return True
