"""What a step can draft per request: nothing (0), a chain of ``k`` drafts, or a draft tree."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeChoice:
    """The first ``nodes`` nodes of the engine's draft tree (a prefix of it is a tree),
    pruned by the early-exit head in the verification forward or not."""

    nodes: int
    prune: bool = False

    def __str__(self) -> str:
        return f"tree{self.nodes}" + ("-pruned" if self.prune else "")


@dataclass(frozen=True)
class AnchoredChain:
    """In a window engine, a chain of ``k`` drafts whose streams run at each request's last
    accepted token after the step (the ``accepted`` placement's way) instead of at every
    position of the next forward's window: ``k + 1`` times fewer stream rows for one more
    pass over the top layers, cheaper from a few requests on (AVX2, batch 4, 4 drafts: 2.26
    plain steps against 4.24)."""

    k: int

    def __str__(self) -> str:
        return f"k{self.k}-anchored"


@dataclass(frozen=True)
class CopyStep:
    """A step whose requests all verify copied drafts of up to ``k`` tokens (prompt lookup
    or suffix trees) and whose forward runs no streams. Not a choice but a cost key: such
    steps are timed on their own, so that a copied draft is priced at what its step costs."""

    k: int

    def __str__(self) -> str:
        return f"copy{self.k}"


#: A step's drafts per request: 0 (none), a chain of that many (its streams where the
#: engine's placement runs them, or at the anchors), or a tree.
Choice = int | AnchoredChain | TreeChoice


def rows_of(choice: Choice | CopyStep) -> int:
    """Draft rows per request a step of ``choice`` verifies."""
    if isinstance(choice, TreeChoice):
        return choice.nodes
    if isinstance(choice, (AnchoredChain, CopyStep)):
        return choice.k
    return int(choice)


def choice_label(choice: Choice | CopyStep) -> str:
    """A choice as logs and benchmarks name it: ``k2`` for a chain, else its ``str``."""
    return f"k{choice}" if isinstance(choice, int) else str(choice)


def tree_widths(num_nodes: int, chain: int) -> list[int]:
    """Tree sizes weighed in an engine of ``num_nodes`` tree nodes and chains of ``chain``:
    ``chain + 2``, multiples of ``chain`` below ``num_nodes``, and ``num_nodes`` (6, 8, 12,
    16 for chains of 4 and 16 nodes: the paper's Figure 5 sizes)."""
    sizes = {num_nodes}
    sizes.update(m for m in (chain + 2, *range(2 * chain, num_nodes, chain)) if m < num_nodes)
    return sorted(m for m in sizes if m > chain)


def tree_choices(num_nodes: int, chain: int, prune: bool) -> tuple[TreeChoice, ...]:
    """The trees of an engine: each width of :func:`tree_widths`, also pruned if ``prune``."""
    return tuple(
        TreeChoice(m, p)
        for m in tree_widths(num_nodes, chain)
        for p in ((False, True) if prune else (False,))
    )
