"""Speculative Streaming for vLLM: single-model speculative decoding (arXiv 2402.11131).

Importing this package is cheap: vLLM and PyTorch are imported lazily by the modules that
need them, so training-only environments and ``specstream --help`` stay fast.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: The vLLM releases this version of the plugin is written and tested against.
SUPPORTED_VLLM = ">=0.32.0,<0.33"

__all__ = ["SUPPORTED_VLLM", "__version__"]
