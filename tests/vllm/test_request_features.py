"""vLLM's request features with speculation on, against the same requests with it off, on
the committed E2E adapter (fp32): structured output (JSON schema, regex, choice), logprobs
and prompt logprobs, ``n = 2``, stop strings, penalties and seeded sampling, in one batch.
(Prefix-cache hits, chunked prefill of long prompts and preemption under KV-cache pressure:
the "chunked" engine of ``test_specstream_engine.py`` and the follow-ups of
``test_tree_verification.py``.)"""

import json
import re
from pathlib import Path

import pytest
from engine_child import run_child

pytestmark = [pytest.mark.engine, pytest.mark.model]

E2E_ADAPTER = Path(__file__).parents[2] / "examples" / "adapters" / "e2e-smollm2-ss4"
MRS = [
    "name[The Copper Kettle], eatType[pub], food[Italian], area[riverside]",
    "name[Blue Heron], eatType[restaurant], priceRange[cheap], familyFriendly[yes]",
    "name[Saffron Court], food[Indian], area[city centre], priceRange[high]",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "food": {"type": "string"}},
    "required": ["name", "food"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][A-Za-z]*( [A-Za-z]+){3,20}\."
CHOICES = ["pub", "restaurant", "coffee shop"]
GREEDY = {"temperature": 0.0, "max_tokens": 48}
#: name -> (meaning representation, sampling parameters); greedy unless said otherwise.
REQUESTS = {
    "json": (0, GREEDY | {"structured_outputs": {"json": SCHEMA}}),
    "regex": (1, GREEDY | {"structured_outputs": {"regex": REGEX}}),
    "choice": (2, GREEDY | {"structured_outputs": {"choice": CHOICES}}),
    "logprobs": (0, GREEDY | {"logprobs": 2, "prompt_logprobs": 1}),
    "stop": (2, GREEDY | {"stop": [" city"]}),
    "penalties": (
        0,
        GREEDY | {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.4},
    ),
    "seeded": (1, {"temperature": 0.8, "seed": 7, "max_tokens": 32}),
    "seeded_again": (1, {"temperature": 0.8, "seed": 7, "max_tokens": 32}),
    "sampled_n2": (2, {"temperature": 1.0, "seed": 11, "n": 2, "max_tokens": 32}),
}
SAMPLED = {"seeded", "seeded_again", "sampled_n2"}


@pytest.fixture(scope="module")
def runs(base_model_dir, tmp_path_factory):
    import torch
    from transformers import AutoTokenizer

    from vllm_specstream.training.checkpoint import export_merged
    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks.public import e2e_prompt

    ckpt = export_merged(
        E2E_ADAPTER, tmp_path_factory.mktemp("features") / "m", dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(ckpt)
    requests = [
        {
            "prompt": prompt_text(tok, [{"role": "user", "content": e2e_prompt(MRS[i])}]),
            "params": params,
        }
        for i, params in REQUESTS.values()
    ]

    def run(k):
        result, _ = run_child("features", ckpt=str(ckpt), k=k, engine={}, requests=requests)
        return dict(zip(REQUESTS, result["requests"]))

    return run(0), run(4)


def test_greedy_requests_are_identical_to_plain_decoding(runs):
    plain, spec = runs
    for name in REQUESTS.keys() - SAMPLED:
        want = [o["tokens"] for o in plain[name]["outputs"]]
        assert [o["tokens"] for o in spec[name]["outputs"]] == want, name


def test_structured_outputs_hold_with_drafts_accepted(runs):
    _, spec = runs
    data = json.loads(spec["json"]["outputs"][0]["text"])
    assert set(data) == {"name", "food"}
    assert re.fullmatch(REGEX, spec["regex"]["outputs"][0]["text"])
    assert spec["choice"]["outputs"][0]["text"] in CHOICES
    for name in ("json", "regex"):  # the grammar lets the streams' drafts through
        assert spec[name]["spec"]["num_accepted_draft_tokens"] > 0, spec[name]["spec"]


def test_logprobs_and_prompt_logprobs_equal_plain_decodings(runs):
    plain, spec = runs
    want, got = plain["logprobs"], spec["logprobs"]
    assert got["outputs"][0]["logprobs"] == pytest.approx(want["outputs"][0]["logprobs"], abs=1e-3)
    assert got["prompt_logprobs"][1:] == pytest.approx(want["prompt_logprobs"][1:], abs=1e-3)
    assert got["spec"]["num_accepted_draft_tokens"] > 0


def test_stop_strings_and_penalties_keep_drafting(runs):
    # (vLLM reports no per-request metrics for a request that a stop string ended: the
    # stop string's output is compared with plain decoding's above.)
    _, spec = runs
    assert spec["stop"]["outputs"][0]["text"].endswith(" in the")
    assert spec["penalties"]["spec"]["num_accepted_draft_tokens"] > 0, spec["penalties"]


def test_seeded_sampling_is_reproducible_with_speculation(runs):
    # The same seed gives the same sample in one batch; two samples of n = 2 differ
    # (vLLM refuses n > 1 with greedy sampling, with speculation or without).
    _, spec = runs
    assert spec["seeded"]["outputs"][0]["tokens"] == spec["seeded_again"]["outputs"][0]["tokens"]
    first, second = spec["sampled_n2"]["outputs"]
    assert first["tokens"] != second["tokens"]
