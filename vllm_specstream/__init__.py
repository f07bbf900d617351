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

#: Proposers that pin where the streams run (``PROPOSER`` picks the faster on CPU).
PLACEMENT_PROPOSERS = {
    "window": "vllm_specstream.proposer.WindowSpecStreamProposer",
    "accepted": "vllm_specstream.proposer.AcceptedSpecStreamProposer",
}


def speculative_config(
    num_speculative_tokens: int = 4,
    placement: str | None = None,
    adaptive: bool = True,
    **options,
) -> dict:
    """The dict to pass as ``LLM(..., speculative_config=...)`` for a specstream checkpoint.

    ``num_speculative_tokens`` may be at most the checkpoint's ``num_streams``.
    ``placement``: ``"window"`` (streams for every position of the verified window, inside
    the forward: the paper's parallel design) or ``"accepted"`` (streams only at the last
    accepted position, after rejection sampling); default: the faster on CPU.
    ``adaptive``: draft as many tokens as pay at each step, from the step cost measured on
    this CPU class and the acceptance seen so far (:mod:`vllm_specstream.policy`), or by
    ``num_speculative_tokens_per_batch_size`` in ``options`` (vLLM's batch-size schedule);
    False drafts ``num_speculative_tokens`` at every batch size. ``options`` are further
    fields of vLLM's ``SpeculativeConfig``.
    """
    if placement is not None and placement not in PLACEMENT_PROPOSERS:
        raise ValueError(
            f"speculative_config(placement={placement!r}): choose one of "
            f"{sorted(PLACEMENT_PROPOSERS)} or leave it out"
        )
    if not adaptive and "num_speculative_tokens_per_batch_size" not in options:
        options["num_speculative_tokens_per_batch_size"] = [(1, 1 << 16, num_speculative_tokens)]
    return {
        "method": "custom_class",
        "model": PLACEMENT_PROPOSERS[placement] if placement else PROPOSER,
        "num_speculative_tokens": num_speculative_tokens,
        **options,
    }


__all__ = ["PLACEMENT_PROPOSERS", "PROPOSER", "SUPPORTED_VLLM", "__version__", "speculative_config"]
