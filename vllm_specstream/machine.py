"""The machine: a one-line description printed with every benchmark result, and the CPU
class (which vector ISA vLLM's CPU kernels and oneDNN can use) that per-CPU defaults key on."""

from __future__ import annotations

import os
import platform
from functools import cache

#: CPU classes, fastest extra rows last: AVX2 only; AVX-512 without native bf16; AVX-512
#: with native bf16 dot products (AVX512-BF16 or AMX).
CPU_CLASSES = ("avx2", "avx512", "avx512_bf16")


@cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """CPU model name and flags from ``/proc/cpuinfo`` (first CPU; empty where unreadable)."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_class(flags: frozenset[str] | None = None) -> str:
    """One of :data:`CPU_CLASSES` for ``flags`` (default: this CPU's)."""
    flags = cpu_info()[1] if flags is None else flags
    if "avx512f" not in flags:
        return "avx2"
    if {"avx512_bf16", "amx_bf16"} & flags:
        return "avx512_bf16"
    return "avx512"


def describe_machine() -> str:
    """CPU model, core count, memory and the ISA features that matter for vLLM's CPU backend."""
    model, flags = cpu_info()
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} cores{mem}" + (f", {'/'.join(isa)}" if isa else "")
