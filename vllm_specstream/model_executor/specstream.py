"""``SpecStreamForCausalLM``: a merged specstream checkpoint as a vLLM model.

The main stream is the base architecture's vLLM model, unchanged: same modules, same
paged attention, same outputs (served without speculation it is exactly the fine-tuned
model). On top, the model asks the decoder for the residual stream entering layer
``L0 = N - num_msa_layers`` (vLLM's aux-hidden-state hook) and, when speculative decoding
is on, runs the streams and stashes their top-1 tokens for
:class:`vllm_specstream.model_executor.proposer.SpecStreamProposer`. Where the streams run is the
*placement*, chosen by the proposer:

* ``"window"`` (the paper's parallel design): inside the forward, for every position of each
  request's scheduled window ``[root, d1..dk]`` (and the last token of a completed prefill);
  the proposer then picks the row of the last accepted token.
* ``"accepted"``: the forward only keeps the residual stream; after rejection sampling the
  proposer asks for the streams at each request's last accepted position (``draft_at``):
  ``k + 1`` times fewer stream rows, one more pass over the top layers.

``SpecStreamForCausalLM`` (the registered architecture of every merged checkpoint) builds
the class of the checkpoint's base family from :data:`FAMILY_CLASSES`: the :class:`SpecStreamMixin`
over that family's vLLM model (:mod:`vllm_specstream.checkpoint.families` lists them). A new
family is one more entry in both, plus its layer's steps in ``stream_forward`` and
``training/model.py`` where they differ from Llama's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.phi3 import Phi3ForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.platforms import current_platform

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.checkpoint.draft_vocab import mask_token_ids
from vllm_specstream.checkpoint.merged import (
    adapter_streams_only,
    base_architecture,
    read_specstream_section,
)
from vllm_specstream.logger import init_logger
from vllm_specstream.model_executor.forward_batch import (
    ForwardBatch,
    attention_layer_name,
    attn_metadata_of,
    current_forward_batch,
    no_forward_batch_reason,
)
from vllm_specstream.model_executor.fused_streams import FusedStreams
from vllm_specstream.model_executor.lora.per_adapter_streams import Deployment
from vllm_specstream.model_executor.lora.stream_row_lora import StreamLoRAWeights
from vllm_specstream.model_executor.lora.vllm_lora_layers import base_logits_processor
from vllm_specstream.model_executor.paged_kv import PagedKVLayout, layer_kv_cache
from vllm_specstream.model_executor.pipeline import reserve_aux_slots
from vllm_specstream.model_executor.stash import StreamStash, take_stream_rows
from vllm_specstream.model_executor.stream_forward import (
    StreamParams,
    StreamRunner,
    accepted_anchors,
    last_window_anchors,
)
from vllm_specstream.model_executor.stream_weights import (
    Matmul,
    StreamWeights,
    build_stream_weights,
    draft_head,
)
from vllm_specstream.model_executor.trees.pruning import (
    attention_for_kept_rows,
    kept_tree_step,
    node_keep_probs,
    prune_batch,
    prune_head_probs,
    pruned_metadata,
    scatter_rows,
)
from vllm_specstream.model_executor.trees.step import WORKER_TREES, depth_positions
from vllm_specstream.patches.cpu_env import single_thread_note
from vllm_specstream.speculation.preflight import (
    ADAPTER_STREAMS_NEED_LORA,
    STREAM_LORA_WITH_LORA,
    check_platform,
)
from vllm_specstream.speculation.settings import PLACEMENTS, EngineSettings, draft_tree_of
from vllm_specstream.streams.decode_math import confident_drafts
from vllm_specstream.streams.draft_trees import TreeTemplate, prune_nodes

logger = init_logger(__name__)

#: Window stream rows up to which a fused pass puts them through the LM head with the main
#: rows; beyond, only the rows at the anchors the proposer reads go through it, in a call
#: of their own. The call of their own reads the whole head again (one core, AVX2, fp32,
#: 49k-token head: +7.8 ms for 1 row); riding along costs per row (+5.3 ms for 6 rows,
#: +14.3 for 20, +60.2 for 80: docs/benchmarks.md, "The streams' LM head").
FUSED_STREAM_LOGITS_ROWS = 16


class SpecStreamMixin:
    """Speculative streams over a vLLM causal-LM class (mixed in before it)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hf_config = vllm_config.model_config.hf_config
        self.spec_config = read_specstream_section(hf_config)
        #: False for a base model served for specstream LoRA adapters: its requests draft
        #: with their adapter's streams only (:mod:`.lora.per_adapter_streams`).
        self.own_streams = not adapter_streams_only(hf_config)
        self.specstream = StreamParams(
            self.spec_config, hf_config.hidden_size, self.own_streams, hf_config
        )
        #: The engine's settings, resolved where vLLM built its config.
        self.settings = EngineSettings.of(vllm_config)
        self.num_speculative_tokens = self.settings.num_speculative_tokens
        if self.num_speculative_tokens > 0:
            # Also checked in the front-end (preflight); here for engines built without it.
            check_platform(current_platform)
            if current_platform.is_cpu():
                note = single_thread_note(
                    torch.get_num_threads(),
                    os.cpu_count() or 1,  # the worker's own affinity is its binding
                    os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                )
                if note:
                    logger.warning("specstream: %s", note)
        #: The draft tree's template (None: chain drafts).
        self.tree: TreeTemplate | None = None
        if self.settings.trees:
            self.tree = draft_tree_of(self.settings, self.spec_config.num_streams)
            WORKER_TREES.bind_model(self)
            logger.info(
                "specstream verifies draft trees: %d nodes (top-k per stream %s, field tree_top_k)",
                self.tree.num_nodes,
                list(self.tree.top_k),
            )
        elif self.num_speculative_tokens > self.spec_config.num_streams:
            raise ConfigError(
                f"num_speculative_tokens={self.num_speculative_tokens} exceeds the checkpoint's "
                f"num_streams={self.spec_config.num_streams} (config.json: specstream.num_streams)"
            )
        # Also checked in the front-end (preflight).
        if (
            self.spec_config.stream_lora_rank
            and self.num_speculative_tokens
            and vllm_config.lora_config
        ):
            raise ConfigError(STREAM_LORA_WITH_LORA)
        if not self.own_streams and self.num_speculative_tokens and not vllm_config.lora_config:
            raise ConfigError(ADAPTER_STREAMS_NEED_LORA.format(where="config.json"))
        n = hf_config.num_hidden_layers
        self.first_msa_layer = n - self.spec_config.num_msa_layers
        self.prune_layer = self.spec_config.prune_layer(n)
        self._layer_prefix = f"{prefix}.model." if prefix else "model."
        #: Early-exit pruning threshold of draft trees (0: off; :mod:`.trees.pruning`).
        self.prune_threshold = self._prune_threshold() if self.tree is not None else 0.0
        #: Whether the next forward prunes its trees (the proposer's per-step choice).
        self.prune_trees = True
        # vLLM's public EAGLE-3 hook: the decoder then also returns the residual stream
        # entering L0, which the streams start from.
        self.set_aux_hidden_state_layers((self.first_msa_layer,))
        reserve_aux_slots(self)
        self._layer_name = attention_layer_name(self._layer_prefix, n - 1)
        self._runner: StreamRunner | None = None
        self._stream_weights: StreamWeights | None = None
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._model_dtype = vllm_config.model_config.dtype
        self.draft_min_prob = self.settings.draft_min_prob
        if self.draft_min_prob > 0:
            logger.info(
                "specstream drafts stop below cumulative stream probability %g (draft_min_prob)",
                self.draft_min_prob,
            )
        #: The pending stash of the last forward (taken, i.e. cleared, by the proposer) and
        #: why the last forward left none; ``last_stash`` stays for inspection only.
        self.stash: StreamStash | None = None
        self.last_stash: StreamStash | None = None
        self.no_stash_reason: str | None = None
        #: Counts forwards with speculation on; tags each stash (see ``stash.py``).
        self.forward_step = 0
        #: Set by the proposer in ``load_model``.
        self.placement = self.settings.placement or "accepted"
        #: Streams the window placement runs (the proposer's last draft length: stream ``j``
        #: sees streams ``<= j`` only, so fewer streams give the same first drafts).
        self.window_streams = self.spec_config.num_streams
        #: Requests of the step whose proposer call set ``window_streams``, and the
        #: proposer's streams for a forward of more requests (requests joined: their
        #: prefills ride along); None keeps ``window_streams`` (see :meth:`_streams_for`).
        self.window_streams_batch = 0
        self.window_streams_at: Callable[[int], int] | None = None
        #: The window placement's streams ride along the main forward's matmuls
        #: (``fused_streams``) where the decoder runs eagerly (a compiled decoder would
        #: trace the wrappers); else they run in a second pass after it.
        self._eager = vllm_config.model_config.enforce_eager
        self._fused: FusedStreams | None = None
        #: ``(stash, anchors, stream states [R, A, G, h])`` waiting for ``compute_logits``
        #: (fused pass).
        self._pending_streams: tuple | None = None
        #: Window stream rows a fused pass projects with the main rows (more wait for the
        #: proposer: :data:`FUSED_STREAM_LOGITS_ROWS`).
        self.fused_stream_logits_rows = FUSED_STREAM_LOGITS_ROWS
        #: The streams' LM head over the checkpoint's draft vocabulary and the vocabulary's
        #: token ids (column -> token); None: the whole vocabulary.
        self._draft_head: Matmul | None = None
        self._draft_ids: torch.Tensor | None = None

    def _prune_threshold(self) -> float:
        """The tree-pruning threshold of this engine (0: off; resolved with the checkpoint's
        pruning adapter in :func:`~vllm_specstream.speculation.settings.resolve_settings`)."""
        off = self.settings.tree_prune_off
        threshold = self.settings.tree_prune or 0.0
        if threshold > 0 and not current_platform.is_cpu():
            off, threshold = "a non-CPU attention backend", 0.0
        if off:
            logger.warning("specstream tree pruning is off: %s", off)
        if threshold > 0:
            logger.info(
                "specstream prunes draft trees at layer %d below early-exit probability %g "
                "(tree_prune)",
                self.prune_layer,
                threshold,
            )
        return threshold

    def default_placement(self) -> str:
        """``window`` where the decoder runs eagerly (the paper's one-pass design: the stream
        rows ride along the main forward; the cheaper at batch 1 on every CPU class
        measured, ``docs/benchmarks.md``), else ``accepted`` (a compiled decoder would need
        a second pass over more stream rows)."""
        placement = "window" if self._eager else "accepted"
        logger.info(
            "specstream stream placement: %s (the default for %s decoders)",
            placement,
            "eager" if self._eager else "compiled",
        )
        return placement

    def set_placement(self, placement: str) -> None:
        if placement not in PLACEMENTS:
            raise ConfigError(f"stream placement must be one of {PLACEMENTS}, got {placement!r}")
        if self.tree is not None and placement != "accepted":
            # Window rows inside a tree would read keys/values of rejected siblings.
            logger.info("specstream draft trees run the streams at the accepted node")
            placement = "accepted"
        self.placement = placement
        if placement == "window" and self._eager and self._fused is None:
            self._fused = FusedStreams(self._stream_runner())
            logger.info("specstream window placement: stream rows ride along the main forward")
        if not self._eager:
            # Here, with vLLM's own compilation (the model is loaded and final), not at the
            # first request.
            seconds = self._stream_runner().compile()
            if seconds:
                logger.info(
                    "specstream compiled the stream pass in %.1f s (graphs shared by its %d "
                    "layers, for every batch and stream count)",
                    seconds,
                    self.spec_config.num_msa_layers,
                )

    def adapter_stream_deployment(self) -> Deployment:
        """What each LoRA adapter's streams must fit (read where vLLM loads an adapter:
        :mod:`vllm_specstream.patches.lora_adapter_streams`)."""
        return Deployment(
            num_msa_layers=self.spec_config.num_msa_layers,
            hidden_size=self.config.hidden_size,
            num_hidden_layers=self.config.num_hidden_layers,
            num_speculative_tokens=self.num_speculative_tokens,
            hf_config=self.config,
            tp_size=self._tp_size,
        )

    @property
    def stream_dtype(self) -> torch.dtype:
        """The dtype adapters' stream tensors are loaded in: the model's."""
        return self._model_dtype

    def _stream_runner(self) -> StreamRunner:
        if self._runner is None:
            self._runner = StreamRunner(
                self,
                self.specstream,
                self.spec_config,
                self._stream_weights,
                compiled=not self._eager and current_platform.is_cpu(),
            )
        return self._runner

    def load_weights(self, weights):
        """The base loader, plus checks that every stream tensor came with the right shape
        (a missing tensor would otherwise stay zero silently)."""
        expected = {
            f"specstream.{n}": tuple(p.shape) for n, p in self.specstream.named_parameters()
        }

        def checked(items):
            for name, tensor in items:
                if name in expected and tuple(tensor.shape) != expected[name]:
                    raise ConfigError(
                        f"specstream.safetensors: tensor {name} has shape {list(tensor.shape)}, "
                        f"expected {list(expected[name])} (num_streams="
                        f"{self.spec_config.num_streams}, hidden_size={self.config.hidden_size})"
                    )
                yield name, tensor

        loaded = super().load_weights(checked(weights))
        missing = sorted(set(expected) - set(loaded))
        if missing:
            raise ConfigError(
                f"specstream.safetensors: missing stream tensor(s) {missing}; the merged "
                "checkpoint must carry them (export it with `specstream export`)"
            )
        if self.num_speculative_tokens > 0:
            # Now, before vLLM post-processes (prepacks and drops) the linear weights.
            stream_lora = StreamLoRAWeights.of(self.specstream, self.spec_config)
            self._stream_weights = build_stream_weights(
                list(self.model.layers)[self.first_msa_layer :],
                self._lm_head_weight(),
                mode=self.settings.stream_dtype,
                platform_is_cpu=current_platform.is_cpu(),
                model_dtype=self._model_dtype,
                tp_size=self._tp_size,
                stream_delta=stream_lora.dense if stream_lora is not None else None,
            )
            self._load_draft_vocab()
        return loaded

    def _load_draft_vocab(self) -> None:
        """The draft head, if the checkpoint has a draft vocabulary."""
        size = self.spec_config.draft_vocab_size
        if size == 0 or not self.own_streams:
            return
        ids = mask_token_ids(
            self.specstream.draft_vocab_mask, size, "specstream.safetensors (merged checkpoint)"
        )
        weight = self._lm_head_weight()
        if self._tp_size > 1 or weight is None:
            why = "tensor parallelism shards the LM head" if weight is not None else "no LM head"
            logger.warning(
                "specstream draft vocabulary (%d tokens) not used: %s; the streams draft "
                "from the whole vocabulary",
                size,
                why,
            )
            return
        packed = self._stream_weights is not None and self._stream_weights.lm_head is not None
        self._draft_head = draft_head(weight[ids], packed, current_platform.is_cpu())
        self._draft_ids = ids
        logger.info(
            "specstream streams draft from the checkpoint's draft vocabulary: %d of %d tokens",
            size,
            weight.shape[0],
        )

    def _lm_head_weight(self) -> torch.Tensor | None:
        """The LM head's rows of real tokens (vLLM pads the vocabulary with zero rows)."""
        weight = getattr(self.lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return None
        return weight[: self.config.vocab_size]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        batch = None
        if self.num_speculative_tokens > 0:
            # A new step: whatever an earlier forward left is stale from here on.
            self.forward_step += 1
            self.stash = None
            self.no_stash_reason = "the forward ended before the stream pass"
            batch = current_forward_batch(self._layer_name, positions)
            if self.tree is not None and batch is not None:
                positions = self._tree_positions(positions, batch)
            if batch is not None:
                self._streams_for(batch)
        fused = self._begin_fused(batch)
        try:
            if self._prunes(batch, input_ids, inputs_embeds):
                out = self._decode_with_pruning(input_ids, positions, batch)
            else:
                out = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        finally:
            streams = self._fused.finish() if fused else None
        if not isinstance(out, tuple):  # pipeline-parallel intermediate ranks
            return out
        hidden, aux = out
        if self.num_speculative_tokens > 0:
            self._after_main(aux[0], positions, input_ids, batch, streams)
        return hidden

    def _streams_for(self, batch: ForwardBatch) -> None:
        """The window streams of this forward when requests joined since the proposer chose
        them: as many as it would choose for this many requests (a batch the policy does not
        draft for would pay the streams at every joining prompt for nothing). A forward
        without them keeps its MSA input, so drafts can still come from the anchors."""
        rule, n = self.window_streams_at, batch.num_reqs
        if rule is not None and self.window_streams > 0 and n > self.window_streams_batch:
            self.window_streams = min(self.window_streams, rule(n))

    def _tree_positions(self, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Rotary positions by depth for this step's tree rows (``root + depth``: siblings
        share one), also in ``batch``; the runner's own tensor is left alone (vLLM's
        attention metadata aliases it)."""
        step = WORKER_TREES.step
        if step is None or not step.rows:
            return positions
        positions = depth_positions(positions, batch.query_start_loc.tolist(), step)
        batch.positions = positions[: batch.positions.shape[0]].clone()
        return positions

    def _prunes(self, batch: ForwardBatch | None, input_ids, inputs_embeds) -> bool:
        """Whether this forward prunes its trees at the pruning layer."""
        step = WORKER_TREES.step
        return (
            self.prune_threshold > 0
            and self.prune_trees
            and batch is not None
            and step is not None
            and bool(step.rows)
            and input_ids is not None
            and inputs_embeds is None
        )

    def _decode_with_pruning(self, input_ids, positions, batch: ForwardBatch):
        """The decoder's forward (as vLLM's ``LlamaModel.forward`` on one rank) with the
        step's trees pruned at the pruning layer: the layers from there run on the kept
        rows only. Returns ``(hidden, [residual stream entering L0])`` in the runner's
        row layout, like the decoder with its aux-hidden-state hook."""
        from vllm_specstream.model_executor.trees.attention import (
            current_tree_step,
            set_tree_step,
        )

        decoder, step = self.model, WORKER_TREES.step
        query_start = batch.query_start_loc.tolist()
        hidden = decoder.embed_input_ids(input_ids)
        residual = None
        num_rows = hidden.shape[0]
        msa_input = pruned = None
        with contextlib.ExitStack() as stack:
            stack.callback(set_tree_step, current_tree_step())  # the full trees, after
            for idx, layer in enumerate(decoder.layers):
                if idx == self.prune_layer:
                    stream = hidden if residual is None else hidden + residual
                    pruned = self._prune(stream, input_ids, query_start, step, num_rows)
                    if pruned is not None:
                        keep = pruned.keep_rows
                        hidden, positions = hidden[keep], positions[keep]
                        residual = None if residual is None else residual[keep]
                        attn = decoder.layers[idx].self_attn.attn
                        names = [
                            attention_layer_name(self._layer_prefix, i)
                            for i in range(idx, len(decoder.layers))
                        ]
                        metadata = pruned_metadata(
                            attn_metadata_of(names[0]), pruned, attn, self._model_dtype
                        )
                        stack.enter_context(attention_for_kept_rows(names, metadata, pruned))
                        set_tree_step(kept_tree_step(step, pruned))
                if idx == self.first_msa_layer:
                    msa_input = hidden if residual is None else hidden + residual
                    if pruned is not None:
                        msa_input = scatter_rows(msa_input, pruned.keep_rows, num_rows)
                hidden, residual = layer(positions, hidden, residual)
        hidden, _ = decoder.norm(hidden, residual)
        if pruned is not None:
            hidden = scatter_rows(hidden, pruned.keep_rows, num_rows)
        return hidden, [msa_input]

    def _prune(self, stream, input_ids, query_start, step, num_rows):
        """The kept rows of this step's trees (None: nothing pruned); records what was kept
        for the sampler."""
        self._stream_runner()  # the LM head for rows of its own (prepacked where it is)
        spec, norm = self.specstream, self.model.norm

        def head(rows):
            return prune_head_probs(rows, spec.prune_a, spec.prune_b, norm, self._stream_logits)

        probs = node_keep_probs(stream, input_ids, query_start, step, head)
        parents = {t.row: t.parents for t in step.rows}
        keep = {row: prune_nodes(parents[row], p, self.prune_threshold) for row, p in probs.items()}
        pruned = prune_batch(num_rows, query_start, step, keep)
        removed = 0 if pruned is None else sum(pruned.removed)
        WORKER_TREES.count_pruned(sum(len(p) for p in parents.values()), removed)
        if pruned is not None:
            step.kept.update(pruned.kept)
        return pruned

    def move_kv(self, moves: dict[int, list[tuple[int, int]]]) -> None:
        """Copy, in every layer's cache, the keys/values of request row ``r`` from position
        ``src`` to ``dst`` for each ``(src, dst)`` of ``moves[r]`` (tree verification: the
        accepted path into the slots vLLM keeps). All sources are read before any write."""
        stash = self.stash
        if stash is None:
            raise RuntimeError("specstream tree verification: no forward batch to move KV in")
        rows = [r for r, pairs in moves.items() for _ in pairs]
        pos = torch.tensor([p for pairs in moves.values() for p in pairs], dtype=torch.long)
        layers = [layer for layer in self.model.layers if hasattr(layer, "self_attn")]
        first = layer_kv_cache(layers[0])
        layout = PagedKVLayout.of_cache(first, layers[0].self_attn.attn.isa)
        table = stash.batch.block_table[torch.tensor(rows)]
        (k_src, v_src), (k_dst, v_dst) = (
            layout.position_indices(first.shape[1], table, pos[:, col : col + 1])
            for col in (0, 1)  # src, dst
        )
        for layer in layers:
            flat = layer_kv_cache(layer).view(-1)
            flat[k_dst], flat[v_dst] = flat[k_src], flat[v_src]

    def _begin_fused(self, batch: ForwardBatch | None) -> bool:
        """Start a fused window pass for this forward if there is one to run."""
        self._pending_streams = None
        if batch is None or self._fused is None:
            return False
        if self.placement != "window" or self.window_streams <= 0:
            return False
        anchors = last_window_anchors(batch, self.num_speculative_tokens + 1)
        anchors = self._fused.runner.anchors_with_streams(batch, anchors)
        self._fused.begin(batch, anchors, self.window_streams)
        return self._fused.active is not None

    def _after_main(
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
                f"the stream pass found no forward batch for layer {self._layer_name}: "
                f"{no_forward_batch_reason(self._layer_name)}"
            )
            return
        table = torch.full((positions.shape[0], self.spec_config.num_streams), -1, dtype=torch.long)
        ids = input_ids[: positions.shape[0]].clone() if input_ids is not None else None
        stash = StreamStash(self.forward_step, batch, ids, table)
        if self.tree is not None:
            stash.draft_topk = torch.full((*table.shape, max(self.tree.top_k)), -1)
        self.stash = self.last_stash = stash
        self.no_stash_reason = None
        if streams is not None:  # fused: the LM head runs with the main rows
            self._pending_streams = (stash, *streams)
        elif self.placement == "window" and self.window_streams > 0:
            self._run_streams(
                stash,
                msa_input,
                last_window_anchors(batch, self.num_speculative_tokens + 1),
                self.window_streams,
            )
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
        self.project_streams(stash, indices)
        return stash.draft_table

    def _run_streams(
        self, stash: StreamStash, msa_input: torch.Tensor, anchors: torch.Tensor, num_streams: int
    ) -> None:
        """The final states of the first ``num_streams`` streams (0: all) at ``anchors``
        (``[R, A]``), pending in ``stash`` until :meth:`project_streams`."""
        anchors = self._stream_runner().anchors_with_streams(stash.batch, anchors)
        if not bool((anchors >= 0).any()):
            return  # e.g. a step of partial prefills only: no request drafts
        hidden = self._stream_runner()(msa_input, stash.batch, anchors, num_streams)
        stash.stream_states = (anchors, hidden)

    def project_streams(self, stash: StreamStash, indices: list[int] | None) -> None:
        """Top-1 tokens of ``stash``'s pending streams at flat token ``indices`` (None: all)
        into its draft table (the other columns stay -1)."""
        taken = take_stream_rows(stash, indices)
        if taken is None:
            return
        anchors, hidden = taken
        rows = hidden[anchors >= 0].reshape(-1, hidden.shape[-1])
        if self._draft_head is not None:
            logits = self._draft_head(rows)
            self._write_drafts(stash, anchors, logits, hidden.shape[2], self._draft_ids)
        else:
            self._write_drafts(stash, anchors, self._stream_logits(rows), hidden.shape[2])

    def _stream_logits(self, rows: torch.Tensor):
        """Logits of stream rows on their own: the prepacked LM head if there is one, else
        vLLM's logits processor without its LoRA wrapper (whose adapter mapping has one entry
        per sampled main row). Any positive logit scale or soft cap keeps the argmax of the
        plain projection (the confidence rule reads its softmax: exact for the supported
        families, which have neither)."""
        head = self._runner.weights.lm_head
        if head is not None:
            return head(rows)
        if self._runner.lora is not None:
            return base_logits_processor(self.logits_processor)(self.lm_head, rows)
        return super().compute_logits(rows)

    def compute_logits(self, hidden_states: torch.Tensor):
        """vLLM's logits; after a fused window pass with few stream rows their final states
        go through the LM head in the same call and their top-1 tokens into the stash (more
        rows, or LoRA serving, whose mapping is the main rows': they wait in the stash for
        the proposer, which projects only the anchors it reads)."""
        pending, self._pending_streams = self._pending_streams, None
        if pending is None:
            return super().compute_logits(hidden_states)
        stash, anchors, hidden = pending
        valid = anchors >= 0
        if (
            self._runner.lora is not None
            or self._draft_head is not None
            or int(valid.sum()) * hidden.shape[2] > self.fused_stream_logits_rows
        ):
            stash.stream_states = (anchors, hidden)
            return super().compute_logits(hidden_states)
        rows = hidden[valid].reshape(-1, hidden.shape[-1])
        n = hidden_states.shape[0]
        logits = super().compute_logits(torch.cat((hidden_states, rows.to(hidden_states.dtype))))
        self._write_drafts(stash, anchors, None if logits is None else logits[n:], hidden.shape[2])
        return None if logits is None else logits[:n]

    def _write_drafts(
        self,
        stash: StreamStash,
        anchors: torch.Tensor,
        logits,
        g: int,
        token_ids: torch.Tensor | None = None,
    ) -> None:
        """Top-1 tokens of ``g`` streams at each valid anchor (``logits`` of their rows, in
        anchor-major order; ``token_ids``: each logit column's token, if not its index) into
        the stash's draft table."""
        if logits is None:  # tensor-parallel ranks other than the first
            stash.drafting_rank = False
            return
        valid = anchors >= 0
        if self.draft_min_prob > 0:
            top_prob, tokens = logits.float().softmax(dim=-1).max(dim=-1)
            tokens = confident_drafts(tokens.view(-1, g), top_prob.view(-1, g), self.draft_min_prob)
        else:
            tokens = logits.argmax(dim=-1).view(-1, g)
        if token_ids is not None:
            tokens = torch.where(tokens >= 0, token_ids[tokens.clamp(min=0)], tokens)
        stash.draft_table[anchors[valid], :g] = tokens
        if stash.draft_topk is not None:
            top = logits.topk(stash.draft_topk.shape[-1], dim=-1).indices
            if token_ids is not None:
                top = token_ids[top]
            stash.draft_topk[anchors[valid], :g] = top.view(-1, g, top.shape[-1])


class SpecStreamLlamaForCausalLM(SpecStreamMixin, LlamaForCausalLM):
    """Llama, Mistral and SmolLM bases."""


class SpecStreamQwen2ForCausalLM(SpecStreamMixin, Qwen2ForCausalLM):
    """Qwen2 bases (biased q/k/v projections)."""


class SpecStreamQwen3ForCausalLM(SpecStreamMixin, Qwen3ForCausalLM):
    """Qwen3 dense bases (per-head query/key norms)."""


class SpecStreamPhi3ForCausalLM(SpecStreamMixin, Phi3ForCausalLM):
    """Phi-3 bases (vLLM's Llama layers; fused ``qkv_proj``/``gate_up_proj`` in the
    checkpoint and its LoRA adapters)."""


#: vLLM model class per base architecture.
FAMILY_CLASSES: dict[str, type] = {
    "LlamaForCausalLM": SpecStreamLlamaForCausalLM,
    "MistralForCausalLM": SpecStreamLlamaForCausalLM,
    "Qwen2ForCausalLM": SpecStreamQwen2ForCausalLM,
    "Qwen3ForCausalLM": SpecStreamQwen3ForCausalLM,
    "Phi3ForCausalLM": SpecStreamPhi3ForCausalLM,
}


class SpecStreamForCausalLM(SpecStreamLlamaForCausalLM):
    """The architecture vLLM resolves for every merged checkpoint: constructs the class of the
    checkpoint's base family (a Llama-family base gets this class itself)."""

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = ""):
        family = FAMILY_CLASSES[base_architecture(vllm_config.model_config.hf_config)]
        if cls is SpecStreamForCausalLM and family is not SpecStreamLlamaForCausalLM:
            return family(vllm_config=vllm_config, prefix=prefix)
        return super().__new__(cls)


def fuse_all_stream_logits(model) -> None:
    """``LLM.apply_model(fuse_all_stream_logits)``: a fused window pass projects every
    stream row with the main rows, over the whole vocabulary."""
    model.fused_stream_logits_rows = 1 << 30
    whole_vocab_drafts(model)


def whole_vocab_drafts(model) -> None:
    """``LLM.apply_model(whole_vocab_drafts)``: the streams draft from the whole vocabulary
    even where the checkpoint has a draft vocabulary."""
    model._draft_head = model._draft_ids = None


def stash_snapshot(model) -> dict | None:
    """The last stash's anchors and stream drafts as plain lists, for inspection through
    ``LLM.apply_model(stash_snapshot)``."""
    stash = getattr(model, "last_stash", None)
    if stash is None:
        return None
    deferred = stash.stream_states is not None
    with torch.inference_mode():  # the table was made in the forward's inference mode
        model.project_streams(stash, None)
    return {
        "step": stash.step,
        "deferred": deferred,
        "qsl": stash.batch.query_start_loc.tolist(),
        "positions": stash.batch.positions.tolist(),
        "input_ids": stash.input_ids.tolist() if stash.input_ids is not None else None,
        "table": stash.draft_table.tolist(),
    }
