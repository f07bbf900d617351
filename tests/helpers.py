"""Helpers shared by tests."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The committed E2E adapter and the EAGLE-3 drafter trained for it.
E2E_ADAPTER = REPO / "examples" / "adapters" / "e2e-smollm2-ss4"
E2E_EAGLE3 = REPO / "examples" / "eagle3" / "e2e-smollm2-ss4"
#: Engine fields of runs whose drafts are compared with the training implementation's (or
#: the reference decoder's): the stream pass in the served fp32, as those compute it (the
#: default runs bf16 or int8 copies, whose drafts differ from fp32 ones now and then).
SAME_DRAFTS = {"stream_dtype": "model"}


def load_benchmark(name: str, register: bool = False):
    """``benchmarks/NAME.py`` as a module (the scripts there are not a package);
    ``register``: also put it in ``sys.modules`` first (dataclasses look their module up
    there), for the caller to remove. Loaded with ``benchmarks/`` on ``sys.path`` (the
    scripts import each other) and ``os.environ`` restored after (the engine scripts set
    vLLM's variables when imported)."""
    import importlib.util
    from unittest import mock

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    with (
        mock.patch.dict(os.environ),
        mock.patch.object(sys, "path", [str(REPO / "benchmarks"), *sys.path]),
    ):
        spec.loader.exec_module(module)
    return module


# Test files in the order the suite hands them to its workers: the ones that start several
# vLLM engines first, longest first (`make test` runs files on several workers without xdist's
# reordering by test count, which would leave the few-test engine files for last, where the
# longest of them runs alone while the other worker idles). Unlisted files follow, in
# collection order.
LONGEST_FIRST = (
    "vllm/test_engine_checkpoints.py",
    "vllm/test_tree_verification.py",
    "vllm/test_streams_only_serving.py",
    "vllm/test_specstream_engine.py",
    "vllm/test_lora_serving.py",
    "vllm/test_base_families.py",
    "vllm/test_ray_serve.py",
    "vllm/test_compiled_streams.py",
    "vllm/test_serve_adapters.py",
    "vllm/test_patches.py",
    "vllm/test_eagle3_serving.py",
    "vllm/test_serve.py",
    "training/test_train.py",
    "vllm/test_engine_plugin.py",
    "vllm/test_request_features.py",
    "unit/test_base_model.py",
    "unit/test_package.py",
)


def run_python(
    code: str, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment (vLLM spawns processes, so
    engine code runs in its own ``__main__``); return the finished process."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO / "tests",
    )


def venv_script(name: str) -> str:
    """Path of a console script installed next to this interpreter."""
    return str(Path(sys.executable).with_name(name))


def free_port() -> int:
    """A free TCP port for a server a test starts, drawn at random between Ray's worker
    ports (10002-19999 by default) and the kernel's ephemeral range: a port the kernel
    hands out (``bind(0)``) can be taken again by the sockets vLLM's engines, Ray and
    outgoing connections open before the server binds it."""
    high = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    low = 20000 if high > 21000 else high // 2
    rng = random.Random()  # not the tests' seeded global generator
    for _ in range(100):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def meaning_representations(n: int, seed: int = 0) -> list[str]:
    """E2E-style restaurant descriptions, made up here (no dataset rows)."""
    rng = random.Random(seed)
    names = ["The Copper Kettle", "Blue Heron", "The Lantern", "Saffron Court", "Green Man"]
    fields = [
        ("eatType", ["pub", "restaurant", "coffee shop"]),
        ("food", ["Italian", "French", "Chinese", "English", "Indian", "Japanese"]),
        ("priceRange", ["cheap", "moderate", "high", "less than £20"]),
        ("area", ["riverside", "city centre"]),
        ("familyFriendly", ["yes", "no"]),
    ]
    out = []
    for _ in range(n):
        parts = [f"name[{rng.choice(names)}]"]
        parts += [f"{k}[{rng.choice(v)}]" for k, v in fields[: rng.randint(2, len(fields))]]
        out.append(", ".join(parts))
    return out
