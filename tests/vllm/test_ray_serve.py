"""Ray Serve: a specstream checkpoint served by 2 vLLM replicas behind one OpenAI endpoint.

Ray starts once and the application deploys once (module fixture); while it deploys, a
single vLLM engine with the same speculative config computes the reference outputs in a
subprocess. Checked: concurrent requests are served by both replicas, each computing on
its own core with specstream speculation; greedy outputs equal the single engine's, over
HTTP and through Ray Data batch inference over a JSONL; Ray shuts down leaving no process.
Without an engine: the deployment settings derived for CPUs and for GPUs (vLLM's Ray executor).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
from engine_child import CHILD
from helpers import free_port


def e2e(test):
    """Marks of the end-to-end tests (they share one Ray start and deployment)."""
    return pytest.mark.engine(pytest.mark.model(test))


K = 3
APP = "specstream"
WORDS = ["select", "name", "from", "table", "where", "id", "count", "order", "by", "limit"]


def make_requests(n: int) -> list[dict]:
    import random

    rng = random.Random(7)
    return [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 6, 20, 60]))),
            "max_tokens": rng.choice([8, 16, 32]),
        }
        for _ in range(n)
    ]


def complete(url: str, request: dict) -> dict:
    body = {"model": APP, "temperature": 0, "return_token_ids": True, **request}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def replica_infos(handle, want: int, tries: int = 60) -> dict[str, dict]:
    """``replica_info`` of every replica: calls land on a random replica, so ask until all
    ``want`` have answered (or ``tries`` calls)."""
    infos: dict[str, dict] = {}
    for _ in range(tries):
        info = handle.replica_info.remote().result(timeout_s=60)
        infos[info["replica_id"]] = info
        if len(infos) == want:
            break
    return infos


@pytest.fixture(scope="module")
def ray_run(tiny_merged, tmp_path_factory):
    """Deploy 2 replicas, query them over HTTP and with Ray Data, shut Ray down; return
    what happened (the checks are the tests below)."""
    tmp = tmp_path_factory.mktemp("ray")
    http_requests, batch_requests = make_requests(24), make_requests(40)[24:]
    log = tmp / "reference.log"
    args = {"ckpt": str(tiny_merged), "k": K, "requests": http_requests + batch_requests}
    with open(log, "w") as log_file:
        # Runs beside the deployment (the CPU is shared; the reference is one engine).
        reference = subprocess.Popen(
            [sys.executable, CHILD, "reference", json.dumps(args)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        # The replicas choose their cores where the user chose no binding (checked below),
        # not under the suite's one-thread default (tests/conftest.py). Ray runs its workers
        # at nice 15: beside the other test files' engines the replicas took 5-8 min to start.
        with mock.patch.dict(os.environ, {"RAY_worker_niceness": "0"}):
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            out = serve_and_query(tiny_merged, tmp, http_requests, batch_requests, reference.pid)
        reference.wait(timeout=600)
    finally:
        if reference.poll() is None:
            reference.kill()
    assert reference.returncode == 0, log.read_text()[-6000:]
    line = next(x for x in log.read_text().splitlines() if x.startswith("RESULT "))
    tokens = json.loads(line[len("RESULT ") :])
    out["reference_http"], out["reference_batch"] = tokens[:24], tokens[24:]
    out["http_requests"], out["batch_requests"] = http_requests, batch_requests
    print(f"Ray: deployed in {out['deploy_s']:.0f} s, queries took {out['query_s']:.0f} s")
    return out


def descendants(exclude_tree: int) -> list:
    """This process's descendants, without the tree of process ``exclude_tree`` and the
    engine tests' fork server (this test session's, not Ray's)."""
    import psutil
    from engine_child import ForkServer

    server = ForkServer._shared
    excluded = {exclude_tree} | ({server.process.pid} if server is not None else set())
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if not excluded & ({p.pid} | {q.pid for q in p.parents()}):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def serve_and_query(checkpoint, tmp, http_requests, batch_requests, reference_pid) -> dict:
    import psutil
    import ray
    from ray import serve

    from vllm_specstream.ray.data import BatchConfig, generate_jsonl, serve_processor
    from vllm_specstream.ray.serve import SpecStreamServeConfig, build_app, server_deployment_name

    config = SpecStreamServeConfig(
        checkpoint,
        num_replicas=2,
        num_speculative_tokens=K,
        max_model_len=512,
        kv_cache_bytes=256 << 20,
    )
    out: dict = {}
    start = time.monotonic()
    # Each replica reserves one of the 2 cores; Ray Data's tasks and actors only wait on
    # the replicas but still need Ray CPUs of their own. Serve's proxy must answer its
    # readiness checks in 5 s by default, which a machine busy starting engines (the
    # reference here, other test files' beside it) misses: its processes get longer.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=APP, route_prefix="/")
        out["deploy_s"] = time.monotonic() - start
        url = f"http://127.0.0.1:{port}"
        with ThreadPoolExecutor(len(http_requests)) as pool:
            out["http"] = list(pool.map(lambda r: complete(url, r), http_requests))
        handle = serve.get_deployment_handle(server_deployment_name(config), app_name=APP)
        out["after_http"] = replica_infos(handle, config.num_replicas)

        jsonl = tmp / "prompts.jsonl"
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in batch_requests))
        ray.data.DataContext.get_current().enable_progress_bars = False
        processor = serve_processor(config, BatchConfig(batch_size=8), app_name=APP)
        out["batch_written"] = generate_jsonl(processor, jsonl, tmp / "out.jsonl")
        out["batch"] = [json.loads(x) for x in (tmp / "out.jsonl").read_text().splitlines()]
        out["after_batch"] = replica_infos(handle, config.num_replicas)
        out["query_s"] = time.monotonic() - start - out["deploy_s"]
    finally:
        # Everything Ray started descends from this process (raylet, GCS, workers,
        # replicas and their vLLM engine processes), beside the reference engine's tree.
        started = descendants(exclude_tree=reference_pid)
        serve.shutdown()
        ray.shutdown()
    _, alive = psutil.wait_procs(started, timeout=60)
    out["ray_processes"] = len(started)
    out["left_running"] = {p.pid: p.cmdline() for p in alive if p.is_running()}
    return out


@e2e
def test_requests_spread_over_both_replicas(ray_run):
    infos = ray_run["after_http"]
    assert len(infos) == 2, infos
    served = [i["served"] for i in infos.values()]
    assert min(served) >= 1 and sum(served) == len(ray_run["http_requests"]), infos
    assert len({i["pid"] for i in infos.values()}) == 2, infos
    # Each replica's engine computes on a core of its own (where this process may use two).
    binds = {i["omp_bind"] for i in infos.values()}
    assert {int(b) for b in binds} <= os.sched_getaffinity(0), infos
    assert len(binds) == min(2, len(os.sched_getaffinity(0))), infos
    for info in infos.values():
        assert info["plugin_loaded"], info  # the entry point ran in the replica process
        assert info["speculative_config"] == {
            "method": "custom_class",
            "model": "vllm_specstream.model_executor.proposer.SpecStreamProposer",
            "num_speculative_tokens": K,
        }, info


@e2e
def test_greedy_outputs_equal_single_engine(ray_run):
    got = [r["choices"][0]["token_ids"] for r in ray_run["http"]]
    assert all(got) and got == ray_run["reference_http"]


@e2e
def test_ray_data_batch_through_the_replicas(ray_run):
    requests, rows = ray_run["batch_requests"], ray_run["batch"]
    assert ray_run["batch_written"] == len(requests)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in requests]  # input order
    assert [r["generated_tokens"] for r in rows] == ray_run["reference_batch"]
    before, after = ray_run["after_http"], ray_run["after_batch"]
    assert sum(i["served"] for i in after.values()) - sum(
        i["served"] for i in before.values()
    ) == len(requests)


@e2e
def test_ray_shutdown_leaves_no_process(ray_run):
    assert ray_run["ray_processes"] > 4  # the check saw Ray's processes at all
    assert not ray_run["left_running"], ray_run["left_running"]


def test_deployment_config_cpu_and_gpu(tmp_path):
    """CPU: vLLM's mp executor, one CPU bundle, a fixed KV cache, float32; GPUs: vLLM's Ray
    executor with one GPU bundle per tensor-parallel rank. Both: the specstream proposer with
    the checkpoint's stream count."""
    from vllm_specstream import speculative_config
    from vllm_specstream.ray.serve import SpecStreamServeConfig, llm_config

    (tmp_path / "config.json").write_text(json.dumps({"specstream": {"num_streams": 4}}))
    config = SpecStreamServeConfig(tmp_path, num_replicas=3, kv_cache_bytes=1 << 28)
    cpu = llm_config(config, cpu=True)
    args = cpu.get_engine_config().get_initialization_kwargs()
    assert args["distributed_executor_backend"] == "mp"
    assert args["speculative_config"] == speculative_config(4)
    assert (args["dtype"], args["kv_cache_memory_bytes"]) == ("float32", 1 << 28)
    assert cpu.get_engine_config().placement_bundles == [{"CPU": 1.0}]
    assert cpu.deployment_config["num_replicas"] == 3

    config.tensor_parallel_size, config.num_speculative_tokens = 2, 2
    gpu = llm_config(config, cpu=False).get_engine_config()
    args = gpu.get_initialization_kwargs()
    assert args["distributed_executor_backend"] == "ray"
    assert args["speculative_config"] == speculative_config(2)
    assert "kv_cache_memory_bytes" not in args and args["tensor_parallel_size"] == 2
    assert gpu.placement_bundles == [{"GPU": 1}, {"GPU": 1}]

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="num_streams"):
        llm_config(SpecStreamServeConfig(tmp_path), cpu=True)


def test_replica_cores():
    from vllm_specstream.ray.serve import replica_cores

    assert [replica_cores(r, [0, 1], 1) for r in range(3)] == [[0], [1], [0]]
    assert [replica_cores(r, [2, 3, 4, 5], 2) for r in range(2)] == [[2, 3], [4, 5]]
    assert replica_cores(0, [0], 4) == [0]
