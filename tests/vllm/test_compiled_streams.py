"""The stream pass of a compiled decoder (vLLM's default, ``enforce_eager=False``): compiled
at engine load for every batch and stream count, never while serving, and lossless."""

from __future__ import annotations

import pytest
from engine_child import run_child
from test_specstream_engine import INSPECT_ENV, make_requests

pytestmark = pytest.mark.engine

COMPILED = {"enforce_eager": False}
#: Drafts per request by batch size: 3 alone, 1 for 2-5 requests, 3 from 6 (24 requests in
#: one batch run through every size as they finish): stream passes of one request with 3
#: stream rows and of several with 1 or 3.
SCHEDULE = [[1, 1, 3], [2, 5, 1], [6, 1024, 3]]


REQUESTS = make_requests(24, seed=11)


@pytest.fixture(scope="module")
def plain(tiny_merged):
    return run_child("generate", ckpt=str(tiny_merged), k=0, engine=COMPILED, requests=REQUESTS)[0]


#: The stream pass's matmuls: bf16 copies where this CPU has them (else vLLM's modules, as
#: "model"), and vLLM's modules.
@pytest.fixture(scope="module", params=["auto", "model"])
def runs(request, tiny_merged, plain):
    spec, out = run_child(
        "generate",
        ckpt=str(tiny_merged),
        k=3,
        engine=COMPILED,
        requests=REQUESTS,
        placement="accepted",
        spec_options={"num_speculative_tokens_per_batch_size": SCHEDULE},
        fields={"stream_dtype": request.param},
        compare_layers=True,
        env=INSPECT_ENV,
    )
    return plain, spec, out.stdout + out.stderr


def test_greedy_is_token_identical_with_a_compiled_stream_pass(runs):
    plain, spec, _ = runs
    assert spec["tokens"] == plain["tokens"]
    assert spec["metrics"]["vllm:spec_decode_num_drafts"] > 0


def test_the_stream_pass_compiles_at_load_and_never_while_serving(runs):
    _, spec, log = runs
    assert "specstream compiled the stream pass" in log
    assert spec["graphs_compiled_serving"] == 0


def test_each_compiled_layer_computes_its_own_layer(runs):
    """One graph serves every MSA layer: each must still read its own layer's weights,
    norms and cache (the streams' drafts, not the outputs, would show it)."""
    layers = runs[1]["layers"]
    assert layers["compiled"]
    assert max(layers["same"]) < 0.02, layers
    assert min(layers["other"]) > 0.1, layers
