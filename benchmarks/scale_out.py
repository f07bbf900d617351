"""Throughput by scale-out on one machine: Ray Serve replicas, and tensor parallelism.

Replicas: a merged checkpoint served by ``vllm_specstream.ray.serve`` (the defaults of
``SpecStreamServeConfig``) with 1 and with 2 replicas of one core each, speculation off and
on. Each deployment runs in a child process of its own (a fresh Ray instance), is warmed up
with one request per client, then ``--clients`` threads send the same ``-n`` task prompts
(greedy, ``--max-tokens``) over HTTP to the one endpoint. Reported: requests/s and output
tokens/s from the first send to the last reply, each request's latency, the requests each
replica served, and whether every deployment answered every prompt with the same text. The
1-replica plain deployment runs first and again last: the second is the noise floor.

Tensor parallelism: one offline engine (``LLM``) of a random-weight Llama-3.2-1B-shaped
checkpoint (``scaling.py``'s: its 32 heads split over 2 ranks, the embedded SmolLM2's 9 do
not) at TP 1 with its threads on both cores and at TP 2 with one rank per core, plain and
drafting ``--k`` tokens every step (random streams accept little: the cost of the step is
what TP changes), the same ``--clients`` prompts at once, ``--max-tokens`` each (EOS ignored).

    .venv/bin/python benchmarks/scale_out.py CKPT [--task e2e --data ../shared/data/e2e/devset.csv]
        [-n 96] [--clients 8] [--max-tokens 64] [--parts replicas,tp] [--out runs/scale-out]

Writes OUT/scale_out.json, OUT/scale_out.md and OUT/scale_out.png. Measure with nothing
else running.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = "RESULT "
#: The model name clients send.
MODEL_ID = "specstream"
#: The TP part's shape (scaling.py's SHAPES).
TP_SHAPE = "llama-3.2-1b"


def complete(url: str, prompt: str, max_tokens: int, timeout: float = 900) -> dict:
    """One greedy completion over HTTP: its text, output tokens and seconds."""
    import urllib.request

    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as r:
        reply = json.loads(r.read())
    return {
        "text": reply["choices"][0]["text"],
        "tokens": reply["usage"]["completion_tokens"],
        "seconds": time.perf_counter() - start,
    }


def load(url: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """``prompts`` sent by ``clients`` threads, each taking the next prompt when its last
    reply came: the same concurrent load for every deployment."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(lambda p: complete(url, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in replies)
    latencies = sorted(r["seconds"] for r in replies)
    return {
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(prompts) / wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "output_tokens": tokens,
        "latency_median_s": round(statistics.median(latencies), 2),
        "latency_p90_s": round(latencies[int(0.9 * (len(latencies) - 1))], 2),
        "texts": [r["text"] for r in replies],
    }


def run_replicas(job: dict) -> dict:
    """One deployment (``job``: checkpoint, replicas, spec, prompts, clients, max_tokens)
    under the load; in its own process."""
    import ray
    from ray import serve
    from soak import free_port

    from vllm_specstream.ray.serve import (
        SpecStreamServeConfig,
        build_app,
        server_deployment_name,
    )

    config = SpecStreamServeConfig(
        job["checkpoint"],
        num_replicas=job["replicas"],
        model_id=MODEL_ID,
        engine_kwargs={} if job["spec"] else {"speculative_config": None},
    )
    start = time.perf_counter()
    ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name="scale-out", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deployed = time.perf_counter() - start
        prompts, clients = job["prompts"], job["clients"]
        load(url, prompts[:clients], clients, 8)  # every replica warmed up
        handle = serve.get_deployment_handle(server_deployment_name(config), app_name="scale-out")
        before, spec = replica_reports(handle, job["replicas"])
        cpu_before = cpu_seconds()
        out = load(url, prompts, clients, job["max_tokens"])
        cpu = {k: round(v - cpu_before.get(k, 0.0), 1) for k, v in cpu_seconds().items()}
        after, _ = replica_reports(handle, job["replicas"])
        served = {replica: after[replica] - before.get(replica, 0) for replica in after}
        return {**out, "deploy_s": round(deployed, 1), "served": served, "speculative": spec,
                "cpu_s": cpu}  # fmt: skip
    finally:
        serve.shutdown()
        ray.shutdown()


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process's tree: vLLM's engine-core
    processes (the scheduler; the model too under the one-process executor), their
    worker processes (the model, under the multiprocessing executor) and everything else
    (Ray, Serve's proxy and ingress, the replicas' OpenAI front-ends, the clients)."""
    import psutil

    totals = {"engine_core": 0.0, "worker": 0.0, "serving": 0.0}
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            name, times = proc.name(), proc.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        kind = (
            "engine_core" if name.startswith("VLLM::EngineCor")  # the kernel's 15 characters
            else "worker" if name.startswith("VLLM::Worker")
            else "serving"
        )  # fmt: skip
        totals[kind] += times.user + times.system
    return totals


def replica_reports(handle, replicas: int) -> tuple[dict[str, int], dict | None]:
    """Requests each replica has served, and the engines' speculative config."""
    served: dict[str, int] = {}
    spec = None
    for _ in range(50):  # calls land on a random replica: ask until each has answered
        info = handle.replica_info.remote().result(timeout_s=60)
        served[info["replica_id"]] = info["served"]
        spec = info["speculative_config"]
        if len(served) == replicas:
            break
    return served, spec


def run_tp(job: dict) -> dict:
    """One offline engine (``job``: checkpoint, tp, k, prompts, max_tokens); in its own
    process, its binding set before vLLM starts."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (
        "|".join(map(str, cores)) if job["tp"] > 1 else ",".join(map(str, cores))
    )
    from vllm import LLM, SamplingParams

    from vllm_specstream import speculative_config
    from vllm_specstream.patches.cpu_env import cpu_engine_kwargs

    spec = speculative_config(job["k"], adaptive=False) if job["k"] else None
    llm = LLM(
        job["checkpoint"],
        tensor_parallel_size=job["tp"],
        speculative_config=spec,
        disable_log_stats=False,
        **cpu_engine_kwargs(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=1 << 30),
    )
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    llm.generate(job["prompts"], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    steps_before = _decode_steps(llm)
    start = time.perf_counter()
    outs = llm.generate(job["prompts"], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = _decode_steps(llm) - steps_before
    return {
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "output_tokens": tokens,
        "tokens_per_step": round(tokens / steps, 2) if steps else None,
    }


def _decode_steps(llm) -> int:
    """Request steps that verified drafts so far (vLLM's spec-decode metric; 0 where nothing
    drafts): output tokens over them are the tokens per step."""
    from vllm.v1.metrics.reader import Counter

    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts" and isinstance(metric, Counter):
            return metric.value
    return 0


def child(job: dict) -> dict:
    """Run ``job`` in a fresh process (its own Ray instance or engine) and return its report."""
    cmd = [sys.executable, __file__, "--job", json.dumps(job)]
    env = {**os.environ, "RAY_worker_niceness": "0", "VLLM_CONFIGURE_LOGGING": "0"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
    if proc.returncode or line is None:
        sys.exit(f"{job['name']} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(line[len(RESULT) :])


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("replicas", "tp") if report.get(p)]
    fig, axes = plt.subplots(1, len(parts), figsize=(4.8 * len(parts), 3.6), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        rows = [r for r in report[part] if not r["name"].endswith("again")]
        groups = sorted({r["scale"] for r in rows})
        names = {"plain": "plain", "specstream": "specstream"}
        if part == "tp":
            names["specstream"] = "drafting k every step (random streams)"
        for i, mode in enumerate(names):
            values = [
                next(r["tokens_per_s"] for r in rows if r["scale"] == g and r["mode"] == mode)
                for g in groups
            ]
            x = [g + (i - 0.5) * 0.36 for g in range(len(groups))]
            ax.bar_label(ax.bar(x, values, 0.36, label=names[mode]), fmt="%.0f", fontsize=8)
        if part == "replicas":
            title, label = "trained E2E adapter, concurrent clients", "replicas (one core each)"
        else:
            title, label = f"{TP_SHAPE} shape, one batch", "tensor parallel ranks (2 cores)"
        ax.set_title(title, fontsize=9)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room for the legend
        ax.set_xticks(range(len(groups)), [str(g) for g in groups])
        ax.set(xlabel=label, ylabel="output tokens/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(report: dict) -> str:
    lines = [report["machine"], ""]
    if report.get("replicas"):
        base = report["replicas"][0]
        lines += [
            f"Ray Serve replicas: {report['load']}.",
            "",
            "| replicas | speculation | requests/s | output tokens/s | x 1 plain replica "
            "| median latency s | p90 s | requests per replica | cores busy: engines + serving |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["replicas"]:
            name = f"{r['scale']}" + (
                " (again: noise floor)" if r["name"].endswith("again") else ""
            )
            lines.append(
                f"| {name} | {r['mode']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.0f} "
                f"| {r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['latency_median_s']} "
                f"| {r['latency_p90_s']} | {'/'.join(map(str, sorted(r['served'].values())))} "
                f"| {(sum(r['cpu_s'].values()) - r['cpu_s']['serving']) / r['wall_s']:.2f} + "
                f"{r['cpu_s']['serving'] / r['wall_s']:.2f} |"
            )
        lines += ["", f"Same text for every prompt in every deployment: {report['same_text']}.", ""]
    if report.get("tp"):
        lines += [
            f"{report['tp_load']}",
            "",
            "| ranks | speculation | output tokens/s | x TP 1 | tokens per step |",
            "|---|---|---|---|---|",
        ]
        for r in report["tp"]:
            one = next(x for x in report["tp"] if x["mode"] == r["mode"] and x["scale"] == 1)
            name = f"TP {r['scale']}" + (
                " (again: noise floor)" if r["name"].endswith("again") else ""
            )
            lines.append(
                f"| {name} | {r['mode']} | {r['tokens_per_s']:.0f} "
                f"| {r['tokens_per_s'] / one['tokens_per_s']:.2f} | {r['tokens_per_step'] or 1} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", help="merged specstream checkpoint (replicas part)")
    ap.add_argument("--task", default="e2e", help="task of the prompts (sql, e2e, dialogsum)")
    ap.add_argument("--data", help="task file whose --split gives the prompts (else built-in)")
    ap.add_argument("--split", default="all")
    ap.add_argument("-n", type=int, default=96, help="requests per deployment")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (and TP batch)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="TP part: drafts per step")
    ap.add_argument("--parts", default="replicas,tp", help="replicas, tp or both")
    ap.add_argument("--out", default="runs/scale-out")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        job = json.loads(args.job)
        report = run_replicas(job) if "replicas" in job else run_tp(job)
        print(RESULT + json.dumps(report), flush=True)
        return

    sys.path.insert(0, str(HERE))
    from profile_step import task_prompts_cycled
    from scaling import make_checkpoint

    from vllm_specstream.machine import describe_machine

    parts = set(args.parts.split(","))
    if parts - {"replicas", "tp"}:
        ap.error(f"--parts: unknown {sorted(parts - {'replicas', 'tp'})}; choose replicas, tp")
    if "replicas" in parts and not args.checkpoint:
        ap.error("the replicas part needs a merged checkpoint (CHECKPOINT)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "machine": describe_machine(),
        "load": f"{args.clients} concurrent clients, {args.n} {args.task} prompts, greedy, "
        f"at most {args.max_tokens} tokens, fp32, eager (SpecStreamServeConfig's defaults)",
    }
    if "replicas" in parts:
        prompts = task_prompts_cycled(args.checkpoint, args.task, args.data, args.split, args.n)
        common = {"checkpoint": str(Path(args.checkpoint).resolve()), "prompts": prompts,
                  "clients": args.clients, "max_tokens": args.max_tokens}  # fmt: skip
        rows = []
        for name, replicas, spec in (
            ("1-plain", 1, False), ("1-specstream", 1, True), ("2-plain", 2, False),
            ("2-specstream", 2, True), ("1-plain-again", 1, False),
        ):  # fmt: skip
            print(f"== replicas: {name}", flush=True)
            r = child({"name": name, "replicas": replicas, "spec": spec, **common})
            rows.append(
                {"name": name, "scale": replicas, "mode": "specstream" if spec else "plain", **r}
            )
            print(
                f"   {r['requests_per_s']:.2f} requests/s, {r['tokens_per_s']:.0f} tokens/s",
                flush=True,
            )
        report["same_text"] = all(r["texts"] == rows[0]["texts"] for r in rows)
        for r in rows:
            del r["texts"]
        report["replicas"] = rows
    if "tp" in parts:
        ckpt = make_checkpoint(TP_SHAPE, out / f"ckpt-{TP_SHAPE}")
        prompts = task_prompts_cycled(str(ckpt), args.task, args.data, args.split, args.clients)
        report["tp_load"] = (
            f"Tensor parallelism: {TP_SHAPE} shape, random weights, {args.clients} prompts at "
            f"once, {args.max_tokens} tokens each, fp32, eager; TP 1 threads on both cores, TP 2 "
            f"one rank per core; specstream drafts {args.k} every step."
        )
        rows = []
        for name, tp, k in (
            ("tp1-plain", 1, 0), ("tp1-specstream", 1, args.k), ("tp2-plain", 2, 0),
            ("tp2-specstream", 2, args.k), ("tp1-plain-again", 1, 0),
        ):  # fmt: skip
            print(f"== tensor parallelism: {name}", flush=True)
            job = {"name": name, "checkpoint": str(ckpt), "tp": tp, "k": k, "prompts": prompts,
                   "max_tokens": args.max_tokens}  # fmt: skip
            r = child(job)
            rows.append({"name": name, "scale": tp, "mode": "specstream" if k else "plain", **r})
            print(f"   {r['tokens_per_s']:.0f} tokens/s", flush=True)
        report["tp"] = rows
    (out / "scale_out.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "scale_out.md").write_text(table(report))
    plot(report, out / "scale_out.png")
    print(table(report))


if __name__ == "__main__":
    main()
