"""``benchmarks/scale_out.py``: the concurrent load and its report, against a stub endpoint."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from helpers import load_benchmark


class Stub(BaseHTTPRequestHandler):
    """An OpenAI completions endpoint that answers a prompt with its words reversed."""

    seen: list[str] = []
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.seen.append(body["prompt"])
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        threading.Event().wait(0.02)
        words = body["prompt"].split()[::-1][: body["max_tokens"]]
        reply = {"choices": [{"text": " ".join(words)}], "usage": {"completion_tokens": len(words)}}
        with cls.lock:
            cls.in_flight -= 1
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_load_sends_each_prompt_once_with_the_clients_in_flight_and_counts_their_tokens():
    scale_out = load_benchmark("scale_out")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prompts = [" ".join(f"w{i}_{j}" for j in range(i % 5 + 1)) for i in range(20)]
    try:
        out = scale_out.load(f"http://127.0.0.1:{server.server_port}", prompts, 4, 3)
    finally:
        server.shutdown()
    assert sorted(Stub.seen) == sorted(prompts)
    assert Stub.most_in_flight == 4
    assert out["texts"] == [" ".join(p.split()[::-1][:3]) for p in prompts]  # prompt order
    assert out["output_tokens"] == sum(min(3, i % 5 + 1) for i in range(20))
    assert out["wall_s"] >= 0.1  # 20 requests of 20 ms, 4 at a time


def test_the_table_gives_each_deployment_against_one_plain_replica():
    scale_out = load_benchmark("scale_out")
    row = {"requests_per_s": 1.0, "latency_median_s": 1, "latency_p90_s": 2, "wall_s": 10.0}
    report = {
        "machine": "m",
        "load": "l",
        "same_text": True,
        "replicas": [
            {**row, "name": "1-plain", "scale": 1, "mode": "plain", "tokens_per_s": 100.0,
             "served": {"a": 8}, "cpu_s": {"engine_core": 9.0, "worker": 0.0, "serving": 2.0}},
            {**row, "name": "2-specstream", "scale": 2, "mode": "specstream", "tokens_per_s": 150.0,
             "served": {"a": 3, "b": 5}, "cpu_s": {"engine_core": 4.0, "worker": 14.0, "serving": 1.0}},
        ],
    }  # fmt: skip
    lines = scale_out.table(report).splitlines()
    assert "| 2 | specstream | 1.00 | 150 | 1.50 | 1 | 2 | 3/5 | 1.80 + 0.10 |" in lines
    assert "| 1 | plain | 1.00 | 100 | 1.00 | 1 | 2 | 8 | 0.90 + 0.20 |" in lines
