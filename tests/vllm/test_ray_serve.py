"""Ray Serve: a specstream checkpoint served by 2 vLLM replicas on 2 Ray nodes behind one
OpenAI endpoint.

A Ray cluster of two nodes starts once on this machine (``ray.cluster_utils.Cluster``: a
head and a worker node, each its own raylet) and the application deploys once (module
fixture), one replica per node; while it deploys, a single vLLM engine with the same
speculative config computes the reference outputs in a subprocess. Checked: concurrent
requests are served by both replicas, each on its own node and core with specstream
speculation; greedy outputs equal the single engine's, over HTTP and through Ray Data batch
inference over a JSONL; when the worker node dies, the requests it was serving end with an
HTTP error instead of hanging, the head node's replica serves on and Serve reports the
deployment's state; Ray shuts down leaving no process. Without an engine: the deployment
settings derived for CPUs and for GPUs (vLLM's Ray executor).
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


def complete(url: str, request: dict, timeout: float = 300) -> dict:
    body = {"model": APP, "temperature": 0, "return_token_ids": True, **request}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def outcome(url: str, request: dict, timeout: float) -> dict:
    """How a request ended: its tokens, an HTTP error's status, or another error (a
    timeout: the request hung)."""
    import urllib.error

    start = time.monotonic()
    try:
        tokens = complete(url, request, timeout)["choices"][0]["token_ids"]
        out = {"ok": len(tokens)}
    except urllib.error.HTTPError as e:
        out = {"http_error": e.code}
    except Exception as e:  # noqa: BLE001 (recorded: the test says which)
        out = {"error": f"{type(e).__name__}: {e}"}
    return {**out, "seconds": round(time.monotonic() - start, 1)}


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
    print(f"Worker node killed: in flight {out['in_flight']}, after {out['after_kill']}, ")
    print(f"Serve: {out['deployment_status']} {out['replica_states']}")
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
    from ray.cluster_utils import Cluster

    from vllm_specstream.ray.data import BatchConfig, generate_jsonl, serve_processor
    from vllm_specstream.ray.serve import SpecStreamServeConfig, build_app, server_deployment_name

    config = SpecStreamServeConfig(
        checkpoint,
        num_replicas=2,
        num_speculative_tokens=K,
        max_model_len=512,
        kv_cache_bytes=256 << 20,
        replica_resources={"replica_slot": 1},  # one per node
        # The ingress on the head node, beside Serve's controller and HTTP proxy: the
        # endpoint outlives the worker node.
        ingress_actor_options={"resources": {"node:__internal_head__": 0.001}},
    )
    out: dict = {}
    start = time.monotonic()
    # Each replica reserves one of the 2 cores; Ray Data's tasks and actors only wait on
    # the replicas but still need Ray CPUs of their own. Serve's proxy must answer its
    # readiness checks in 5 s by default, which a machine busy starting engines (the
    # reference here, other test files' beside it) misses: its processes get longer.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    node = {"num_cpus": 2, "resources": {"replica_slot": 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    worker_node = cluster.add_node(**node)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    out["nodes"] = {"head": cluster.head_node.node_id, "worker": worker_node.node_id}
    try:
        port = free_port()
        # One HTTP proxy, on the head node (the nodes share this host and its ports).
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
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
        out.update(kill_worker_node(cluster, worker_node, url, handle, out["after_batch"]))
    finally:
        # Everything Ray started descends from this process (raylets, GCS, workers,
        # replicas and their vLLM engine processes), beside the reference engine's tree.
        started = descendants(exclude_tree=reference_pid)
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    _, alive = psutil.wait_procs(started, timeout=60)
    out["ray_processes"] = len(started)
    out["left_running"] = {p.pid: p.cmdline() for p in alive if p.is_running()}
    return out


IN_FLIGHT = 6
LONG = 480  # tokens: within max_model_len 512


def kill_worker_node(cluster, worker_node, url: str, handle, infos: dict) -> dict:
    """Long requests in flight on both replicas, then the worker node's processes killed:
    how each request ended, what the surviving replica served, and Serve's status."""
    from ray import serve

    long = {"prompt": "select name from table where", "max_tokens": LONG, "ignore_eos": True}
    survivor = next(i for i in infos.values() if i["node_id"] != worker_node.node_id)
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        pending = [pool.submit(outcome, url, long, 240) for _ in range(IN_FLIGHT)]
        time.sleep(2)  # every request admitted and decoding (each takes ~10 s)
        cluster.remove_node(worker_node, allow_graceful=False)
        in_flight = [f.result() for f in pending]
    after = [outcome(url, r, 240) for r in make_requests(4)]
    survivor_now = replica_infos(handle, 1, tries=8)
    # The controller notices the dead replica at its next health check (every 10 s), later
    # than the router stops sending to it.
    deadline = time.monotonic() + 90
    while True:
        deployment = serve.status().applications[APP].deployments[handle.deployment_name]
        states = {str(k): v for k, v in deployment.replica_states.items()}
        if states.get("RUNNING") != 2 or time.monotonic() > deadline:
            break
        time.sleep(2)
    return {
        "in_flight": in_flight,
        "after_kill": after,
        "survivor_before": survivor,
        "survivor_after": survivor_now.get(survivor["replica_id"]),
        "replicas_after": list(survivor_now),
        "deployment_status": str(deployment.status),
        "replica_states": states,
    }


@e2e
def test_requests_spread_over_both_replicas(ray_run):
    infos = ray_run["after_http"]
    assert len(infos) == 2, infos
    served = [i["served"] for i in infos.values()]
    assert min(served) >= 1 and sum(served) == len(ray_run["http_requests"]), infos
    assert len({i["pid"] for i in infos.values()}) == 2, infos
    # One replica per Ray node: the head's and the worker's.
    assert {i["node_id"] for i in infos.values()} == set(ray_run["nodes"].values()), infos
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
def test_a_dead_node_fails_its_requests_and_the_other_replica_serves_on(ray_run):
    survivor, before = ray_run["survivor_after"], ray_run["survivor_before"]
    assert survivor is not None and ray_run["replicas_after"] == [before["replica_id"]], ray_run
    # The survivor's requests finished; the dead replica's ended in an HTTP error (none hung).
    in_flight = ray_run["in_flight"]
    finished = [r for r in in_flight if "ok" in r]
    failed = [r for r in in_flight if "http_error" in r]
    assert len(finished) + len(failed) == IN_FLIGHT, in_flight
    assert all(r["ok"] == LONG for r in finished), in_flight
    assert failed and all(r["http_error"] >= 500 for r in failed), in_flight
    # The endpoint serves on, through the head node's replica.
    assert all(r.get("ok") for r in ray_run["after_kill"]), ray_run["after_kill"]
    assert survivor["served"] - before["served"] == len(finished) + len(ray_run["after_kill"])
    # Serve reports the deployment short of a replica: one running, one it cannot place.
    assert ray_run["replica_states"].get("RUNNING") == 1, ray_run["replica_states"]
    assert ray_run["deployment_status"] != "HEALTHY" or sum(ray_run["replica_states"].values()) == 1


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


def test_replicas_of_nodes_sharing_a_host_claim_different_cores(tmp_path):
    from vllm_specstream.ray.serve import claim_cores

    # Two Ray nodes on one host each number their replica 0.
    first, lock_first = claim_cores(0, [0, 1], 1, tmp_path)
    second, lock_second = claim_cores(0, [0, 1], 1, tmp_path)
    assert (first, second) == ([0], [1])
    third, lock_third = claim_cores(0, [0, 1], 1, tmp_path)
    assert third == [0] and lock_third is None  # every core held: its own block, shared
    lock_first.close()  # that replica's process ended
    assert claim_cores(1, [0, 1], 1, tmp_path)[0] == [0]
    lock_second.close()


def test_replica_cores():
    from vllm_specstream.ray.serve import replica_cores

    assert [replica_cores(r, [0, 1], 1) for r in range(3)] == [[0], [1], [0]]
    assert [replica_cores(r, [2, 3, 4, 5], 2) for r in range(2)] == [[2, 3], [4, 5]]
    assert replica_cores(0, [0], 4) == [0]
