"""A specstream checkpoint served by N vLLM replicas with Ray Serve, behind one OpenAI endpoint.

Deploys the checkpoint (``vllm_specstream.ray.serve.build_app``), asks ``-n`` questions of the
built-in SQL test split at once (greedy, ``/v1/chat/completions``), prints the answers and how
many requests each replica served; optionally runs Ray Data batch
inference over a JSONL of ``{"prompt": ...}`` records through the replicas, or keeps serving
until Ctrl-C. ``--batch-engines`` runs the JSONL as a Ray Data job with engines of its own.

    .venv/bin/specstream export examples/adapters/sql-smollm2-ss4 runs/sql-ss4-merged
    .venv/bin/python examples/ray_serve.py runs/sql-ss4-merged --replicas 2
    .venv/bin/python examples/ray_serve.py runs/sql-ss4-merged --jsonl prompts.jsonl --out out.jsonl
    .venv/bin/python examples/ray_serve.py runs/sql-ss4-merged --keep-serving   # then:
    curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "specstream", "prompt": "SELECT", "max_tokens": 32, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="merged specstream checkpoint (specstream export)")
    p.add_argument("--replicas", type=int, default=2, help="vLLM engines (default 2)")
    p.add_argument("--k", type=int, help="drafts per step (default: the checkpoint's streams)")
    p.add_argument("--placement", choices=["accepted", "window"], help="where streams run")
    p.add_argument(
        "--dtype", help="vLLM dtype (default: float32 on CPUs, the checkpoint's on GPUs)"
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache per replica (CPU)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="cores per replica (CPU)")
    p.add_argument("-n", type=int, default=8, help="SQL test questions to ask (default 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the endpoint")
    p.add_argument("--address", help="Ray cluster to join (default: start one here)")
    p.add_argument("--jsonl", help="Ray Data batch inference over this JSONL of prompts")
    p.add_argument("--out", default="ray_batch_out.jsonl", help="where --jsonl results go")
    p.add_argument(
        "--batch-engines",
        action="store_true",
        help="run --jsonl as a Ray Data job with its own engines (no Serve application)",
    )
    p.add_argument("--keep-serving", action="store_true", help="serve until Ctrl-C")
    return p.parse_args(argv)


def chat(url: str, messages: list[dict], max_tokens: int) -> str:
    body = {"model": "specstream", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def serve_and_query(args: argparse.Namespace, config) -> None:
    from ray import serve

    from vllm_specstream.ray.data import BatchConfig, generate_jsonl, serve_processor
    from vllm_specstream.ray.serve import build_app, server_deployment_name
    from vllm_specstream.training.tasks import build_task, to_example

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    start = time.perf_counter()
    serve.run(build_app(config), name="specstream", route_prefix="/")
    print(f"{args.replicas} replicas deployed in {time.perf_counter() - start:.0f} s")
    url = f"http://127.0.0.1:{args.port}"
    records = build_task("sql", "test", n=args.n)
    conversations = [to_example("sql", r).messages for r in records]
    with ThreadPoolExecutor(max(1, len(conversations))) as pool:
        answers = list(pool.map(lambda m: chat(url, m, args.max_tokens), conversations))
    for record, answer in zip(records, answers):
        print(f"{record['question']}\n  -> {answer.strip()}")
    handle = serve.get_deployment_handle(server_deployment_name(config), "specstream")
    replicas: dict[str, dict] = {}
    for _ in range(20 * args.replicas):  # calls land on random replicas
        info = handle.replica_info.remote().result()
        replicas[info["replica_id"]] = info
        if len(replicas) == args.replicas:
            break
    for info in replicas.values():
        print(
            f"replica {info['replica_id']} (pid {info['pid']}, cores {info['omp_bind']}): "
            f"{info['served']} requests"
        )
    if args.jsonl:
        processor = serve_processor(config, BatchConfig(args.max_tokens), app_name="specstream")
        n = generate_jsonl(processor, args.jsonl, args.out)
        print(f"Ray Data: {n} records -> {args.out}")
    if args.keep_serving:
        print(f"Serving on {url}/v1 (model 'specstream'); Ctrl-C stops")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray
    from ray import serve

    from vllm_specstream.ray.data import BatchConfig, engine_processor, generate_jsonl
    from vllm_specstream.ray.serve import SpecStreamServeConfig

    config = SpecStreamServeConfig(
        args.checkpoint,
        num_replicas=args.replicas,
        num_speculative_tokens=args.k,
        specstream={"placement": args.placement} if args.placement else {},
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_bytes=int(args.kv_cache_gib * 2**30),
        cpus_per_replica=args.cpus_per_replica,
    )
    if args.address:
        ray.init(address=args.address)
    else:
        # Replicas reserve their cores; Ray Data's tasks need Ray CPUs beside them.
        ray.init(num_cpus=int(args.replicas * args.cpus_per_replica) + 2)
    try:
        if args.batch_engines:
            if not args.jsonl:
                raise SystemExit("--batch-engines needs --jsonl")
            processor = engine_processor(config, BatchConfig(args.max_tokens))
            n = generate_jsonl(processor, args.jsonl, args.out)
            print(f"Ray Data: {n} records -> {args.out}")
        else:
            serve_and_query(args, config)
    finally:
        if args.address and not args.batch_engines:
            serve.delete("specstream")  # leave the cluster's other applications alone
        elif not args.address:
            serve.shutdown()
            ray.shutdown()
    return 0


if __name__ == "__main__":  # Ray and vLLM start processes: keep the entry point guarded
    raise SystemExit(main())
