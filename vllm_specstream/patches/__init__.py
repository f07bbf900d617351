"""Every change this plugin makes to vLLM's own code, declared in one place.

A patch names what it replaces, the vLLM versions it was written for, and why. It applies
at most once per process, refuses to apply on other vLLM versions, and logs what it did.
Each patch has a test that fails when vLLM changes under it (``tests/vllm/test_patches.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger("vllm_specstream.patches")


@dataclass(frozen=True)
class Patch:
    """A guarded, idempotent replacement of something inside vLLM."""

    name: str
    """Short identifier, used in logs and tests."""
    target: str
    """Dotted path of the vLLM object that is replaced."""
    vllm_versions: str
    """The vLLM releases the patch was written and tested for (a PEP 440 specifier)."""
    why: str
    """One sentence: the defect or gap in vLLM that the patch works around."""
    apply: Callable[[], None]
    """Does the replacement; called at most once per process."""


_applied: set[str] = set()


def applied_patches() -> frozenset[str]:
    """Names of the patches applied in this process."""
    return frozenset(_applied)


def apply_patch(patch: Patch, vllm_version: str) -> bool:
    """Apply ``patch`` if this vLLM is one it was written for; return whether it is active."""
    if patch.name in _applied:
        return True
    if Version(Version(vllm_version).public) not in SpecifierSet(patch.vllm_versions):
        logger.debug(
            "vllm-specstream: patch %s (for vLLM %s) skipped on vLLM %s",
            patch.name,
            patch.vllm_versions,
            vllm_version,
        )
        return False
    patch.apply()
    _applied.add(patch.name)
    logger.debug("vllm-specstream: patched %s (%s): %s", patch.target, patch.name, patch.why)
    return True


def wrap_once(owner: Any, name: str, wrap: Callable[[Callable], Callable], marker: str) -> None:
    """Replace ``owner.name`` with ``wrap(owner.name)``, marked with the attribute ``marker``,
    unless it already carries that mark (a patch applied twice wraps once)."""
    current = getattr(owner, name)
    if getattr(current, marker, False):
        return
    wrapped = wrap(current)
    setattr(wrapped, marker, True)
    setattr(owner, name, wrapped)
