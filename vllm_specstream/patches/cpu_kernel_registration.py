"""vLLM 0.32's CPU kernel-override registration, made to work once numba is imported.

``CpuPlatform.register_triton_kernel_overrides()`` (called by every CPU worker as it starts)
rebinds each reference to the Triton kernels it overrides by scanning every module in
``sys.modules`` and reading ``vars(value).get("kernel")`` of each value with a ``__dict__``.
llvmlite's ``binding.ffi.lib`` answers every attribute, ``__dict__`` included, with a
function wrapper, so the scan raises ``AttributeError`` in any process that imported
numba (vLLM's ``ngram`` proposer and this plugin's prompt lookup do) before the worker
started: a second engine in one process, or a worker run in the calling process. The
replacement hides the modules that would break the scan for its duration; none of them
can hold a vLLM kernel. See docs/upstream-issues.md (7).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from vllm_specstream.patches import Patch

TARGET = "vllm.platforms.cpu.CpuPlatform.register_triton_kernel_overrides"


def modules_the_scan_cannot_read() -> list[str]:
    """Names of the loaded modules holding a value whose ``vars()`` is not a mapping."""
    names = []
    for name, module in list(sys.modules.items()):
        for value in list((getattr(module, "__dict__", None) or {}).values()):
            if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                names.append(name)
                break
    return names


@contextmanager
def hidden_from_sys_modules(names: list[str]) -> Iterator[None]:
    """``sys.modules`` without ``names`` inside the block, restored on the way out."""
    hidden = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    try:
        yield
    finally:
        sys.modules.update(hidden)


def _apply() -> None:
    from vllm.platforms.cpu import CpuPlatform

    register = CpuPlatform.register_triton_kernel_overrides.__func__

    def register_triton_kernel_overrides(cls) -> None:
        with hidden_from_sys_modules(modules_the_scan_cannot_read()):
            register(cls)

    CpuPlatform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)


CPU_KERNEL_REGISTRATION = Patch(
    name="cpu-kernel-registration-with-numba",
    target=TARGET,
    vllm_versions=">=0.32,<0.33",
    why="the kernel-override scan fails on llvmlite's ffi object, so a CPU worker cannot "
    "start in a process that imported numba",
    apply=_apply,
)
