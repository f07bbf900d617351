"""Steps without drafts sampled by vLLM's plain sampler in a speculating engine (applied by
the specstream proposer).

vLLM 0.32 builds speculative-decoding metadata for every step of an engine with a
speculative method, drafts or none, and so samples every step with its rejection sampler:
a copy of the logits, the bonus-token sampler, the rejection kernel. The adaptive policy
leaves most steps without drafts where drafting does not pay, and there that work is what
the engine's sampling costs over a plain one (0.32 against 0.10 ms a step at batch 4 on an
AVX-512 AMD EPYC). With no drafts in the batch, the rejection sampler's tokens are its
bonus sampler's: vLLM's sampler over the same logits, one token per request, each seeded
request's generator drawn as often (requests without a seed draw from the global RNG,
which the rejection path also draws from: the same distribution, other draws).
:func:`plain_sampling_suffices` says when nothing else differs (no logprobs, penalties, bad
words or thinking budget, which read the step's drafts); such steps then take the runner's
plain path.
"""

from __future__ import annotations

import functools

from vllm_specstream.patches import Patch, wrap_once

TARGET = "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample"


def plain_sampling_suffices(spec_decode_metadata, sampling_metadata) -> bool:
    """Whether vLLM's plain sampler gives this step what its rejection sampler would: no
    request has drafts, and no sampling option reads drafts or the rejection sampler's
    logprobs."""
    if spec_decode_metadata is None or spec_decode_metadata.max_spec_len != 0:
        return False
    m = sampling_metadata
    holder = getattr(m, "thinking_budget_state_holder", None)
    return (
        m.max_num_logprobs is None
        and not m.logprob_token_ids
        and m.no_penalties
        and not m.bad_words_token_ids
        and (holder is None or not holder.has_tracked_requests())
    )


def _wrap_sample(sample):
    @functools.wraps(sample)
    def _sample(self, logits, spec_decode_metadata):
        if plain_sampling_suffices(spec_decode_metadata, self.input_batch.sampling_metadata):
            spec_decode_metadata = None
        return sample(self, logits, spec_decode_metadata)

    return _sample


def _apply() -> None:
    from vllm.v1.worker import gpu_model_runner

    wrap_once(gpu_model_runner.GPUModelRunner, "_sample", _wrap_sample, "__specstream_plain__")


PLAIN_SAMPLING = Patch(
    name="plain-sampling-without-drafts",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="a speculating engine samples every step with the rejection sampler, also steps "
    "where no request has drafts",
    apply=_apply,
)
