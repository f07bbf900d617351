"""``StreamHead``: the streams' LM head and the drafts it writes into a stash.

The streams' final states become tokens here: through the prepacked LM head (or vLLM's
logits processor), over the checkpoint's draft vocabulary where it has one, top-1 per stream
(cut by the confidence rule, field ``draft_min_prob``) and, for draft trees, each stream's
top-K. After a fused window pass few stream rows ride along the main rows' LM head call
(:data:`FUSED_STREAM_LOGITS_ROWS`); more wait in the stash until the proposer reads them
(:func:`~vllm_specstream.model_executor.stash.take_stream_rows`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_specstream.checkpoint.draft_vocab import mask_token_ids
from vllm_specstream.logger import init_logger
from vllm_specstream.model_executor.lora.stream_row_lora import StreamLoRAWeights
from vllm_specstream.model_executor.lora.vllm_lora_layers import base_logits_processor
from vllm_specstream.model_executor.stash import StreamStash, take_stream_rows
from vllm_specstream.model_executor.stream_weights import (
    Matmul,
    StreamWeights,
    build_stream_weights,
    draft_head,
)
from vllm_specstream.streams.decode_math import confident_drafts

logger = init_logger(__name__)

#: Window stream rows up to which a fused pass puts them through the LM head with the main
#: rows; beyond, only the rows at the anchors the proposer reads go through it, in a call
#: of their own. The call of their own reads the whole head again (one core, AVX2, fp32,
#: 49k-token head: +7.8 ms for 1 row); riding along costs per row (+5.3 ms for 6 rows,
#: +14.3 for 20, +60.2 for 80: docs/benchmarks.md, "The streams' LM head").
FUSED_STREAM_LOGITS_ROWS = 16


class StreamHead:
    """The LM head of one model's streams. ``plain_logits`` is vLLM's ``compute_logits`` of
    the model's class (rows in, logits out; None on tensor-parallel ranks but the first)."""

    def __init__(self, model, draft_min_prob: float, plain_logits: Callable):
        self.model = model
        self.draft_min_prob = draft_min_prob
        if draft_min_prob > 0:
            logger.info(
                "specstream drafts stop below cumulative stream probability %g (draft_min_prob)",
                draft_min_prob,
            )
        self.plain_logits = plain_logits
        #: The stream pass's matmuls (built when the weights are loaded) and its runner (set
        #: when it is built: its LoRA wrappers and weights).
        self.weights: StreamWeights | None = None
        self.runner = None
        #: Window stream rows a fused pass projects with the main rows.
        self.fused_rows = FUSED_STREAM_LOGITS_ROWS
        #: The head over the checkpoint's draft vocabulary and the vocabulary's token ids
        #: (column -> token); None: the whole vocabulary.
        self.draft_head: Matmul | None = None
        self.draft_ids: torch.Tensor | None = None

    def load(self, *, mode: str, is_cpu: bool, model_dtype, tp_size: int) -> None:
        """The stream pass's matmuls and the draft head, from the loaded weights (before vLLM
        post-processes, i.e. prepacks and drops, the linear weights)."""
        model = self.model
        stream_lora = StreamLoRAWeights.of(model.specstream, model.spec_config)
        self.weights = build_stream_weights(
            list(model.model.layers)[model.first_msa_layer :],
            self.lm_head_weight(),
            mode=mode,
            platform_is_cpu=is_cpu,
            model_dtype=model_dtype,
            tp_size=tp_size,
            stream_delta=stream_lora.dense if stream_lora is not None else None,
        )
        self._load_draft_vocab(is_cpu, tp_size)

    def _load_draft_vocab(self, is_cpu: bool, tp_size: int) -> None:
        """The draft head, if the checkpoint has a draft vocabulary."""
        model = self.model
        size = model.spec_config.draft_vocab_size
        if size == 0 or not model.own_streams:
            return
        where = "specstream.safetensors (merged checkpoint)"
        ids = mask_token_ids(model.specstream.draft_vocab_mask, size, where)
        weight = self.lm_head_weight()
        if tp_size > 1 or weight is None:
            why = "tensor parallelism shards the LM head" if weight is not None else "no LM head"
            logger.warning(
                "specstream draft vocabulary (%d tokens) not used: %s; the streams draft "
                "from the whole vocabulary",
                size,
                why,
            )
            return
        copies = self.weights.dtype if self.weights is not None else None
        self.draft_head = draft_head(weight[ids], copies, is_cpu)
        self.draft_ids = ids
        logger.info(
            "specstream streams draft from the checkpoint's draft vocabulary: %d of %d tokens",
            size,
            weight.shape[0],
        )

    def lm_head_weight(self) -> torch.Tensor | None:
        """The LM head's rows of real tokens (vLLM pads the vocabulary with zero rows)."""
        weight = getattr(self.model.lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return None
        return weight[: self.model.config.vocab_size]

    def logits(self, rows: torch.Tensor):
        """Logits of stream rows on their own: the prepacked LM head if there is one, else
        vLLM's logits processor without its LoRA wrapper (whose adapter mapping has one entry
        per sampled main row). Any positive logit scale or soft cap keeps the argmax of the
        plain projection (the confidence rule reads its softmax: exact for the supported
        families, which have neither)."""
        head = self.runner.weights.lm_head
        if head is not None:
            return head(rows)
        if self.runner.lora is not None:
            model = self.model
            return base_logits_processor(model.logits_processor)(model.lm_head, rows)
        return self.plain_logits(rows)

    def project(self, stash: StreamStash, indices: list[int] | None) -> None:
        """Top-1 tokens of ``stash``'s pending streams at flat token ``indices`` (None: all)
        into its draft table (the other columns stay -1)."""
        taken = take_stream_rows(stash, indices)
        if taken is None:
            return
        anchors, hidden = taken
        rows = hidden[anchors >= 0].reshape(-1, hidden.shape[-1])
        if self.draft_head is not None:
            logits = self.draft_head(rows)
            self.write(stash, anchors, logits, hidden.shape[2], self.draft_ids)
        else:
            self.write(stash, anchors, self.logits(rows), hidden.shape[2])

    def fused_logits(self, hidden_states, main_logits: Callable, stash, anchors, hidden):
        """The main rows' logits after a fused window pass: with few stream rows their final
        states go through the LM head in the same call and their top-1 tokens into the
        stash; more rows (or LoRA serving, whose mapping is the main rows', or a draft
        vocabulary) wait in the stash for the proposer, which projects only the anchors it
        reads."""
        valid = anchors >= 0
        if (
            self.runner.lora is not None
            or self.draft_head is not None
            or int(valid.sum()) * hidden.shape[2] > self.fused_rows
        ):
            stash.stream_states = (anchors, hidden)
            return main_logits(hidden_states)
        rows = hidden[valid].reshape(-1, hidden.shape[-1])
        n = hidden_states.shape[0]
        logits = main_logits(torch.cat((hidden_states, rows.to(hidden_states.dtype))))
        self.write(stash, anchors, None if logits is None else logits[n:], hidden.shape[2])
        return None if logits is None else logits[:n]

    def write(
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
