"""``StreamPass``: the streams of one engine's model, step by step, as the proposer sees them.

Each forward with speculation on begins a step (:meth:`StreamPass.begin_step`); the decoder
returns the residual stream entering the first MSA layer, and :meth:`StreamPass.after_main`
leaves this step's :class:`~vllm_specstream.model_executor.stash.StreamStash`: the drafts of a
window pass, or the MSA input for the proposer to draft from at its anchors
(:meth:`StreamPass.draft_at`). Where the streams run is the *placement*, decided once
(:func:`choose_placement`):

* ``"window"`` (the paper's parallel design): inside the forward, for every position of each
  request's scheduled window ``[root, d1..dk]`` (and the last token of a completed prefill);
  the proposer then picks the row of the last accepted token. Where the decoder runs eagerly
  the stream rows ride along its matmuls (:mod:`.fused_streams`).
* ``"accepted"``: the forward only keeps the residual stream; after rejection sampling the
  proposer asks for the streams at each request's last accepted position: ``k + 1`` times
  fewer stream rows, one more pass over the top layers.

The streams' LM head and the drafts it writes: :mod:`.stream_head`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_specstream.logger import init_logger
from vllm_specstream.model_executor.forward_batch import ForwardBatch, no_forward_batch_reason
from vllm_specstream.model_executor.fused_streams import FusedStreams
from vllm_specstream.model_executor.stash import StreamStash
from vllm_specstream.model_executor.stream_forward import (
    StreamRunner,
    accepted_anchors,
    last_window_anchors,
)
from vllm_specstream.model_executor.stream_head import StreamHead

logger = init_logger(__name__)


def choose_placement(requested: str | None, eager: bool, trees: bool) -> tuple[str, str]:
    """Where an engine runs its streams, and why: draft trees at the accepted node (window
    rows inside a tree would read keys/values of rejected siblings); else field
    ``placement``; else ``window`` where the decoder runs eagerly (the stream rows ride
    along the main forward: the cheaper at batch 1 on every CPU class measured,
    ``docs/benchmarks.md``), ``accepted`` where it is compiled (a second pass over more
    stream rows)."""
    if trees:
        return "accepted", "draft trees run the streams at the accepted node"
    if requested is not None:
        return requested, "field placement"
    kind = "eager" if eager else "compiled"
    return ("window" if eager else "accepted"), f"the default for {kind} decoders"


class StreamPass:
    """The streams of one model: where they run, this step's stash and the drafts in it.

    ``model`` is the SpecStream model (its decoder layers, norm, LM head and stream
    parameters), ``tree`` the engine's draft-tree template (None: chains) and
    ``prune_threshold`` its pruning threshold (0: off)."""

    def __init__(
        self,
        model,
        *,
        num_speculative_tokens: int,
        placement: str | None,
        eager: bool,
        compiled: bool,
        head: StreamHead,
        layer_name: str,
        tree=None,
        prune_threshold: float = 0.0,
    ):
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.num_streams = model.spec_config.num_streams
        self.head = head
        self.tree = tree
        self.prune_threshold = prune_threshold
        #: Whether the next forward prunes its trees (the proposer's per-step choice).
        self.prune_trees = True
        self.placement, why = choose_placement(placement, eager, tree is not None)
        if tree is not None:
            logger.info("specstream %s", why)
        elif placement is None:
            logger.info("specstream stream placement: %s (%s)", self.placement, why)
        self._eager = eager
        self._compiled = compiled
        self.layer_name = layer_name
        self._runner: StreamRunner | None = None
        self._fused: FusedStreams | None = None
        #: The pending stash of the last forward (taken, i.e. cleared, by the proposer) and
        #: why the last forward left none; ``last_stash`` stays for inspection only.
        self.stash: StreamStash | None = None
        self.last_stash: StreamStash | None = None
        self.no_stash_reason: str | None = None
        #: Counts forwards with speculation on; tags each stash (see ``stash.py``).
        self.forward_step = 0
        #: Streams the window placement runs (the proposer's last draft length: stream ``j``
        #: sees streams ``<= j`` only, so fewer streams give the same first drafts).
        self.window_streams = self.num_streams
        #: Requests of the step whose proposer call set ``window_streams``, and the
        #: proposer's streams for a forward of more requests (requests joined: their
        #: prefills ride along); None keeps ``window_streams`` (:meth:`_streams_for`).
        self.window_streams_batch = 0
        self.window_streams_at: Callable[[int], int] | None = None
        #: ``(stash, anchors, stream states [R, A, G, h])`` waiting for the main logits
        #: (fused pass).
        self._pending: tuple | None = None

    @property
    def draft_min_prob(self) -> float:
        """The confidence rule's threshold (field ``draft_min_prob``; 0: off)."""
        return self.head.draft_min_prob

    def runner(self) -> StreamRunner:
        """The stream pass over the model's MSA layers (built at first use: after the
        weights are loaded)."""
        if self._runner is None:
            self._runner = StreamRunner(
                self.model,
                self.model.specstream,
                self.model.spec_config,
                self.head.weights,
                compiled=self._compiled,
            )
            self.head.runner = self._runner
        return self._runner

    def prepare(self) -> None:
        """Once the model is loaded and final (the proposer's ``load_model``): the fused
        window pass where the decoder runs eagerly, the compiled stream pass where vLLM
        compiles it (here, with vLLM's own compilation, not at the first request)."""
        if self.placement == "window" and self._eager and self._fused is None:
            self._fused = FusedStreams(self.runner())
            logger.info("specstream window placement: stream rows ride along the main forward")
        if not self._eager:
            seconds = self.runner().compile()
            if seconds:
                logger.info(
                    "specstream compiled the stream pass in %.1f s (graphs shared by its %d "
                    "layers, for every batch and stream count)",
                    seconds,
                    self.model.spec_config.num_msa_layers,
                )

    def begin_step(self, batch: ForwardBatch | None) -> bool:
        """A new forward: whatever an earlier one left is stale from here on. Returns whether
        a fused window pass runs inside it."""
        self.forward_step += 1
        self.stash = None
        self.no_stash_reason = "the forward ended before the stream pass"
        self._pending = None
        if batch is not None:
            self._streams_for(batch)
        if batch is None or self._fused is None:
            return False
        if self.placement != "window" or self.window_streams <= 0:
            return False
        anchors = last_window_anchors(batch, self.num_speculative_tokens + 1)
        anchors = self._fused.runner.anchors_with_streams(batch, anchors)
        self._fused.begin(batch, anchors, self.window_streams)
        return self._fused.active is not None

    def finish_fused(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused window pass's anchors and stream states (None: none ran)."""
        return self._fused.finish()

    def _streams_for(self, batch: ForwardBatch) -> None:
        """The window streams of this forward when requests joined since the proposer chose
        them: as many as it would choose for this many requests (a batch the policy does not
        draft for would pay the streams at every joining prompt for nothing). A forward
        without them keeps its MSA input, so drafts can still come from the anchors."""
        rule, n = self.window_streams_at, batch.num_reqs
        if rule is not None and self.window_streams > 0 and n > self.window_streams_batch:
            self.window_streams = min(self.window_streams, rule(n))

    def after_main(
        self,
        msa_input: torch.Tensor,
        positions: torch.Tensor,
        input_ids,
        batch: ForwardBatch | None,
        streams: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """The stash of this forward (``batch``: its requests; ``streams``: the fused
        pass's anchors and stream states, if it ran)."""
        if batch is None:
            self.no_stash_reason = (
                f"the stream pass found no forward batch for layer {self.layer_name}: "
                f"{no_forward_batch_reason(self.layer_name)}"
            )
            return
        table = torch.full((positions.shape[0], self.num_streams), -1, dtype=torch.long)
        ids = input_ids[: positions.shape[0]].clone() if input_ids is not None else None
        stash = StreamStash(self.forward_step, batch, ids, table)
        if self.tree is not None:
            stash.draft_topk = torch.full((*table.shape, max(self.tree.top_k)), -1)
        self.stash = self.last_stash = stash
        self.no_stash_reason = None
        if streams is not None:  # fused: the LM head runs with the main rows
            self._pending = (stash, *streams)
        elif self.placement == "window" and self.window_streams > 0:
            anchors = last_window_anchors(batch, self.num_speculative_tokens + 1)
            self._run_streams(stash, msa_input, anchors, self.window_streams)
        else:
            stash.msa_input = msa_input

    def take_stash(self) -> StreamStash | None:
        """The last forward's stash, cleared here so that no later step can read it."""
        stash, self.stash = self.stash, None
        if stash is None and self.no_stash_reason is None:
            self.no_stash_reason = "no forward ran since the last proposal"
        return stash

    def draft_at(
        self, stash: StreamStash, rows: list[int], indices: list[int], num_streams: int = 0
    ) -> torch.Tensor:
        """``stash``'s draft table with the drafts at flat token ``indices[i]`` of request
        row ``rows[i]`` of the forward that made it: placement ``"accepted"`` (or a forward
        that kept its MSA input) runs the first ``num_streams`` streams (0: all) there first;
        pending window streams there go through the LM head. Every tensor-parallel rank must
        call it with the same arguments (the layers all-reduce, the LM head gathers)."""
        if stash.msa_input is not None:
            anchors = accepted_anchors(stash.batch, rows, indices)
            self._run_streams(stash, stash.msa_input, anchors, num_streams)
            stash.msa_input = None
        self.head.project(stash, indices)
        return stash.draft_table

    def _run_streams(
        self, stash: StreamStash, msa_input: torch.Tensor, anchors: torch.Tensor, num_streams: int
    ) -> None:
        """The final states of the first ``num_streams`` streams (0: all) at ``anchors``
        (``[R, A]``), pending in ``stash`` until the LM head projects them."""
        anchors = self.runner().anchors_with_streams(stash.batch, anchors)
        if not bool((anchors >= 0).any()):
            return  # e.g. a step of partial prefills only: no request drafts
        hidden = self.runner()(msa_input, stash.batch, anchors, num_streams)
        stash.stream_states = (anchors, hidden)

    def logits(self, hidden_states: torch.Tensor, main_logits: Callable):
        """The main rows' logits (``main_logits``: vLLM's); after a fused window pass its
        stream rows' drafts go into the stash (:meth:`StreamHead.fused_logits`)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return main_logits(hidden_states)
        return self.head.fused_logits(hidden_states, main_logits, *pending)
