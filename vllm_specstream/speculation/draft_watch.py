"""One warning when speculation silently stops: steps that should draft but draft nothing.

Every way the stream drafts can go missing (vLLM renames the attention layer the stream
pass reads its batch from, a stash from another step, anchors outside the forward) is
lossless: vLLM just decodes one token per step. Without a word, a user sees only the lost
speedup. The proposer reports each drafting step here; after :data:`NO_DRAFT_STEPS`
consecutive steps without a single draft, one warning says why (the last reason seen).
"""

from __future__ import annotations

from vllm_specstream.logger import init_logger

logger = init_logger(__name__)

#: Consecutive drafting steps without any draft before the warning: long enough that an
#: unlucky stretch of the confidence rule or a run of partial prefills does not trip it.
NO_DRAFT_STEPS = 50


class NoDraftWatch:
    """Counts consecutive steps that were expected to draft but drafted nothing; warns
    once per process when the count reaches ``steps``."""

    def __init__(self, steps: int = NO_DRAFT_STEPS):
        self.steps = steps
        self.run = 0
        self.reason: str | None = None
        self.warned = False

    def step(self, expected: bool, drafted: bool, reason: str | None = None) -> None:
        """Record one step: ``expected`` (some request could draft), ``drafted`` (some
        request got a draft), ``reason`` (why not, when it did not)."""
        if not expected:
            return
        if drafted:
            self.run, self.reason = 0, None
            return
        self.run += 1
        self.reason = reason or self.reason
        if self.run >= self.steps and not self.warned:
            self.warned = True
            logger.warning(
                "no stream drafts for %d steps: %s; outputs stay correct, but speculation "
                "gives no speedup (this warning is not repeated)",
                self.run,
                self.reason or "unknown reason",
            )
