"""`vllm serve` of one base for several specstream LoRA adapters, with the command `specstream
deploy` prints (a module of its own: its servers start after test_serve.py's have stopped,
so that no more than three servers share the machine's memory)."""

from __future__ import annotations

import pytest
from test_serve import (
    DEMO_ADAPTER,
    DEMO_FLAGS,
    _get,
    complete,
    metric,
    serve_many,
    sql_prompts,
)

pytestmark = [pytest.mark.serve, pytest.mark.model]


ADAPTERS = {
    "sql-demo": DEMO_ADAPTER,
    "sql-spider": DEMO_ADAPTER.with_name("sql-spider-smollm2-ss4"),
}


@pytest.fixture(scope="module")
def adapter_servers(base_model_dir, tmp_path_factory):
    """The embedded base served for the two SQL adapters with the command `specstream
    deploy` prints, and the same server without speculation."""
    import shlex

    from vllm_specstream.checkpoint.deployment import plan_deployment

    tmp = tmp_path_factory.mktemp("serve-adapters")
    plan = plan_deployment(base_model_dir, ADAPTERS)
    command = shlex.split(plan.serve_command())
    assert command[:3] == ["vllm", "serve", str(base_model_dir)]
    flags = (*DEMO_FLAGS, *command[3:])
    cut = flags.index("--spec-model")
    with serve_many(
        (base_model_dir, tmp / "spec.log", flags),
        (base_model_dir, tmp / "plain.log", flags[:cut] + flags[cut + 4 :]),
    ) as (spec, plain):
        yield {"spec": spec, "plain": plain, "logs": tmp}


def test_one_server_many_adapters_each_drafting_with_its_own_streams(
    adapter_servers, base_model_dir
):
    """`vllm serve BASE --lora-modules ...` as `specstream deploy` prints it: concurrent
    requests for either adapter and for the base get the plain server's answers; the
    adapters' requests draft (their own streams), and the adapters answer unlike the base."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [p["completions"] for p in sql_prompts(base_model_dir, 6)]
    jobs = [(model, p) for p in prompts for model in (*ADAPTERS, "m")]

    def answers(url):
        with ThreadPoolExecutor(len(jobs)) as pool:
            done = pool.map(lambda job: complete(url, job[1], 40, model=job[0], timeout=300), jobs)
            return [r["choices"][0]["text"] for r in done]

    spec, plain = answers(adapter_servers["spec"]), answers(adapter_servers["plain"])
    assert spec == plain
    by_model = {
        m: [t for (model, _), t in zip(jobs, plain) if model == m] for m in (*ADAPTERS, "m")
    }
    assert by_model["sql-demo"] != by_model["m"] and by_model["sql-spider"] != by_model["m"]
    metrics = _get(f"{adapter_servers['spec']}/metrics")[1]
    drafts = metric(metrics, "vllm:spec_decode_num_drafts_total")
    accepted = metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted > 0, (drafts, accepted)
    log = (adapter_servers["logs"] / "spec.log").read_text()
    assert "Traceback" not in log, log[-5000:]
