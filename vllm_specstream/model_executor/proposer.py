"""``SpecStreamProposer``: vLLM's ``custom_class`` proposer that hands out the stream drafts.

The drafts were computed inside the target's own forward (:mod:`model_executor.specstream`);
the proposer only picks, per request, the row of the last accepted token and returns its
stream tokens, clipped to ``num_speculative_tokens``. A request takes a copied draft instead
where it yields as many tokens per step cost: prompt lookup's
(:mod:`vllm_specstream.model_executor.prompt_lookup`, field ``prompt_lookup``, on by default)
or the suffix trees' (:mod:`vllm_specstream.speculation.suffix_drafts`, field
``suffix_drafts``). It keeps no per-row state: rows of vLLM's input batch move between steps
(copied drafts are followed by request id). It takes the model's stash (clearing it) and uses
it only if it is this step's (:mod:`vllm_specstream.model_executor.stash`); steps that
draft nothing are watched (:mod:`vllm_specstream.speculation.draft_watch`).
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.logger import init_logger
from vllm_specstream.model_executor.heap import HeapTrim
from vllm_specstream.model_executor.prompt_lookup import PromptLookup
from vllm_specstream.model_executor.stash import anchor_token_problem, stash_problem
from vllm_specstream.model_executor.trees.step import WORKER_TREES, tree_problem
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
    suffix_rows,
)
from vllm_specstream.streams.draft_trees import fill_tree

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


def last_accepted_index(query_start: int, first_position: int, num_tokens_no_spec: int) -> int:
    """Flat index, in the last forward, of a request's last accepted token.

    After rejection sampling and bookkeeping, the request holds ``num_tokens_no_spec``
    tokens and the newest one (just sampled) is not in the cache yet; so the last accepted
    token sits at position ``num_tokens_no_spec - 2``, i.e. ``that - first_position`` tokens
    after the first scheduled token of the request.
    """
    return query_start + (num_tokens_no_spec - 2 - first_position)


def anchor_rows(
    sampled_token_ids: list[list[int]],
    num_tokens_no_spec: np.ndarray,
    query_start_loc: list[int],
    first_positions: list[int],
) -> tuple[list[int], list[int]]:
    """Rows that sampled something and the flat index, in the last forward, of each one's
    last accepted token (rows that sampled nothing, e.g. a partial prefill chunk, and
    indices outside the row's scheduled tokens are left out)."""
    rows: list[int] = []
    indices: list[int] = []
    for i, sampled in enumerate(sampled_token_ids):
        if not sampled or i + 1 >= len(query_start_loc):
            continue
        idx = last_accepted_index(
            query_start_loc[i], first_positions[i], int(num_tokens_no_spec[i])
        )
        if query_start_loc[i] <= idx < query_start_loc[i + 1]:
            rows.append(i)
            indices.append(idx)
    return rows, indices


def select_drafts(
    sampled_token_ids: list[list[int]],
    num_tokens_no_spec: np.ndarray,
    query_start_loc: list[int],
    first_positions: list[int],
    draft_table,
    k: int,
) -> list[list[int]]:
    """Per request row: the stream drafts at its last accepted token (``[]`` for rows that
    sampled nothing, e.g. a partial prefill chunk, or whose anchor has no drafts)."""
    rows, indices = anchor_rows(
        sampled_token_ids, num_tokens_no_spec, query_start_loc, first_positions
    )
    return drafts_at(len(sampled_token_ids), rows, indices, draft_table, k)


def drafts_at(
    num_rows: int, rows: list[int], indices: list[int], draft_table, k: int
) -> list[list[int]]:
    """``draft_table[indices[i]][:k]`` up to its first -1 (no draft from that stream on) for
    row ``rows[i]``, ``[]`` for the other rows."""
    drafts: list[list[int]] = [[] for _ in range(num_rows)]
    for i, idx in zip(rows, indices):
        row = [int(t) for t in draft_table[idx][:k]]
        drafts[i] = row[: next((j for j, t in enumerate(row) if t < 0), len(row))]
    return drafts


def tree_anchor_indices(rows: list[int], indices: list[int], query_start_loc: list[int], step):
    """``indices`` with each tree row's anchor at its deepest accepted node (the sampler's
    ``anchor_offsets``: off the chain layout :func:`anchor_rows` assumes)."""
    if step is None or not step.anchor_offsets:
        return indices
    offsets = step.anchor_offsets
    return [query_start_loc[r] + offsets[r] if r in offsets else i for r, i in zip(rows, indices)]


class SpecStreamProposer:
    """Speculative streaming drafts for vLLM's ``custom_class`` speculative method.

    Where the model runs the streams (the placement) is the engine's field ``placement``
    (:mod:`vllm_specstream.speculation.settings`; unset: the model's default). The draft
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
        #: Where the model runs the streams (None: the model's default,
        #: :meth:`SpecStreamMixin.default_placement`).
        self.placement = options.placement
        self.k = options.num_speculative_tokens
        parallel = getattr(vllm_config, "parallel_config", None)
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        user = options.schedule
        self.policy: DraftPolicy | None = None
        self.lookup: list[int] | None = None
        if user:
            from vllm_specstream.patches.vllm_schedule import schedule_lookup

            max_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", 0)
            self.lookup = schedule_lookup(list(user), max(int(max_seqs or 0), 1), self.k)
            logger.info("specstream drafts per request by batch size (first, last, k): %s", user)
        else:
            # Ranks under tensor parallelism must choose alike: their clocks differ.
            self.policy = DraftPolicy(self.k, StepCosts(measure=self.tp_size == 1))
            self.step_timer = StepTimer()
        self.target = None
        #: Stashes refused as not this step's (each one: a step without drafts).
        self.refused_stashes = 0
        self.calls = 0
        self.watch = NoDraftWatch()
        #: The model's draft tree (None: chains); set in ``load_model``.
        self.tree = None
        #: Why requests drafted chains in a tree engine, each said once.
        self._chain_reasons: set[str] = set()
        #: Whether the first anchored chain (window engine) was said.
        self._said_anchored = False
        #: Batch rows that got a tree in this call (the chain estimate leaves them out).
        self._tree_rows: set[int] = set()
        #: The tree those rows got (its estimate takes their accepted paths next call).
        self._filed_tree: TreeChoice | None = None
        #: Suffix trees beside the streams (None: the streams draft alone).
        self.suffix: SuffixDrafts | None = None
        self.suffix_min_score = options.suffix_drafts
        if options.suffix_drafts is not None:
            self.suffix = SuffixDrafts(
                SuffixSettings.of(vllm_config.speculative_config),
                int(vllm_config.model_config.max_model_len),
            )
            _hand_runner_to_proposer()
            logger.info(
                "specstream drafts from suffix trees (prompt, output, earlier outputs) where "
                "their draft scores at least %s, from the streams elsewhere (%s)",
                "the streams' expected tokens per step cost, less one"
                if math.isnan(options.suffix_drafts)
                else f"{options.suffix_drafts:g}",
                "the checkpoint's specstream.suffix_drafts; "
                f"{field_hint('suffix_drafts', 'off')} turns them off"
                if options.suffix_from_checkpoint
                else "field suffix_drafts",
            )
        elif options.suffix_skipped:
            logger.warning("%s", options.suffix_skipped)
        #: Prompt-lookup drafts beside the streams (None: off).
        self.prompt_lookup: PromptLookup | None = None
        if options.prompt_lookup and self.k:
            self.prompt_lookup = PromptLookup(self.k, int(vllm_config.model_config.max_model_len))
            _hand_runner_to_proposer()
        #: The model runner (its input batch's request ids follow copied drafts and key the
        #: suffix trees): :mod:`vllm_specstream.patches.proposer_runner`.
        self._runner = None
        #: Requests whose last drafts were copied: the matched n-gram length of a lookup, 0
        #: for the suffix trees' (left out of the streams' acceptance estimate when verified).
        self._copied: dict[str, int] = {}
        #: Requests' drafts taken from the suffix trees, and from prompt lookup.
        self.suffix_drafted = 0
        self.lookup_drafted = 0
        #: Hands the heap that speculative steps fragment back to the OS now and then.
        self.heap = HeapTrim()

    def bind_runner(self, runner) -> None:
        self._runner = weakref.ref(runner)

    def load_model(self, target_model) -> None:
        # Stored as `target`, not `model`: vLLM probes `drafter.model` in some paths.
        if not hasattr(target_model, "spec_config") or not hasattr(target_model, "stash"):
            raise ConfigError(
                f"the specstream proposer needs a SpecStreamForCausalLM checkpoint, got "
                f"{type(target_model).__name__}; export one with `specstream export`"
            )
        target_model.set_placement(self.placement or target_model.default_placement())
        # What the model runs, not what was asked: draft trees run `accepted` whatever the
        # option says.
        placement = target_model.placement
        self.target = target_model
        self.tree = getattr(target_model, "tree", None)
        if placement == "window" and self.tree is None:
            target_model.window_streams_at = self.window_streams_at
            if self.policy is not None:  # each chain also with its streams at the anchors
                self.policy.anchored = True
        if self.tree is not None and self.policy is not None:
            # Chains of up to num_streams drafts, or a tree: a prefix of the template of
            # one of a few widths, pruned or not where the model prunes.
            chain = min(self.k, self.tree.num_streams)
            prunes = getattr(target_model, "prune_threshold", 0.0) > 0
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
        self._tree_rows = set()
        req_ids = self._batch_req_ids(sampled_token_ids, token_ids_cpu)
        copied = {r: self._copied[q] for r, q in enumerate(req_ids) if q in self._copied}
        if self.prompt_lookup is not None and copied:
            self.prompt_lookup.verified(copied, sampled_token_ids)
        if self.policy is not None:
            chain_sampled = self._record_tree_rows(sampled_token_ids)
            if copied:
                # Verified copies say nothing of the streams' acceptance.
                chain_sampled = [[] if r in copied else s for r, s in enumerate(chain_sampled)]
            self._filed_tree = None
            self.policy.stats.record_verified(chain_sampled)
            self.step_timer.record(
                self.policy.costs, sampled_token_ids, num_tokens_no_spec, token_ids_cpu
            )
        # This step's drafts come from the streams the last forward ran at its window, or
        # (it kept its MSA input instead) from streams run now at the anchors.
        from_anchors = stash is not None and stash.msa_input is not None
        window_ran = self.target.window_streams
        window = self.target.placement == "window" and self.tree is None
        k = self.draft_length(len(sampled_token_ids))
        self.calls += 1
        if self.policy is not None and self.calls % SUMMARY_EVERY == 0:
            logger.debug("specstream policy: %s", self.policy.summary(len(sampled_token_ids)))
        if isinstance(k, AnchoredChain) and not self._said_anchored:
            self._said_anchored = True
            logger.info(
                "specstream runs the streams at the requests' anchors at batch %d: "
                "cheaper there than at every window position",
                len(sampled_token_ids),
            )
        # The next forward's window streams (if placed there; none for anchored drafts).
        streams = 0 if isinstance(k, AnchoredChain) else rows_of(k)
        self._set_target(
            window_streams=streams if self.tree is None else min(streams, self.tree.num_streams),
            window_streams_batch=len(sampled_token_ids),
        )
        copies = (
            self._copy_choice(k, req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
            if req_ids
            else {}
        )
        if k == 0:
            drafts = [[] for _ in sampled_token_ids]
        else:
            drafts, why_none = self._drafts(
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
            trees = self._tree_rows
            other = trees | set(copies)
            self.policy.stats.record_proposed(
                [[] if r in other else d for r, d in enumerate(drafts)] if other else drafts
            )
            # A step's time is filed under a tree only if it verified trees, under a chain
            # only if its drafts came from where that choice runs its streams, as many (a
            # window chain right after a forward without window streams drafts from the
            # anchors: not timed).
            if isinstance(k, TreeChoice) and not trees:
                k = min(k.nodes, self.tree.num_streams)
            timed_as = k
            if isinstance(k, AnchoredChain):
                timed_as = k if from_anchors else None
            elif window and isinstance(k, int) and k != 0 and (from_anchors or window_ran < k):
                timed_as = None
            if copies:
                # A step verifying copied drafts only, with no stream pass, is timed as such
                # (its cost prices the next copies); one mixing sources is not timed.
                copies_only = self.target.window_streams == 0 and all(
                    not d or r in copies for r, d in enumerate(drafts)
                )
                timed_as = CopyStep(self.k) if copies_only else None
            if not any(drafts):  # a plain step, unless streams ran for drafts not made
                timed_as = 0 if k == 0 else None
            self.step_timer.proposed(timed_as)
        return drafts

    def _set_target(self, **values) -> None:
        """Sets the model's attributes that changed (an ``nn.Module``'s setattr is slow)."""
        target = self.target
        for name, value in values.items():
            if getattr(target, name, None) != value:
                setattr(target, name, value)

    def _batch_req_ids(self, sampled_token_ids, token_ids_cpu) -> list[str]:
        """The batch's request ids ([] without copied drafts); the suffix trees grow by this
        step's sampled tokens."""
        if self.suffix is None and self.prompt_lookup is None:
            return []
        runner = self._runner() if self._runner is not None else None
        if runner is None:
            self.suffix = self.prompt_lookup = None
            logger.warning(
                "specstream: the model runner was not handed to the proposer (patch "
                "proposer-runner not applied in this process), so the streams draft alone"
            )
            return []
        batch = runner.input_batch
        n = len(sampled_token_ids)
        req_ids = list(batch.req_ids[:n])
        if self.suffix is not None:
            self.suffix.update(
                req_ids, batch.num_prompt_tokens[:n], token_ids_cpu, sampled_token_ids
            )
        return req_ids

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
        rows = [r for r, sampled in enumerate(sampled_token_ids) if sampled]
        chosen: dict[int, list[int]] = {}
        copied: dict[str, int] = {}
        lookups = {}
        if self.prompt_lookup is not None:
            lookups = self.prompt_lookup.drafts(
                token_ids_cpu, num_tokens_no_spec, rows, length, min_score
            )
            for r, d in lookups.items():
                if d.tokens and d.score >= min_score:
                    chosen[r], copied[req_ids[r]] = d.tokens, d.ngram
        if self.suffix is not None:
            fixed = self.suffix_min_score
            suffix_min = min_score if math.isnan(fixed) else fixed
            drafts = {
                r: self.suffix.draft(
                    req_ids[r], token_ids_cpu[r], int(num_tokens_no_spec[r]), length
                )
                for r in rows
            }
            for r, tokens in suffix_rows(drafts, suffix_min).items():
                if r not in chosen or drafts[r].score > lookups[r].score:
                    chosen[r], copied[req_ids[r]] = tokens, 0
            taken = sum(1 for q in copied.values() if q == 0)
            if taken and not self.suffix_drafted:
                logger.info("specstream drafts from the suffix trees (first at batch %d)", n)
            self.suffix_drafted += taken
        if self.prompt_lookup is not None:
            taken = [r for r in chosen if copied[req_ids[r]] > 0]
            self.prompt_lookup.proposed(lookups, taken, n)
        lookup_taken = sum(1 for q in copied.values() if q > 0)
        if lookup_taken and not self.lookup_drafted:
            logger.info("specstream drafts by prompt lookup (first at batch %d)", n)
        self.lookup_drafted += lookup_taken
        self._copied = copied
        return chosen

    def _record_tree_rows(self, sampled_token_ids):
        """Files the path lengths of the step's tree rows with the policy's tree estimate;
        returns ``sampled_token_ids`` with those rows empty (for the chain estimate)."""
        step = WORKER_TREES.step if self.tree is not None else None
        rows = {t.row for t in step.rows if t.row < len(sampled_token_ids)} if step else set()
        if not rows:
            return sampled_token_ids
        stats = self.policy.tree_stats.get(self._filed_tree)
        if stats is not None:
            stats.record([max(len(sampled_token_ids[r]) - 1, 0) for r in rows])
        return [[] if r in rows else s for r, s in enumerate(sampled_token_ids)]

    def _drafts(self, stash, k, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, skip=()):
        """This step's drafts from ``stash`` (none for the rows in ``skip``: they draft a
        copy), and why there are none when there are none."""
        no_drafts = [[] for _ in sampled_token_ids]
        if stash is None:
            return no_drafts, self.target.no_stash_reason
        problem = stash_problem(stash, self.target.forward_step, len(sampled_token_ids))
        rows: list[int] = []
        indices: list[int] = []
        if problem is None:
            batch = stash.batch
            qsl = batch.query_start_loc.tolist()
            first_positions = batch.positions[batch.query_start_loc[:-1]].tolist()
            rows, indices = anchor_rows(sampled_token_ids, num_tokens_no_spec, qsl, first_positions)
            if self.tree is not None:
                indices = tree_anchor_indices(rows, indices, qsl, WORKER_TREES.step)
            problem = anchor_token_problem(
                stash.input_ids, token_ids_cpu, num_tokens_no_spec, rows, indices
            )
        if problem is not None:
            self.refused_stashes += 1
            if self.refused_stashes == 1:
                logger.warning(
                    "specstream refused the model's stream stash: not this step's (%s); "
                    "this step drafts nothing (further refusals are counted, not logged)",
                    problem,
                )
            return no_drafts, (
                f"the model's stream stash was not this step's ({problem}; "
                f"{self.refused_stashes} refused)"
            )
        if not rows:
            return no_drafts, "no request's last accepted token was in the last forward"
        if skip:
            kept = [(r, i) for r, i in zip(rows, indices) if r not in skip]
            if not kept:
                return no_drafts, "every request drafted a copy"
            rows, indices = [r for r, _ in kept], [i for _, i in kept]
        if self.tree is not None:
            return self._tree_drafts(stash, k, rows, indices, len(sampled_token_ids))
        k = rows_of(k)
        # Placement "accepted", or a window forward that ran no streams (the step before
        # drafted nothing or anchored drafts): the streams run now, at the anchors; window
        # streams still waiting for the LM head go through it at the anchors only.
        table = self.target.draft_at(stash, rows, indices, k)
        drafts = drafts_at(len(sampled_token_ids), rows, indices, table, k)
        why_none = "the streams left no draft at any request's anchor"
        min_prob = getattr(self.target, "draft_min_prob", 0.0)
        if min_prob > 0:
            why_none += f" (the confidence rule cut them all: draft_min_prob={min_prob:g})"
        return drafts, why_none

    def _tree_drafts(self, stash, k, rows, indices, num_rows):
        """Drafts of a tree engine: a request's last accepted token is the deepest accepted
        node of its tree, wherever the tree put it; eligible requests get a tree when the
        policy chose one (``k``, a :class:`TreeChoice`; with a fixed schedule, ``k`` beyond
        ``num_streams``: the first ``k`` nodes of the tree, pruned where the model prunes),
        the others a chain.
        The trees are filed for the next step's verification, and the model told whether to
        prune them."""
        self.target.draft_at(stash, rows, indices, 0)
        chains = drafts_at(
            num_rows, rows, indices, stash.draft_table, min(rows_of(k), self.tree.num_streams)
        )
        runner = WORKER_TREES.runner()
        req_ids = list(runner.input_batch.req_ids[:num_rows]) if runner is not None else []
        parents: list[tuple[int, ...] | None] = [None] * num_rows
        if self.policy is not None:
            choice = k if isinstance(k, TreeChoice) else None
        else:
            nodes = min(k, self.tree.num_nodes)
            choice = TreeChoice(nodes, prune=True) if k > self.tree.num_streams else None
        eligible = choice is not None and len(req_ids) == num_rows
        for r, idx in zip(rows, indices) if eligible else ():
            why = tree_problem(runner.requests[req_ids[r]].sampling_params)
            if why is not None:
                if why not in self._chain_reasons:
                    self._chain_reasons.add(why)
                    logger.info("specstream drafts chains for requests with %s", why)
                continue
            chains[r] = fill_tree(self.tree, stash.draft_topk[idx])[: choice.nodes].tolist()
            parents[r] = self.tree.parents[: choice.nodes]
            self._tree_rows.add(r)
        WORKER_TREES.book.file(req_ids, chains, parents)
        self._filed_tree = choice if self._tree_rows else None
        self.target.prune_trees = choice is not None and choice.prune
        return chains, "the streams left no draft at any request's anchor"
