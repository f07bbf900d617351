"""Serving soak: one `vllm serve` with speculation and multi-LoRA under a long mixed load.

Starts one OpenAI server (loopback only) on a merged specstream checkpoint with the
specstream proposer and LoRA enabled (two LoRA modules), then sends ``--requests`` streaming
requests, ``--concurrency`` at a time: chat and text completions, greedy, sampled
(temperature 0.8), structured output (a JSON schema: ``structured_outputs`` on text
completions, the OpenAI ``response_format`` json_schema on chat) and LoRA requests (the
LoRA name as ``model``), ``max_tokens`` 16-64, prompts from the task development splits
(Spider, E2E, DialogSum; else the built-in SQL task's examples). ``--aborts`` of them are
long streams (``ignore_eos``) whose client hangs up after 1-4 content chunks.

Recorded: requests failed (any error but the deliberate hang-ups), `/health` and the
requests still running afterwards, the resident memory (VmRSS of the server and its
descendants, from /proc) after every 25 requests and its slope over the last 300 requests,
a greedy probe (one fixed prompt, temperature 0, 32 tokens) before and after the soak, the
drafts and accepted tokens from `/metrics`, wall time and requests per second.

Exits 1 if a request failed, the server is unhealthy or still runs requests, the probe's
text changed, the run hit ``--max-minutes``, or the fitted RSS growth over the last 300
requests exceeds ``--max-rss-growth-mib``. The server is always stopped (SIGINT, then
SIGKILL to its process group after 60 s).

    .venv/bin/python benchmarks/soak.py [--requests 500] [--aborts 100] [--concurrency 16]
        [--checkpoint MERGED | --adapter examples/adapters/sql-smollm2-ss4]
        [--lora NAME=DIR ...] [--adaptive] [--out runs/soak]

The default checkpoint is the demo adapter merged (fp32; exported into ``--out`` once): the
committed two-stage adapters (E2E, Spider, DialogSum) carry a stream LoRA, and their merged
form is refused with ``--enable-lora``. The LoRA modules are the Spider adapter (8 MSA
layers, as the demo's) and the demo adapter itself (its LoRA then applies twice: the soak
exercises the LoRA slots, not the answers' quality). Without ``--adaptive`` the server
drafts 4 tokens at every batch size (as the serve tests do), so that speculation runs under
the whole load whatever the policy would pick.

RSS is the sum of VmRSS over the server's processes (shared pages count once per process);
a run shorter than 300 + ``--rss-warmup`` requests leaves its first ``--rss-warmup`` (at
most half) out of the slope, and the fitted growth is over the requests kept.
``json`` keeps every request's record and the RSS of each process per sample.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vllm_specstream.bench.prometheus import metric

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ADAPTER = REPO / "examples" / "adapters" / "sql-smollm2-ss4"
DEFAULT_LORAS = [
    f"sql-spider={REPO / 'examples' / 'adapters' / 'sql-spider-smollm2-ss4'}",
    f"sql-demo={DEFAULT_ADAPTER}",
]
#: Development splits of the three tasks, relative to --data-dir.
DEV_FILES = {
    "sql": "spider/spider-dev-half.jsonl",
    "e2e": "e2e/devset.csv",
    "dialogsum": "dialogsum/dialogsum.dev.jsonl",
}
SERVED_NAME = "m"
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 1 << 30
SAMPLE_EVERY = 25
SLOPE_WINDOW = 300
PROBE_TOKENS = 32
#: Hung-up streams ask for this many tokens (ignore_eos), so they are mid-way when dropped.
ABORT_TOKENS = 64
#: Whether sampled requests carry a per-request ``seed`` (``--seeded``; see its help).
SEEDED = [False]
#: A short schema every task's prompt can fill.
JSON_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


# ------------------------------------------------------------------------------------------
# server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def launch(ckpt: Path, loras: list[str], spec: str | None, log_path: Path) -> tuple:
    """Start `vllm serve` on 127.0.0.1 in its own process group; returns (proc, log, url)."""
    port = free_port()
    max_rank = max(_lora_rank(entry.split("=", 1)[1]) for entry in loras) if loras else 0
    cmd = [
        str(Path(sys.executable).with_name("vllm")),
        "serve",
        str(ckpt),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        # vLLM names each aborted request in its request log.
        "--enable-log-requests",
    ]
    if spec is not None:
        cmd += ["--speculative-config", spec]
    if loras:
        cmd += ["--enable-lora", "--max-loras", str(len(loras))]
        cmd += ["--max-lora-rank", str(max_rank), "--lora-modules", *loras]
    log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
    )
    return proc, log, f"http://127.0.0.1:{port}", cmd


def _lora_rank(adapter_dir: str) -> int:
    return int(json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["r"])


def wait_healthy(proc, log_path: Path, url: str, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{_tail(log_path)}")
        with contextlib.suppress(OSError):
            if http_get(f"{url}/health", timeout=5)[0] == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy before the wall limit:\n{_tail(log_path)}")
        time.sleep(1)


def stop(proc, log) -> int | None:
    """SIGINT the server, wait 60 s, then SIGKILL its process group; its exit code."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    finally:
        log.close()
    return proc.returncode


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def tree_rss(root: int) -> dict[str, float]:
    """VmRSS in MiB of ``root`` and each of its descendants (from /proc), keyed
    ``comm:pid``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        if "VmRSS" in fields:
            out[f"{fields['Name'].strip()}:{pid}"] = round(
                int(fields["VmRSS"].split()[0]) / 1024, 1
            )
    return out


def sample_rss(result: dict, done: int, root: int) -> None:
    """Append (requests done, total MiB) to ``result["rss"]``, the breakdown per process to
    ``result["rss_by_process"]``."""
    per = tree_rss(root)
    result["rss"].append((done, round(sum(per.values()), 1)))
    result.setdefault("rss_by_process", []).append((done, per))


METRICS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
}


def read_metrics(url: str) -> dict:
    text = http_get(f"{url}/metrics")[1]
    out = {key: metric(text, name) or 0.0 for key, name in METRICS.items()}
    out["running"] = metric(text, "vllm:num_requests_running")
    out["waiting"] = metric(text, "vllm:num_requests_waiting")
    return out


# ------------------------------------------------------------------------------------------
# prompts and the request plan


def load_prompts(ckpt: Path, data_dir: Path, need_room: int) -> tuple[list[list[dict]], str]:
    """User messages from the development splits (shuffled, tasks interleaved), each short
    enough for ``need_room`` generated tokens; else the built-in SQL task's examples."""
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks import build_task, load_task_data, to_example

    tok = AutoTokenizer.from_pretrained(ckpt)
    limit = MAX_MODEL_LEN - need_room
    per_task: dict[str, list[list[dict]]] = {}
    for task, rel in DEV_FILES.items():
        path = data_dir / rel
        if not path.is_file():
            continue
        messages = [[{"role": "user", "content": r.prompt}] for r in load_task_data(task, path)]
        per_task[task] = [m for m in messages if len(tok(prompt_text(tok, m)).input_ids) <= limit]
    rng = random.Random(0)
    for messages in per_task.values():
        rng.shuffle(messages)
    mixed = [m for group in zip(*per_task.values()) for m in group]
    if mixed:
        counts = ", ".join(f"{t} {len(m)}" for t, m in per_task.items())
        return mixed, f"dev splits of {data_dir} ({counts}; {len(mixed)} used, interleaved)"
    fallback = [
        [m for m in to_example("sql", r).messages if m["role"] != "assistant"]
        for r in build_task("sql", "test", n=64)
    ]
    return fallback, "built-in sql task examples (no dev split found)"


def plan_requests(n: int, aborts: int, loras: list[str], seed: int) -> list[dict]:
    """Per request: endpoint, kind (greedy / sampled / structured), model, max_tokens, and
    for the hung-up ones the number of content chunks after which the client closes."""
    rng = random.Random(seed)
    hang_ups = set(rng.sample(range(n), min(aborts, n)))
    models = [SERVED_NAME, *loras] if loras else [SERVED_NAME]
    kinds = ("greedy", "sampled", "structured")
    plan = []
    for i in range(n):
        plan.append(
            {
                "index": i,
                "endpoint": ("chat", "completions")[i % 2],
                "kind": kinds[(i // 2) % 3],
                "model": models[rng.randrange(len(models))],
                "max_tokens": ABORT_TOKENS if i in hang_ups else rng.randint(16, 64),
                "abort_after": rng.randint(1, 4) if i in hang_ups else None,
            }
        )
    return plan


# ------------------------------------------------------------------------------------------
# client


def _text(choice) -> str:
    return (choice.delta.content or "") if hasattr(choice, "delta") else (choice.text or "")


async def open_stream(client, req: dict, messages: list[dict], text_prompt: str):
    kw: dict = {"model": req["model"], "max_tokens": req["max_tokens"], "stream": True}
    extra: dict = {}
    kw["temperature"] = 0.8 if req["kind"] == "sampled" else 0.0
    if req["kind"] == "sampled" and SEEDED[0]:
        kw["seed"] = req["index"]
    if req["abort_after"] is not None:
        extra["ignore_eos"] = True
    else:
        kw["stream_options"] = {"include_usage": True}
    if req["kind"] == "structured":
        if req["endpoint"] == "chat":
            kw["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": JSON_SCHEMA},
            }
        else:
            extra["structured_outputs"] = {"json": JSON_SCHEMA}
    if extra:
        kw["extra_body"] = extra
    if req["endpoint"] == "chat":
        return await client.chat.completions.create(messages=messages, **kw)
    return await client.completions.create(prompt=text_prompt, **kw)


async def run_one(client, req: dict, messages: list[dict], text_prompt: str) -> dict:
    """Send ``req``; returns its record (``ok``, ``error``, chunks, tokens, finish)."""
    out = {**req, "ok": False, "error": None, "chunks": 0, "text": "", "finish": None}
    t0 = time.monotonic()
    response = await open_stream(client, req, messages, text_prompt)
    try:
        async for chunk in response:
            for choice in chunk.choices:
                piece = _text(choice)
                out["chunks"] += bool(piece)
                out["text"] += piece
                out["finish"] = choice.finish_reason or out["finish"]
            if chunk.usage is not None:
                out["completion_tokens"] = chunk.usage.completion_tokens
            if req["abort_after"] is not None and out["chunks"] >= req["abort_after"]:
                out["hung_up"] = True
                break
    finally:
        await response.close()
    out["seconds"] = round(time.monotonic() - t0, 3)
    if req["abort_after"] is not None:
        # A stream that ended before the hang-up is no error, but nothing was aborted.
        out["ok"] = True
        out["hung_up"] = out.get("hung_up", False)
    elif out["finish"] is None:
        out["error"] = "stream ended without a finish_reason"
    else:
        out["ok"] = True
    if req["kind"] == "structured" and out["finish"] == "stop":
        try:
            json.loads(out["text"])
            out["json_valid"] = True
        except ValueError:
            out["json_valid"] = False
    return out


async def probe(client, prompt: str) -> str:
    """Greedy text of the fixed probe prompt (a text completion of the served model)."""
    r = await client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=PROBE_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return r.choices[0].text


#: The probe's user message (chat-templated by the checkpoint's tokenizer).
PROBE_MESSAGE = (
    "CREATE TABLE singer (Singer_ID INTEGER, Name VARCHAR, Country VARCHAR, Age INTEGER)\n"
    "Question: What are the names of singers older than 30, oldest first?"
)


async def soak(
    url: str, server_pid: int, args, plan, prompts, text_prompts, deadline, result: dict
) -> None:
    """Run the probe, the soak and the probe again, filling ``result`` as it goes (so that
    what ran is kept if the server dies)."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="x", max_retries=0, timeout=args.request_timeout
    )
    result.update(rss=[], records=[], timed_out=False)
    try:
        result["probe_before"] = await asyncio.wait_for(
            probe(client, args.probe_prompt), args.request_timeout
        )
        result["metrics_before"] = read_metrics(url)
        sample_rss(result, 0, server_pid)
        gate = asyncio.Semaphore(args.concurrency)
        done = 0

        async def one(req):
            nonlocal done
            async with gate:
                k = req["index"] % len(prompts)
                try:
                    rec = await asyncio.wait_for(
                        run_one(client, req, prompts[k], text_prompts[k]), args.request_timeout
                    )
                except asyncio.TimeoutError:
                    rec = {**req, "ok": False, "error": f"timeout after {args.request_timeout} s"}
                except Exception as e:  # noqa: BLE001 (every error is a failed request)
                    rec = {**req, "ok": False, "error": f"{type(e).__name__}: {e}"}
                result["records"].append(rec)
                done += 1
                if done % SAMPLE_EVERY == 0:
                    sample_rss(result, done, server_pid)
                if done % 50 == 0:
                    failed = sum(not r["ok"] for r in result["records"])
                    print(f"  {done}/{len(plan)} done, {failed} failed", flush=True)

        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(one(req)) for req in plan]
        try:
            remaining = deadline - time.monotonic()
            _, pending = await asyncio.wait(tasks, timeout=max(remaining, 1))
            result["timed_out"] = bool(pending)
        finally:
            # On the wall limit (or an interrupt) close the open streams before the client.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        result["soak_seconds"] = time.monotonic() - t0
        if result["rss"][-1][0] != done:
            sample_rss(result, done, server_pid)
        # The engine's gauges refresh on its stats interval: wait for the hung-up streams'
        # aborts to show (nothing running or waiting), 30 s at most.
        settle = time.monotonic() + 30
        while True:
            after = read_metrics(url)
            if (after["running"], after["waiting"]) == (0, 0) or time.monotonic() > settle:
                break
            await asyncio.sleep(1)
        result["metrics_after"] = after
        result["probe_after"] = await asyncio.wait_for(
            probe(client, args.probe_prompt), args.request_timeout
        )
    finally:
        await client.close()


# ------------------------------------------------------------------------------------------
# summary


def rss_slope(
    samples: list[tuple[int, float]], window: int, warmup: int
) -> tuple[float | None, int]:
    """Least-squares slope of RSS (MiB per 100 requests) over the samples of the last
    ``window`` requests, none of the first ``warmup`` (where a run is shorter than
    ``window + warmup``), and how many requests the samples kept span."""
    if len(samples) < 2:
        return None, 0
    last = samples[-1][0]
    kept = [(n, m) for n, m in samples if n >= max(last - window, min(warmup, last // 2))]
    if len(kept) < 2:
        return None, 0
    xs, ys = [n for n, _ in kept], [m for _, m in kept]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope * 100, kept[-1][0] - kept[0][0]


def summarize(res: dict, args, health: tuple, log_text: str) -> dict:
    recs = res.get("records", [])
    failed = [r for r in recs if not r["ok"]]
    answered = [r for r in recs if r["ok"] and r.get("abort_after") is None]
    hung = [r for r in recs if r.get("hung_up")]
    structured = [r for r in recs if "json_valid" in r]
    before, after = res.get("metrics_before", {}), res.get("metrics_after", {})
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in METRICS} if after else {}
    slope, span = rss_slope(res.get("rss", []), SLOPE_WINDOW, args.rss_warmup)
    growth = None if slope is None else slope * span / 100
    rss = res.get("rss", [])

    def by(key: str) -> dict:
        counts: dict = {}
        for r in recs:
            counts[str(r.get(key))] = counts.get(str(r.get(key)), 0) + 1
        return dict(sorted(counts.items()))

    seconds = res.get("soak_seconds")
    summary = {
        "requests_planned": args.requests,
        "requests_sent": len(recs),
        "concurrency": args.concurrency,
        "requests_failed": len(failed),
        "failures": [
            {k: r.get(k) for k in ("index", "kind", "endpoint", "model", "error")} for r in failed
        ][:20],
        "answered": len(answered),
        "hung_up": len(hung),
        "aborts_planned": args.aborts,
        "aborts_finished_before_hang_up": sum(
            1 for r in recs if r["ok"] and r.get("abort_after") is not None and not r.get("hung_up")
        ),
        "aborted_in_server_log": log_text.count(" aborted."),
        "by_kind": by("kind"),
        "by_endpoint": by("endpoint"),
        "by_model": by("model"),
        "structured_stop_valid_json": f"{sum(r['json_valid'] for r in structured)}/{len(structured)}",
        "finish_reasons": by("finish"),
        "health_after": health[0],
        "server_alive_after": health[1],
        "requests_left_running": (after.get("running"), after.get("waiting")),
        "probe_before": res.get("probe_before"),
        "probe_after": res.get("probe_after"),
        "probe_same": res.get("probe_before") is not None
        and res.get("probe_before") == res.get("probe_after"),
        "rss_mib_samples": rss,
        "rss_mib_first": rss[0][1] if rss else None,
        "rss_mib_last": rss[-1][1] if rss else None,
        "rss_slope_mib_per_100": None if slope is None else round(slope, 2),
        "rss_growth_fitted_mib": None if growth is None else round(growth, 1),
        "rss_window_requests": span,
        "metrics_delta": delta,
        "accepted_per_draft": round(delta["accepted_tokens"] / delta["drafts"], 3)
        if delta.get("drafts")
        else None,
        "acceptance_rate": round(delta["accepted_tokens"] / delta["draft_tokens"], 3)
        if delta.get("draft_tokens")
        else None,
        "soak_seconds": None if seconds is None else round(seconds, 1),
        "requests_per_second": round(len(recs) / seconds, 3) if seconds else None,
        "timed_out": res.get("timed_out", False),
        "tracebacks_in_server_log": log_text.count("Traceback"),
    }
    reasons = []
    if summary["requests_failed"]:
        reasons.append(f"{summary['requests_failed']} requests failed")
    if health[0] != 200 or not health[1]:
        reasons.append(f"server unhealthy after the soak (health {health[0]}, alive {health[1]})")
    if summary["requests_left_running"] not in ((0, 0), (0.0, 0.0)):
        reasons.append(f"requests still running/waiting: {summary['requests_left_running']}")
    if not summary["probe_same"]:
        reasons.append("greedy probe changed (or did not run)")
    if growth is not None and growth > args.max_rss_growth_mib:
        reasons.append(f"RSS grew {growth:.0f} MiB over the last {span} requests")
    if summary["timed_out"] or summary["requests_sent"] < args.requests:
        reasons.append(f"run incomplete ({summary['requests_sent']}/{args.requests} requests)")
    summary["passed"] = not reasons
    summary["fail_reasons"] = reasons
    return summary


def markdown(s: dict, meta: dict) -> str:
    d = s["metrics_delta"] or {}
    rows = [
        ("requests (sent / planned)", f"{s['requests_sent']} / {s['requests_planned']}"),
        ("concurrency", s["concurrency"]),
        ("requests failed", s["requests_failed"]),
        ("hung up mid-stream (planned)", f"{s['hung_up']} ({s['aborts_planned']})"),
        ("aborts in the server's request log", s["aborted_in_server_log"]),
        ("structured outputs ending in stop: valid JSON", s["structured_stop_valid_json"]),
        ("/health after", s["health_after"]),
        ("requests running / waiting after", s["requests_left_running"]),
        ("greedy probe unchanged", s["probe_same"]),
        ("RSS first -> last sample (MiB)", f"{s['rss_mib_first']} -> {s['rss_mib_last']}"),
        (
            f"RSS slope over the last {s['rss_window_requests']} requests",
            f"{s['rss_slope_mib_per_100']} MiB / 100 requests",
        ),
        (
            "drafts / draft tokens / accepted",
            f"{d.get('drafts')} / {d.get('draft_tokens')} / {d.get('accepted_tokens')}",
        ),
        ("accepted tokens per draft", s["accepted_per_draft"]),
        ("generation tokens", d.get("generation_tokens")),
        ("soak wall time (s)", s["soak_seconds"]),
        ("requests per second", s["requests_per_second"]),
        ("tracebacks in the server log while serving", s["tracebacks_in_server_log"]),
        ("result", "PASS" if s["passed"] else "FAIL: " + "; ".join(s["fail_reasons"])),
    ]
    lines = [
        "# Serving soak",
        "",
        f"Machine: {meta['machine']}. Server: {meta['server']}. Prompts: {meta['prompts']}.",
        "",
        "| figure | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=500, help="streaming requests to send")
    ap.add_argument("--aborts", type=int, default=100, help="of them, hung up mid-stream")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--checkpoint", help="merged specstream checkpoint (default: --adapter merged)")
    ap.add_argument("--adapter", default=str(DEFAULT_ADAPTER), help="adapter to merge and serve")
    ap.add_argument(
        "--lora",
        action="append",
        help="NAME=DIR LoRA module, repeatable (default: sql-spider and sql-demo)",
    )
    ap.add_argument("--adaptive", action="store_true", help="the adaptive policy, not 4 drafts")
    ap.add_argument(
        "--plain",
        action="store_true",
        help="serve without speculation (a baseline for the RSS figures)",
    )
    ap.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--request-timeout", type=float, default=300, help="seconds per request")
    ap.add_argument("--max-minutes", type=float, default=20, help="wall limit of the whole run")
    ap.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=200,
        help="fail above this RSS growth (fitted) over the last 300 requests",
    )
    ap.add_argument(
        "--rss-warmup",
        type=int,
        default=50,
        help="requests left out of the RSS slope when the run is shorter than 300 + this",
    )
    ap.add_argument("--seed", type=int, default=0, help="of the request plan")
    ap.add_argument(
        "--seeded",
        action="store_true",
        help="give sampled requests a seed (vLLM 0.32 CPU: a seeded request whose prefill is\n"
        "chunked kills the engine, 'CPU Generator does not use offset')",
    )
    ap.add_argument("--out", default="runs/soak", help="soak.json, soak.md and server.log go here")
    args = ap.parse_args()
    SEEDED[0] = args.seeded
    started = time.monotonic()
    deadline = started + args.max_minutes * 60
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from vllm_specstream.machine import describe_machine

    ckpt = Path(args.checkpoint) if args.checkpoint else out / "merged"
    if not args.checkpoint and not (ckpt / "config.json").is_file():
        exporter = str(Path(sys.executable).with_name("specstream"))
        subprocess.run(
            [exporter, "export", args.adapter, str(ckpt), "--dtype", "float32"], check=True
        )
    loras = args.lora if args.lora is not None else DEFAULT_LORAS
    spec = {"model": "specstream", "num_speculative_tokens": 4}
    if not args.adaptive:
        spec["num_speculative_tokens_per_batch_size"] = [[1, 1024, 4]]
    if args.plain:
        spec = None
    prompts, source = load_prompts(ckpt, Path(args.data_dir), need_room=ABORT_TOKENS + 8)
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import prompt_text

    tok = AutoTokenizer.from_pretrained(ckpt)
    text_prompts = [prompt_text(tok, m) for m in prompts]
    args.probe_prompt = prompt_text(tok, [{"role": "user", "content": PROBE_MESSAGE}])
    plan = plan_requests(args.requests, args.aborts, [e.split("=", 1)[0] for e in loras], args.seed)

    log_path = out / "server.log"
    proc, log, url, cmd = launch(ckpt, loras, spec and json.dumps(spec), log_path)

    def interrupted(signum, frame):
        # Stop the server first (its streams then end at once), then unwind to the finally.
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        raise KeyboardInterrupt(f"signal {signum}")

    # Explicitly: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    print(f"server: {' '.join(cmd)}", flush=True)
    res: dict = {}
    health = (None, False)
    try:
        wait_healthy(proc, log_path, url, deadline)
        startup = time.monotonic() - started
        print(f"healthy after {startup:.0f} s; soak of {len(plan)} requests", flush=True)
        try:
            asyncio.run(soak(url, proc.pid, args, plan, prompts, text_prompts, deadline, res))
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 (recorded; fails the run)
            res["error"] = f"{type(e).__name__}: {e}"
            print(f"soak aborted: {res['error']}", flush=True)
        try:
            health = (http_get(f"{url}/health")[0], proc.poll() is None)
        except OSError as e:
            health = (f"{type(e).__name__}: {e}", proc.poll() is None)
    finally:
        # What the server logged while serving (vLLM 0.32 may log an output-handler
        # traceback while it tears the engine down after SIGINT).
        log_text = _tail(log_path, 1 << 30)
        code = stop(proc, log)
    summary = summarize(res, args, health, log_text)
    summary["server_exit_code"] = code
    if "error" in res:
        summary["passed"] = False
        summary["fail_reasons"].append(f"soak error: {res['error']}")
    meta = {
        "machine": describe_machine(),
        "server": f"`vllm serve` {ckpt.name} fp32, eager, speculative config {json.dumps(spec)}, "
        f"LoRA modules {', '.join(e.split('=', 1)[0] for e in loras) or 'none'}",
        "prompts": source,
        "command": " ".join(sys.argv),
        "server_command": cmd,
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    report = {
        **meta,
        **summary,
        "rss_by_process": res.get("rss_by_process", []),
        "records": res.get("records", []),
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "soak.md").write_text(markdown(summary, meta))

    d = summary["metrics_delta"] or {}
    print(f"{meta['machine']}")
    print(
        f"requests {summary['requests_sent']}/{args.requests} at concurrency {args.concurrency}: "
        f"{summary['requests_failed']} failed, {summary['hung_up']} hung up, "
        f"{summary['soak_seconds']} s, {summary['requests_per_second']} req/s"
    )
    print(
        f"health {summary['health_after']}, left running {summary['requests_left_running']}, "
        f"probe same {summary['probe_same']}, server exit {code}"
    )
    print(
        f"RSS {summary['rss_mib_first']} -> {summary['rss_mib_last']} MiB, slope "
        f"{summary['rss_slope_mib_per_100']} MiB/100 req over {summary['rss_window_requests']}"
    )
    print(
        f"drafts {d.get('drafts')}, accepted {d.get('accepted_tokens')} "
        f"({summary['accepted_per_draft']} per draft)"
    )
    for f in summary["failures"][:5]:
        print(f"  failed: {f}")
    print("PASS" if summary["passed"] else "FAIL: " + "; ".join(summary["fail_reasons"]))
    print(f"written: {out / 'soak.json'}, {out / 'soak.md'}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
