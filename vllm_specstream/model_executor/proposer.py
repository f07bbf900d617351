"""``SpecStreamProposer``: vLLM's ``custom_class`` proposer that hands out the stream drafts.

The drafts were computed inside the target's own forward (:mod:`.stream_pass`); each step the
proposer takes the model's stash (clearing it), reads each request's stream drafts at its last
accepted token (:mod:`.stream_drafts`, which refuses a stash that is not this step's), lets a
request take a copied draft instead where it yields as many tokens per step cost
(:mod:`.copied_drafts`: prompt lookup, on by default, and suffix trees), and asks the policy
(:mod:`vllm_specstream.speculation.policy`) how many drafts the next step gets. It keeps no
per-row state: rows of vLLM's input batch move between steps (copied drafts are followed by
request id). Steps that draft nothing are watched
(:mod:`vllm_specstream.speculation.draft_watch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.logger import init_logger
from vllm_specstream.model_executor.copied_drafts import CopiedDrafts
from vllm_specstream.model_executor.heap import HeapTrim
from vllm_specstream.model_executor.prompt_lookup import PromptLookup
from vllm_specstream.model_executor.stream_drafts import StashDrafts
from vllm_specstream.speculation.choices import (
    AnchoredChain,
    Choice,
    CopyStep,
    TreeChoice,
    rows_of,
    tree_choices,
)
from vllm_specstream.speculation.draft_watch import NoDraftWatch
from vllm_specstream.speculation.policy import DraftPolicy, lookup_length
from vllm_specstream.speculation.settings import EngineSettings, field_hint
from vllm_specstream.speculation.step_cost import StepCosts, StepTimer
from vllm_specstream.speculation.suffix_drafts import (
    SCHEDULED_MIN_SCORE,
    SuffixDrafts,
    SuffixSettings,
)

logger = init_logger(__name__)

#: Proposer calls between the policy's debug summaries (``VLLM_LOGGING_LEVEL=DEBUG``).
SUMMARY_EVERY = 256


def _apply_in_worker(patch) -> None:
    """Applies a runner patch in the worker that builds this proposer (so vLLM's own
    speculative methods keep vLLM's runner)."""
    from vllm_specstream.patches import apply_patch
    from vllm_specstream.patches.vllm_version import ensure_supported_vllm

    apply_patch(patch, ensure_supported_vllm())


def _hand_runner_to_proposer() -> None:
    """Copied drafts are followed by request id, and suffix trees kept by them, which the
    runner's input batch holds and vLLM does not hand to a ``custom_class`` proposer: the
    runner hands itself over once it has loaded the model (it builds its proposer first, so
    patching its class here is in time)."""
    from vllm_specstream.patches.proposer_runner import PROPOSER_RUNNER

    _apply_in_worker(PROPOSER_RUNNER)


def _verify_trees_in_runner() -> None:
    """Draft trees need the runner's tree hooks (:mod:`vllm_specstream.patches.tree_runner`):
    vLLM builds its proposer before its rejection sampler and before the model's attention
    layers pick their backend, so patching here is in time."""
    from vllm_specstream.patches.tree_runner import TREE_RUNNER

    _apply_in_worker(TREE_RUNNER)


def _sample_plainly_without_drafts() -> None:
    """Most steps of an adaptive engine draft nothing: vLLM's plain sampler takes those
    (:mod:`vllm_specstream.patches.plain_sampling`)."""
    from vllm_specstream.patches.plain_sampling import PLAIN_SAMPLING

    _apply_in_worker(PLAIN_SAMPLING)


@dataclass(frozen=True)
class _DraftSource:
    """Where a step's stream drafts come from (for timing it under its choice)."""

    from_anchors: bool
    """The last forward kept its MSA input: the streams run now, at the anchors."""
    window: bool
    """A window engine (chains): the forward ran ``window_ran`` streams at its window."""
    window_ran: int

    def drafts_short_of(self, k: int) -> bool:
        """Whether a window chain of ``k`` drafts did not come from ``k`` window streams."""
        return self.from_anchors or self.window_ran < k


class SpecStreamProposer:
    """Speculative streaming drafts for vLLM's ``custom_class`` speculative method.

    Its target is the model's :class:`~vllm_specstream.model_executor.stream_pass.StreamPass`
    (``model.streams``), which decided where the streams run (the placement). The draft
    length per step is the adaptive policy's (:mod:`vllm_specstream.speculation.policy`: the
    steps' cost as this engine times them against the acceptance seen so far), or the
    user's ``num_speculative_tokens_per_batch_size``; with field ``draft_min_prob`` the
    model also cuts each draft where the streams' confidence runs out (-1 in its draft
    table).
    """

    def __init__(self, vllm_config):
        options = EngineSettings.of(vllm_config)
        if options.trees:
            _verify_trees_in_runner()
        _sample_plainly_without_drafts()
        self.k = options.num_speculative_tokens
        parallel = getattr(vllm_config, "parallel_config", None)
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.policy: DraftPolicy | None = None
        #: The user's schedule, per batch size (None: the adaptive policy).
        self.lookup = _schedule(vllm_config, options)
        if self.lookup is None:
            # Ranks under tensor parallelism must choose alike: their clocks differ.
            self.policy = DraftPolicy(self.k, StepCosts(measure=self.tp_size == 1))
            self.step_timer = StepTimer()
        self.target = None
        #: The stream drafts of each step, from the model's stash (set in ``load_model``).
        self.reader: StashDrafts | None = None
        self.calls = 0
        self.watch = NoDraftWatch()
        #: The model's draft tree (None: chains); set in ``load_model``.
        self.tree = None
        #: Whether the first anchored chain (window engine) was said.
        self._said_anchored = False
        #: Drafts copied from the requests' own tokens beside the streams.
        self.copies = _copied_drafts(vllm_config, options)
        #: Hands the heap that speculative steps fragment back to the OS now and then.
        self.heap = HeapTrim()

    def bind_runner(self, runner) -> None:
        self.copies.bind_runner(runner)

    def load_model(self, target_model) -> None:
        # The model's streams (placement, stash, drafts) are this proposer's target; not
        # stored as `model`: vLLM probes `drafter.model` in some paths.
        streams = getattr(target_model, "streams", None)
        if streams is None or not hasattr(streams, "take_stash"):
            raise ConfigError(
                f"the specstream proposer needs a SpecStreamForCausalLM checkpoint, got "
                f"{type(target_model).__name__}; export one with `specstream export`"
            )
        streams.prepare()
        placement = streams.placement
        self.target = streams
        self.tree = getattr(streams, "tree", None)
        self.reader = StashDrafts(streams, self.tree, adaptive=self.policy is not None)
        if placement == "window" and self.tree is None:
            streams.window_streams_at = self.window_streams_at
            if self.policy is not None:  # each chain also with its streams at the anchors
                self.policy.anchored = True
        if self.tree is not None and self.policy is not None:
            # Chains of up to num_streams drafts, or a tree: a prefix of the template of
            # one of a few widths, pruned or not where the model prunes.
            chain = min(self.k, self.tree.num_streams)
            prunes = getattr(streams, "prune_threshold", 0.0) > 0
            self.policy = DraftPolicy(
                chain,
                self.policy.costs,
                template=self.tree,
                trees=tree_choices(self.tree.num_nodes, chain, prunes),
            )
        if self.policy is not None:
            logger.info(
                "specstream drafts up to %d per request, as many as pay in this engine's "
                "timed steps (placement %s; num_speculative_tokens_per_batch_size fixes the "
                "schedule)",
                self.k,
                placement,
            )

    def window_streams_at(self, batch_size: int) -> int:
        """Window streams for a forward of ``batch_size`` requests, more than the last call
        chose them for (requests joined): none where the user's schedule drafts nothing at
        that size or the policy would not draft there; else those chosen."""
        if self.lookup is not None:
            k = lookup_length(self.lookup, batch_size)
        else:
            k = self.policy.best(batch_size)
        if k == 0 or isinstance(k, AnchoredChain):
            return 0
        return self.target.window_streams

    def draft_length(self, batch_size: int) -> Choice:
        """Drafts per request for a step of ``batch_size`` requests."""
        if self.lookup is not None:
            return lookup_length(self.lookup, batch_size)
        return self.policy.draft_length(batch_size)

    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_
    ):
        self.heap.step()
        stash = self.target.take_stash()
        self.reader.tree_rows = set()
        req_ids = self.copies.req_ids(sampled_token_ids, token_ids_cpu)
        copied = self.copies.verified(req_ids, sampled_token_ids)
        if self.policy is not None:
            self._record_verified(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, copied)
        # This step's drafts come from the streams the last forward ran at its window, or
        # (it kept its MSA input instead) from streams run now at the anchors.
        source = _DraftSource(
            from_anchors=stash is not None and stash.msa_input is not None,
            window=self.target.placement == "window" and self.tree is None,
            window_ran=self.target.window_streams,
        )
        k = self._choose(len(sampled_token_ids))
        copies = (
            self._copy_choice(k, req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
            if req_ids
            else {}
        )
        drafts = [[] for _ in sampled_token_ids]
        if k != 0:
            drafts, why_none = self.reader.drafts(
                stash, k, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, skip=copies
            )
        for r, tokens in copies.items():
            drafts[r] = tokens
        if k != 0:
            expected = any(sampled_token_ids) and (stash is None or stash.drafting_rank)
            self.watch.step(expected, any(drafts), why_none)
        if copies and len(copies) == sum(1 for s in sampled_token_ids if s):
            # Every request copies this step: the next forward runs no window streams (a
            # request that then needs the streams gets them at its anchor).
            self._set_target(window_streams=0)
        if self.policy is not None:
            self._record_proposed(k, drafts, copies, source)
        return drafts

    def _record_verified(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, copied):
        """Files what the last step's drafts kept with the policy's estimates (copied
        drafts say nothing of the streams' acceptance) and the step's time."""
        chain_sampled = self.reader.record_tree_paths(sampled_token_ids, self.policy.tree_stats)
        if copied:
            chain_sampled = [[] if r in copied else s for r, s in enumerate(chain_sampled)]
        self.reader.filed_tree = None
        self.policy.stats.record_verified(chain_sampled)
        self.step_timer.record(
            self.policy.costs, sampled_token_ids, num_tokens_no_spec, token_ids_cpu
        )

    def _choose(self, batch_size: int) -> Choice:
        """This step's draft length (or tree, or anchored chain), and the next forward's
        window streams to match it (none for anchored drafts)."""
        k = self.draft_length(batch_size)
        self.calls += 1
        if self.policy is not None and self.calls % SUMMARY_EVERY == 0:
            logger.debug("specstream policy: %s", self.policy.summary(batch_size))
        if isinstance(k, AnchoredChain) and not self._said_anchored:
            self._said_anchored = True
            logger.info(
                "specstream runs the streams at the requests' anchors at batch %d: "
                "cheaper there than at every window position",
                batch_size,
            )
        streams = 0 if isinstance(k, AnchoredChain) else rows_of(k)
        self._set_target(
            window_streams=streams if self.tree is None else min(streams, self.tree.num_streams),
            window_streams_batch=batch_size,
        )
        return k

    def _record_proposed(self, k: Choice, drafts, copies, source: _DraftSource) -> None:
        """Files this step's stream drafts with the policy's estimate and says under which
        choice its time counts: under a tree only if it verified trees, under a chain only
        if its drafts came from where that choice runs its streams, as many (a window chain
        right after a forward without window streams drafts from the anchors: not timed); a
        step verifying copied drafts only, with no stream pass, as such (its cost prices the
        next copies), one mixing sources not at all."""
        trees = self.reader.tree_rows
        other = trees | set(copies)
        self.policy.stats.record_proposed(
            [[] if r in other else d for r, d in enumerate(drafts)] if other else drafts
        )
        if isinstance(k, TreeChoice) and not trees:
            k = min(k.nodes, self.tree.num_streams)
        timed_as = k
        if isinstance(k, AnchoredChain):
            timed_as = k if source.from_anchors else None
        elif source.window and isinstance(k, int) and k != 0 and source.drafts_short_of(k):
            timed_as = None
        if copies:
            copies_only = self.target.window_streams == 0 and all(
                not d or r in copies for r, d in enumerate(drafts)
            )
            timed_as = CopyStep(self.k) if copies_only else None
        if not any(drafts):  # a plain step, unless streams ran for drafts not made
            timed_as = 0 if k == 0 else None
        self.step_timer.proposed(timed_as)

    def _set_target(self, **values) -> None:
        """Sets the model's attributes that changed (an ``nn.Module``'s setattr is slow)."""
        target = self.target
        for name, value in values.items():
            if getattr(target, name, None) != value:
                setattr(target, name, value)

    def streams_yield(self, batch_size: int, k: Choice) -> float:
        """Tokens per plain step's cost the policy expects of stream drafts ``k``."""
        return self.policy.speedup(batch_size, k)

    def copy_step_cost(self, batch_size: int) -> float:
        """A step verifying copied drafts only, over a plain step: as timed in this engine
        (verify rows, no stream pass), 1.0 before it has enough such steps."""
        if self.policy is None:
            return 1.0
        return self.policy.costs.ratio(batch_size, CopyStep(self.k))

    def copy_step_timed(self, batch_size: int) -> bool:
        """Whether this engine has timed enough copy-only and plain steps at this batch
        size to price the former."""
        return self.policy is not None and self.policy.costs.timed(batch_size, CopyStep(self.k))

    def _copy_choice(self, k, req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu):
        """Rows that draft a copy this step, with their drafts: per row the better scoring of
        its prompt-lookup and suffix-tree drafts (a score is the draft's expected accepted
        tokens), where it reaches the threshold. A copy step yields ``1 + score`` tokens at
        the cost such steps are timed at (no stream pass; a plain step's until timed), a
        stream step the policy's expected tokens at its step cost; the copy is taken where it
        yields as much per cost.
        Where the streams do not pay (``k`` 0), copies of up to ``num_speculative_tokens``
        are weighed against a plain step: taken where ``1 + score`` tokens at a copy step's
        timed cost beat one token at a plain step's; before such steps are timed at this
        batch size (or with the user's schedule, which prices no step), where they score at
        least 1. Field ``suffix_drafts`` as a number is the suffix drafts' fixed threshold."""
        n = len(sampled_token_ids)
        # Where the streams do not pay, copies alone (no stream pass), up to
        # num_speculative_tokens; else as long as the streams' (the verify rows priced).
        length = self.k if k == 0 else rows_of(k)
        if self.policy is None or (k == 0 and not self.copy_step_timed(n)):
            # The user's schedule prices no step; where the streams do not pay, an untimed
            # copy step's verify rows are not taken as free (with 4 drafts per request
            # they cost ~2 plain steps at batch 16 on AVX2): one token expected kept pays
            # for them until such steps are timed.
            min_score = SCHEDULED_MIN_SCORE
        else:
            # Tokens per plain step's cost of the step a copy would replace: the streams',
            # or a plain step's one token where they do not pay.
            rival = self.streams_yield(n, k) if k != 0 else 1.0
            min_score = max(rival * self.copy_step_cost(n) - 1.0, 0.0)
        return self.copies.choose(
            req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, length, min_score
        )


def _copied_drafts(vllm_config, settings) -> CopiedDrafts:
    """The engine's copied drafts (prompt lookup, suffix trees), as its settings ask; the
    runner patch that hands over request ids where either drafts."""
    max_model_len = int(vllm_config.model_config.max_model_len)
    k = settings.num_speculative_tokens
    suffix = None
    if settings.suffix_drafts is not None:
        suffix = SuffixDrafts(SuffixSettings.of(vllm_config.speculative_config), max_model_len)
        logger.info(
            "specstream drafts from suffix trees (prompt, output, earlier outputs) where "
            "their draft scores at least %s, from the streams elsewhere (%s)",
            "the streams' expected tokens per step cost, less one"
            if math.isnan(settings.suffix_drafts)
            else f"{settings.suffix_drafts:g}",
            "the checkpoint's specstream.suffix_drafts; "
            f"{field_hint('suffix_drafts', 'off')} turns them off"
            if settings.suffix_from_checkpoint
            else "field suffix_drafts",
        )
    elif settings.suffix_skipped:
        logger.warning("%s", settings.suffix_skipped)
    lookup = PromptLookup(k, max_model_len) if settings.prompt_lookup and k else None
    copies = CopiedDrafts(lookup, suffix, settings.suffix_drafts)
    if copies.active:
        _hand_runner_to_proposer()
    return copies


def _schedule(vllm_config, settings) -> list[int] | None:
    """Drafts per request by batch size of the user's
    ``num_speculative_tokens_per_batch_size`` (None: unset, the adaptive policy drafts)."""
    if not settings.schedule:
        return None
    from vllm_specstream.patches.vllm_schedule import schedule_lookup

    max_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", 0)
    user = list(settings.schedule)
    logger.info("specstream drafts per request by batch size (first, last, k): %s", user)
    return schedule_lookup(user, max(int(max_seqs or 0), 1), settings.num_speculative_tokens)
