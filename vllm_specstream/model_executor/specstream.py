"""``SpecStreamForCausalLM``: a merged specstream checkpoint as a vLLM model.

The main stream is the base architecture's vLLM model, unchanged: same modules, same
paged attention, same outputs (served without speculation it is exactly the fine-tuned
model). On top, the model asks the decoder for the residual stream entering layer
``L0 = N - num_msa_layers`` (vLLM's aux-hidden-state hook) and, when speculative decoding
is on, hands it to its :class:`~vllm_specstream.model_executor.stream_pass.StreamPass`
(``model.streams``: where the streams run, this step's stash and its drafts, which is what
:class:`vllm_specstream.model_executor.proposer.SpecStreamProposer` reads). Draft trees add
rotary positions by depth, pruning and moved keys/values
(:mod:`vllm_specstream.model_executor.trees.model_forward`).

``SpecStreamForCausalLM`` (the registered architecture of every merged checkpoint) builds
the class of the checkpoint's base family from :data:`FAMILY_CLASSES`: the :class:`SpecStreamMixin`
over that family's vLLM model (:mod:`vllm_specstream.checkpoint.families` lists them). A new
family is one more entry in both, plus its layer's steps in ``stream_forward`` and
``training/model.py`` where they differ from Llama's.
"""

from __future__ import annotations

import os

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.phi3 import Phi3ForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.platforms import current_platform

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.checkpoint.merged import (
    adapter_streams_only,
    base_architecture,
    read_specstream_section,
)
from vllm_specstream.logger import init_logger
from vllm_specstream.model_executor.forward_batch import (
    attention_layer_name,
    current_forward_batch,
)
from vllm_specstream.model_executor.lora.per_adapter_streams import Deployment
from vllm_specstream.model_executor.pipeline import reserve_aux_slots
from vllm_specstream.model_executor.stream_forward import StreamParams
from vllm_specstream.model_executor.stream_head import StreamHead
from vllm_specstream.model_executor.stream_pass import StreamPass
from vllm_specstream.model_executor.trees import model_forward as trees
from vllm_specstream.model_executor.trees.step import WORKER_TREES
from vllm_specstream.patches.cpu_env import single_thread_note
from vllm_specstream.speculation.preflight import (
    ADAPTER_STREAMS_NEED_LORA,
    STREAM_LORA_WITH_LORA,
    check_platform,
)
from vllm_specstream.speculation.settings import EngineSettings, draft_tree_of

logger = init_logger(__name__)


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
        n = hf_config.num_hidden_layers
        self.first_msa_layer = n - self.spec_config.num_msa_layers
        self.prune_layer = self.spec_config.prune_layer(n)
        self.layer_prefix = f"{prefix}.model." if prefix else "model."
        self.model_dtype = vllm_config.model_config.dtype
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        # vLLM's public EAGLE-3 hook: the decoder then also returns the residual stream
        # entering L0, which the streams start from.
        super().set_aux_hidden_state_layers((self.first_msa_layer,))
        #: Whether vLLM asked for auxiliary states itself (its ``eagle3`` method on this
        #: checkpoint): the forward then returns them, as vLLM's runner unpacks them.
        self.aux_for_vllm = False
        reserve_aux_slots(self)
        eager = vllm_config.model_config.enforce_eager
        tree = self._check_speculation(vllm_config)
        self.streams = StreamPass(
            self,
            num_speculative_tokens=self.num_speculative_tokens,
            placement=self.settings.placement,
            eager=eager,
            compiled=not eager and current_platform.is_cpu(),
            head=StreamHead(self, self.settings.draft_min_prob, super().compute_logits),
            layer_name=attention_layer_name(self.layer_prefix, n - 1),
            tree=tree,
            prune_threshold=self._prune_threshold() if tree is not None else 0.0,
        )
        if tree is not None:
            WORKER_TREES.bind_model(self)

    def _check_speculation(self, vllm_config: VllmConfig):
        """What the front-end's preflight also checks, here for engines built without it;
        returns the draft tree's template (None: chain drafts)."""
        k = self.num_speculative_tokens
        if k > 0:
            check_platform(current_platform)
            if current_platform.is_cpu():
                note = single_thread_note(
                    torch.get_num_threads(),
                    os.cpu_count() or 1,  # the worker's own affinity is its binding
                    os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                )
                if note:
                    logger.warning("specstream: %s", note)
        tree = None
        if self.settings.trees:
            tree = draft_tree_of(self.settings, self.spec_config.num_streams)
            logger.info(
                "specstream verifies draft trees: %d nodes (top-k per stream %s, field tree_top_k)",
                tree.num_nodes,
                list(tree.top_k),
            )
        elif k > self.spec_config.num_streams:
            raise ConfigError(
                f"num_speculative_tokens={k} exceeds the checkpoint's "
                f"num_streams={self.spec_config.num_streams} (config.json: specstream.num_streams)"
            )
        if self.spec_config.stream_lora_rank and k and vllm_config.lora_config:
            raise ConfigError(STREAM_LORA_WITH_LORA)
        if not self.own_streams and k and not vllm_config.lora_config:
            raise ConfigError(ADAPTER_STREAMS_NEED_LORA.format(where="config.json"))
        return tree

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

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """vLLM's EAGLE-3 hook, called by vLLM's runner for its ``eagle3`` method: the
        decoder returns those layers' inputs and the forward hands them on."""
        super().set_aux_hidden_state_layers(layers)
        self.aux_for_vllm = True

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
        return self.model_dtype

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
            self.streams.head.load(
                mode=self.settings.stream_dtype,
                is_cpu=current_platform.is_cpu(),
                model_dtype=self.model_dtype,
                tp_size=self._tp_size,
            )
        return loaded

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        batch, fused = None, False
        if self.num_speculative_tokens > 0:
            batch = current_forward_batch(self.streams.layer_name, positions)
            if self.streams.tree is not None and batch is not None:
                positions = trees.tree_positions(positions, batch)
            fused = self.streams.begin_step(batch)
        try:
            if trees.prunes(self.streams, batch, input_ids, inputs_embeds):
                out = trees.decode_with_pruning(self, input_ids, positions, batch)
            else:
                out = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        finally:
            streams = self.streams.finish_fused() if fused else None
        if not isinstance(out, tuple) or self.aux_for_vllm:  # PP intermediate ranks; eagle3
            return out
        hidden, aux = out
        if self.num_speculative_tokens > 0:
            self.streams.after_main(aux[0], positions, input_ids, batch, streams)
        return hidden

    def move_kv(self, moves: dict[int, list[tuple[int, int]]]) -> None:
        """Tree verification: the accepted path's keys/values into the slots vLLM keeps
        (:func:`~vllm_specstream.model_executor.trees.model_forward.move_kv`)."""
        trees.move_kv(self, moves)

    def compute_logits(self, hidden_states: torch.Tensor):
        """vLLM's logits; after a fused window pass with few stream rows, their drafts too
        (:meth:`StreamPass.logits`)."""
        return self.streams.logits(hidden_states, super().compute_logits)


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
    model.streams.head.fused_rows = 1 << 30
    whole_vocab_drafts(model)


def whole_vocab_drafts(model) -> None:
    """``LLM.apply_model(whole_vocab_drafts)``: the streams draft from the whole vocabulary
    even where the checkpoint has a draft vocabulary."""
    model.streams.head.draft_head = model.streams.head.draft_ids = None


def stash_snapshot(model) -> dict | None:
    """The last stash's anchors and stream drafts as plain lists, for inspection through
    ``LLM.apply_model(stash_snapshot)``."""
    stash = model.streams.last_stash
    if stash is None:
        return None
    deferred = stash.stream_states is not None
    with torch.inference_mode():  # the table was made in the forward's inference mode
        model.streams.head.project(stash, None)
    return {
        "step": stash.step,
        "deferred": deferred,
        "qsl": stash.batch.query_start_loc.tolist(),
        "positions": stash.batch.positions.tolist(),
        "input_ids": stash.input_ids.tolist() if stash.input_ids is not None else None,
        "table": stash.draft_table.tolist(),
    }
