"""A step without drafts sampled by vLLM's plain sampler gives what its rejection sampler
gives (patches/plain_sampling.py); these fail when vLLM changes under the hook."""

import inspect
from dataclasses import replace

import pytest
import torch

from vllm_specstream.patches.plain_sampling import PLAIN_SAMPLING, plain_sampling_suffices

VOCAB = 50


def _metadata(temperatures, seeds, **overrides):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(temperatures)
    generators = {}
    for row, seed in seeds.items():
        generators[row] = torch.Generator().manual_seed(seed)
    greedy = all(t == 0 for t in temperatures)
    fields = dict(
        temperature=None if greedy else torch.tensor(temperatures, dtype=torch.float32),
        all_greedy=greedy,
        all_random=all(t > 0 for t in temperatures),
        top_p=None,
        top_k=None,
        generators=generators,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in range(n)],
    )
    fields.update(overrides)
    return SamplingMetadata(**fields)


def _no_drafts(n):
    """vLLM's speculative-decoding metadata of a step where no request has drafts."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    rows = torch.arange(n, dtype=torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.zeros(0, dtype=torch.int32),
        num_draft_tokens=[0] * n,
        cu_num_draft_tokens=torch.zeros(n, dtype=torch.int32),
        cu_num_sampled_tokens=rows + 1,
        target_logits_indices=torch.zeros(0, dtype=torch.int32),
        bonus_logits_indices=rows,
        logits_indices=rows,
    )


def _sample_both(temperatures, seeds):
    """Tokens from vLLM's rejection sampler and from its plain sampler on the same logits
    and RNG states, each with the next draw of every request's generator. (The global RNG,
    which requests without a seed draw from, is left where each path leaves it: the
    rejection path draws from it also without drafts; such requests' tokens are random
    draws from the same distribution either way.)"""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_specstream.patches import apply_patch
    from vllm_specstream.patches.cpu_kernel_registration import CPU_KERNEL_REGISTRATION

    # the rejection kernels' CPU implementations, as vLLM's CPU worker registers them (with
    # the plugin's fix: an earlier test in this process may have imported numba)
    apply_patch(CPU_KERNEL_REGISTRATION, vllm.__version__)
    current_platform.register_triton_kernel_overrides()
    logits = torch.randn(len(temperatures), VOCAB, generator=torch.Generator().manual_seed(3))
    results = []
    for verify in (True, False):
        torch.manual_seed(11)
        meta = _metadata(temperatures, seeds)
        sampler = Sampler()
        if verify:
            out = RejectionSampler(sampler)(
                _no_drafts(len(temperatures)), None, logits.clone(), meta
            )
        else:
            out = sampler(logits=logits.clone(), sampling_metadata=meta)
        after = [torch.rand(1, generator=g).item() for g in meta.generators.values()]
        results.append((out.sampled_token_ids.tolist(), after))
    return results


@pytest.mark.parametrize(
    "temperatures,seeds",
    [([0.0, 0.0, 0.0], {}), ([0.7, 1.0, 0.0, 1.3], {1: 5, 3: 9}), ([1.0, 0.5], {})],
    ids=["greedy", "mixed-seeded", "random-unseeded"],
)
def test_rejection_sampler_without_drafts_is_the_plain_sampler(temperatures, seeds):
    verified, plain = _sample_both(temperatures, seeds)
    assert verified == plain
    assert len(plain[0]) == len(temperatures) and all(len(r) == 1 for r in plain[0])


def test_plain_sampling_only_where_nothing_reads_drafts():
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    meta = _metadata([0.0, 0.0], {})
    assert plain_sampling_suffices(_no_drafts(2), meta)
    assert not plain_sampling_suffices(None, meta)
    drafted = SpecDecodeMetadata.make_dummy([[5, 6], []], torch.device("cpu"))
    assert not plain_sampling_suffices(drafted, meta)
    for changed in (
        dict(max_num_logprobs=0),
        dict(logprob_token_ids={0: [1, 2]}),
        dict(no_penalties=False),
        dict(bad_words_token_ids={1: [[3]]}),
    ):
        assert not plain_sampling_suffices(_no_drafts(2), replace(meta, **changed)), changed


def test_plain_sampling_hook_still_fits_vllm():
    # The runner's sampling entry point, its plain path when it gets no speculative
    # metadata, and the CPU runner inheriting it (the hook wraps GPUModelRunner's).
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    from vllm_specstream.patches import apply_patch
    from vllm_specstream.patches.vllm_version import ensure_supported_vllm

    runner = gpu_model_runner.GPUModelRunner
    assert "_sample" not in vars(cpu_model_runner.CPUModelRunner)
    params = list(inspect.signature(runner._sample).parameters)
    assert params == ["self", "logits", "spec_decode_metadata"]
    src = inspect.getsource(runner._sample)
    assert "if spec_decode_metadata is None:" in src and "self.sampler(" in src
    assert apply_patch(PLAIN_SAMPLING, ensure_supported_vllm())
    assert runner._sample.__specstream_plain__
    assert apply_patch(PLAIN_SAMPLING, ensure_supported_vllm())  # once per process
    assert not hasattr(runner._sample.__wrapped__, "__specstream_plain__")
