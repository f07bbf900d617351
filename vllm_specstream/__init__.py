"""Speculative Streaming for vLLM: single-model speculative decoding (arXiv 2402.11131).

Importing this package is cheap: vLLM and PyTorch are imported lazily by the modules that
need them, so training-only environments and ``specstream --help`` stay fast.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: The vLLM releases this version of the plugin is written and tested against.
SUPPORTED_VLLM = ">=0.32.0,<0.33"

#: The ``custom_class`` proposer that serves speculative-streaming drafts to vLLM.
PROPOSER = "vllm_specstream.proposer.SpecStreamProposer"


def speculative_config(num_speculative_tokens: int = 4, **options) -> dict:
    """The dict to pass as ``LLM(..., speculative_config=...)`` for a specstream checkpoint.

    ``num_speculative_tokens`` may be at most the checkpoint's ``num_streams``; ``options``
    are further fields of vLLM's ``SpeculativeConfig``.
    """
    return {
        "method": "custom_class",
        "model": PROPOSER,
        "num_speculative_tokens": num_speculative_tokens,
        **options,
    }


__all__ = ["PROPOSER", "SUPPORTED_VLLM", "__version__", "speculative_config"]
