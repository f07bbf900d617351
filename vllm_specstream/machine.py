"""The machine: a one-line description printed with every benchmark result, and the CPU
class (which vector ISA vLLM's CPU kernels and oneDNN can use) that per-CPU defaults key on."""

from __future__ import annotations

import os
import platform
from functools import cache

#: CPU classes, fastest extra rows last: AVX2 only; AVX-512 without native bf16; AVX-512
#: with native bf16 dot products (AVX512-BF16); AMX tiles too (oneDNN runs the stream pass's
#: bf16 GEMMs of many rows on them: on one Intel Xeon, 4 drafts for 16-32 requests cost ~0.8x
#: the extra time they do there with AMX off, at batch 1 the same;
#: ``docs/benchmarks.md``, "AMX").
CPU_CLASSES = ("avx2", "avx512", "avx512_bf16", "amx")


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


#: oneDNN's ``ONEDNN_MAX_CPU_ISA`` values that cap the class below what the CPU has: the
#: GEMMs (vLLM's CPU linear layers are oneDNN's) then run as on a CPU of that class, bf16
#: ones included (none below AVX-512). Values not named cap nothing (``ALL``, ``DEFAULT``,
#: the AMX ones).
ONEDNN_ISA_CAPS = {
    "SSE41": "avx2",
    "AVX": "avx2",
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2",
    "AVX2_VNNI_2": "avx2",
    "AVX512_CORE": "avx512",
    "AVX512_CORE_VNNI": "avx512",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX512_CORE_FP16": "avx512_bf16",
    "AVX10_1_512": "avx512_bf16",
}


def cpu_class(flags: frozenset[str] | None = None, onednn_max_isa: str | None = None) -> str:
    """One of :data:`CPU_CLASSES` for ``flags`` capped by ``onednn_max_isa`` (default: this
    CPU's flags capped by the ``ONEDNN_MAX_CPU_ISA`` it runs under)."""
    if flags is None:
        flags = cpu_info()[1]
        onednn_max_isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if "avx512f" not in flags:
        cls = "avx2"
    elif "amx_bf16" in flags:
        cls = "amx"
    elif "avx512_bf16" in flags:
        cls = "avx512_bf16"
    else:
        cls = "avx512"
    cap = ONEDNN_ISA_CAPS.get((onednn_max_isa or "").strip().upper(), cls)
    return min(cls, cap, key=CPU_CLASSES.index)


def native_bf16(cls: str | None = None) -> bool:
    """Whether CPU class ``cls`` (default: this CPU's, as oneDNN may use it) multiplies bf16
    natively; elsewhere oneDNN emulates bf16, slower than fp32."""
    return CPU_CLASSES.index(cls or cpu_class()) >= CPU_CLASSES.index("avx512_bf16")


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
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return (
        f"{model}, {os.cpu_count()} cores{mem}"
        + (f", {'/'.join(isa)}" if isa else "")
        + (f" (ONEDNN_MAX_CPU_ISA={limit}: class {cpu_class()})" if limit else "")
    )
