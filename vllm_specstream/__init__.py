"""Speculative Streaming for vLLM: single-model speculative decoding (arXiv 2402.11131).

Importing this package is cheap: vLLM and PyTorch are imported lazily by the modules that
need them, so training-only environments and ``specstream --help`` stay fast.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: The vLLM releases this version of the plugin is written and tested against.
SUPPORTED_VLLM = ">=0.32.0,<0.33"

#: The ``custom_class`` proposer that serves speculative-streaming drafts to vLLM.
PROPOSER = "vllm_specstream.model_executor.proposer.SpecStreamProposer"


def speculative_config(
    num_speculative_tokens: int = 4,
    adaptive: bool = True,
    **options,
) -> dict:
    """The dict to pass as ``LLM(..., speculative_config=...)`` for a specstream checkpoint.

    ``num_speculative_tokens`` may be at most the checkpoint's ``num_streams``.
    ``adaptive``: draft as many tokens as pay at each step, from the steps' cost as the
    engine times them and the acceptance seen so far (:mod:`vllm_specstream.speculation.policy`), or by
    ``num_speculative_tokens_per_batch_size`` in ``options`` (vLLM's batch-size schedule);
    False drafts ``num_speculative_tokens`` at every batch size. ``options`` are further
    fields of vLLM's ``SpeculativeConfig``. The plugin's own fields (placement, draft
    trees, ...) go to ``LLM(..., additional_config={"specstream": {...}})``
    (:mod:`vllm_specstream.speculation.settings`).
    """
    from vllm_specstream.speculation.settings import FIELDS, KEY

    if type(num_speculative_tokens) is not int or num_speculative_tokens < 1:
        raise ValueError(
            f"speculative_config(num_speculative_tokens={num_speculative_tokens!r}): must be "
            "an integer >= 1, at most the checkpoint's num_streams (e.g. 4)"
        )
    mine = sorted(set(options) & set(FIELDS))
    if mine:
        fields = {name: options[name] for name in mine}
        raise ValueError(
            f"speculative_config({', '.join(mine)}=...): {', '.join(mine)} "
            f"{'is a field' if len(mine) == 1 else 'are fields'} of the plugin, not of vLLM's "
            f"speculative config: pass LLM(..., additional_config={{{KEY!r}: {fields!r}}})"
        )
    if not adaptive and "num_speculative_tokens_per_batch_size" not in options:
        options["num_speculative_tokens_per_batch_size"] = [(1, 1 << 16, num_speculative_tokens)]
    return {
        "method": "custom_class",
        "model": PROPOSER,
        "num_speculative_tokens": num_speculative_tokens,
        **options,
    }


__all__ = ["PROPOSER", "SUPPORTED_VLLM", "__version__", "speculative_config"]
