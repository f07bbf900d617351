"""Draft trees as data: the template's order, masks, positions, pruning, greedy acceptance
and KV compaction, checked on hand-built cases and against the one-request reference loops."""

import math
import random

import pytest
import torch

from vllm_specstream.streams.decode_math import (
    DraftTree,
    TreeTemplate,
    accepted_path_compaction,
    build_tree,
    compact_tree,
    draft_tree,
    fill_tree,
    prune_nodes,
    prune_tree,
    tree_accept,
    tree_accept_greedy,
    tree_accept_sampled,
    tree_attention_mask,
    tree_depths,
    tree_positions,
    tree_template,
)

T = True
F = False

#: gamma 2, k 2: chain (0,) (0,0), then (1,), then depth 2 by score: (0,1) (1,0) (1,1).
SMALL = tree_template(2, 2)
#: Stream 1 proposes [1, 2], stream 2 proposes [3, 4]; node tokens in template order.
SMALL_TOKENS = [1, 3, 2, 4, 3, 4]


def assert_valid_order(t: TreeTemplate) -> None:
    """Chain first, then the rest by depth; each node's parent comes before it."""
    gamma = min(t.num_streams, t.num_nodes)
    assert t.depths[:gamma] == tuple(range(1, gamma + 1))
    assert t.ranks[:gamma] == (0,) * gamma
    assert t.parents[:gamma] == tuple(range(-1, gamma - 1))
    rest = t.depths[gamma:]
    assert list(rest) == sorted(rest)
    for i, (p, d, r) in enumerate(zip(t.parents, t.depths, t.ranks)):
        assert p < i  # every prefix is a tree
        assert d == (1 if p < 0 else t.depths[p] + 1)
        assert 0 <= r < t.top_k[d - 1]
    assert len({t.rank_path(i) for i in range(t.num_nodes)}) == t.num_nodes


def test_small_template_exact():
    assert SMALL.depths == (1, 2, 1, 2, 2, 2)
    assert SMALL.parents == (-1, 0, -1, 0, 2, 2)
    assert SMALL.ranks == (0, 0, 1, 1, 0, 1)
    t = tree_template(3, 2)
    assert [t.rank_path(i) for i in range(t.num_nodes)] == [
        (0,), (0, 0), (0, 0, 0), (1,), (0, 1), (1, 0), (1, 1),
        (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]  # fmt: skip


def test_sparse_template_with_cap_exact():
    t = tree_template(3, [3, 2, 1], max_nodes=7)
    assert t.top_k == (3, 2, 1)
    assert [t.rank_path(i) for i in range(7)] == [
        (0,), (0, 0), (0, 0, 0), (1,), (2,), (0, 1), (1, 0),
    ]  # fmt: skip
    assert t.parents == (-1, 0, 1, -1, -1, 0, 3)


@pytest.mark.parametrize("gamma,k", [(1, 1), (1, 3), (3, 1), (2, 2), (3, 3), (4, 3), (4, 2)])
def test_full_template_node_count_and_order(gamma, k):
    t = tree_template(gamma, k)
    assert 1 + t.num_nodes == 1 + sum(k**g for g in range(1, gamma + 1))
    assert t.max_depth == gamma
    assert_valid_order(t)


@pytest.mark.parametrize("top_k", [[4, 2, 1, 1], [1, 3, 2, 2], [2, 2, 2, 2]])
def test_cap_keeps_a_prefix(top_k):
    full = tree_template(4, top_k)
    assert full.num_nodes == sum(math.prod(top_k[:g]) for g in range(1, 5))
    assert_valid_order(full)
    for m in range(1, full.num_nodes + 3):
        t = tree_template(4, top_k, max_nodes=m)
        assert_valid_order(t)
        n = min(m, full.num_nodes)
        assert (t.parents, t.depths, t.ranks) == (
            full.parents[:n],
            full.depths[:n],
            full.ranks[:n],
        )


def test_template_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_streams"):
        tree_template(0, 2)
    with pytest.raises(ValueError, match="top_k"):
        tree_template(3, [2, 2])
    with pytest.raises(ValueError, match="top_k"):
        tree_template(2, 0)
    with pytest.raises(ValueError, match="max_nodes"):
        tree_template(2, 2, max_nodes=0)


def test_fill_tree_exact_and_batched():
    topk = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 8]]])
    assert fill_tree(SMALL, topk).tolist() == [SMALL_TOKENS, [5, 7, 6, 8, 7, 8]]
    assert fill_tree(SMALL, topk[0]).tolist() == SMALL_TOKENS
    # extra candidates and streams beyond the template are ignored
    wide = torch.tensor([[1, 2, 9], [3, 4, 9], [9, 9, 9]])
    assert fill_tree(SMALL, wide).tolist() == SMALL_TOKENS
    with pytest.raises(ValueError, match="stream_topk_tokens"):
        fill_tree(SMALL, torch.tensor([[1], [3]]))


def test_draft_tree_is_build_tree_reordered():
    topk = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    t = tree_template(3, 3)
    ours, bfs = draft_tree(t, 0, topk), build_tree(0, topk)
    assert ours.tokens[1:] == tuple(fill_tree(t, torch.tensor(topk)).tolist())

    def root_paths(tree: DraftTree) -> set[tuple[int, ...]]:
        return {tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(len(tree.tokens))}

    assert len(ours.tokens) == len(bfs.tokens) == 1 + 3 + 9 + 27
    assert root_paths(ours) == root_paths(bfs)
    assert ours.depths == [0, *t.depths]


def test_attention_mask_exact():
    want = [
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [F, F, T, F, F, F],
        [T, F, F, T, F, F],
        [F, F, T, F, T, F],
        [F, F, T, F, F, T],
    ]
    assert tree_attention_mask(SMALL).tolist() == want
    assert tree_attention_mask(list(SMALL.parents)).tolist() == want
    batched = torch.tensor([list(SMALL.parents), [-1, 0, 1, 2, -1, -1]])
    mask = tree_attention_mask(batched)
    assert mask[0].tolist() == want
    assert mask[1, 3].tolist() == [T, T, T, T, F, F]
    # the root-included DraftTree mask is the same rule one level up
    tree = draft_tree(SMALL, 0, [[1, 2], [3, 4]])
    assert tree.ancestor_mask()[1:, 1:].tolist() == want
    assert tree.ancestor_mask()[:, 0].all()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 17])
def test_attention_mask_of_a_long_chain(n):
    chain = list(range(-1, n - 1))
    assert tree_attention_mask(chain).equal(torch.ones(n, n, dtype=torch.bool).tril())
    assert tree_depths(chain).tolist() == list(range(1, n + 1))


def test_positions_and_depths():
    assert tree_positions(SMALL, 10).tolist() == [11, 12, 11, 12, 12, 12]
    assert tree_positions(SMALL, torch.tensor([10, 20])).tolist() == [
        [11, 12, 11, 12, 12, 12],
        [21, 22, 21, 22, 22, 22],
    ]
    compacted = torch.tensor([[-1, 0, 1, -1], [-1, -1, 1, -1]])
    assert tree_depths(compacted).tolist() == [[1, 2, 3, 1], [1, 1, 2, 1]]
    assert tree_positions(compacted, torch.tensor([5, 7])).tolist() == [[6, 7, 8, 6], [8, 8, 9, 8]]


def target_for(after: dict[int, int], n: int = 6, fill: int = 60) -> list[int]:
    """Target choices over ``[root, node 0..n-1]``; ``after[-1]`` is the choice after the root."""
    return [after.get(i - 1, fill + i) for i in range(n + 1)]


@pytest.mark.parametrize(
    "after,path,bonus",
    [
        ({-1: 7}, [-1, -1], 7),  # no acceptance: the root's choice is the bonus
        ({-1: 1, 0: 3, 1: 9}, [0, 1], 9),  # the whole top-1 chain
        ({-1: 1, 0: 4, 3: 8}, [0, 3], 8),  # rank-1 child of the top-1 node
        ({-1: 2, 2: 4, 5: 8}, [2, 5], 8),  # a non-top-1 branch, to its leaf
        ({-1: 2, 2: 8}, [2, -1], 8),  # a non-top-1 node only
    ],
)
def test_accept_greedy_hand_built(after, path, bonus):
    tokens = torch.tensor(SMALL_TOKENS)
    got = tree_accept_greedy(SMALL, tokens, torch.tensor(target_for(after)))
    assert got.path.tolist() == path
    assert got.num_accepted.item() == sum(p >= 0 for p in path)
    assert got.bonus_token.item() == bonus
    tree = draft_tree(SMALL, 0, [[1, 2], [3, 4]])
    assert tree_accept(tree, target_for(after)) == [0, *(p + 1 for p in path if p >= 0)]


def test_accept_greedy_batched_padding_and_duplicates():
    targets = torch.tensor([target_for({-1: 1, 0: 3, 1: 9}), target_for({-1: 2, 2: 4, 5: 8})])
    got = tree_accept_greedy(SMALL, torch.tensor([SMALL_TOKENS] * 2), targets)
    assert got.path.tolist() == [[0, 1], [2, 5]]
    assert got.num_accepted.tolist() == [2, 2]
    assert got.bonus_token.tolist() == [9, 8]
    # a compacted tree: padding rows have parent -1 and token -1, and never match
    parents = torch.tensor([[-1, 0, 0, -1], [-1, -1, -1, -1]])
    tokens = torch.tensor([[1, 3, 4, -1], [1, 2, -1, -1]])
    targets = torch.tensor([[1, 4, 50, 51, 52], [2, 50, 51, 52, 53]])
    got = tree_accept_greedy(parents, tokens, targets, max_depth=3)
    assert got.path.tolist() == [[0, 2, -1], [1, -1, -1]]
    assert got.bonus_token.tolist() == [51, 51]
    # equal siblings: the first in node order wins, as in tree_accept
    got = tree_accept_greedy(
        [-1, -1, 0, 1], torch.tensor([5, 5, 6, 7]), torch.tensor([5, 7, 7, 0, 0])
    )
    assert got.path.tolist() == [0, -1] and got.bonus_token.item() == 7
    assert tree_accept(DraftTree((0, 5, 5, 6, 7), (-1, 0, 0, 1, 2)), [5, 7, 7, 0, 0]) == [0, 1]
    # no nodes at all (everything pruned): the root's choice is the bonus
    empty = tree_accept_greedy([], torch.empty(0, dtype=torch.long), torch.tensor([42]))
    assert empty.path.tolist() == [] and empty.num_accepted.item() == 0
    assert empty.bonus_token.item() == 42


def test_prune_nodes_hand_built():
    keep_prob = torch.tensor([0.9, 0.5, 0.001, 0.5, 0.9, 0.9])
    # node 2 falls below the threshold and takes its children 4 and 5 with it
    assert prune_nodes(SMALL, keep_prob, 0.01).tolist() == [T, T, F, T, F, F]
    # path probabilities: .9 .45 .001 .45 .0009 .0009
    assert prune_nodes(SMALL, keep_prob, 0.4, cumulative=True).tolist() == [T, T, F, T, F, F]
    assert prune_nodes(SMALL, keep_prob, 0.5, cumulative=True).tolist() == [T, F, F, F, F, F]
    assert prune_nodes(SMALL, keep_prob, 0.0, cumulative=True).all()
    assert prune_nodes(SMALL, keep_prob, 0.01, max_nodes=2).tolist() == [T, T, F, F, F, F]
    # a node exactly at the threshold stays, as in prune_tree
    assert prune_nodes(SMALL, keep_prob, 0.5).tolist() == [T, T, F, T, F, F]
    assert prune_nodes(SMALL, keep_prob, 0.51).tolist() == [T, F, F, F, F, F]
    batched = torch.stack((keep_prob, torch.tensor([0.001, 0.9, 0.9, 0.9, 0.9, 0.9])))
    assert prune_nodes(SMALL, batched, 0.01).tolist() == [[T, T, F, T, F, F], [F, F, T, F, T, T]]


def test_compact_tree_hand_built():
    keep = torch.tensor([[T, T, F, T, F, F], [F, F, T, F, T, T], [T] * 6])
    got = compact_tree(SMALL, keep)
    assert got.index.tolist() == [[0, 1, 3, -1, -1, -1], [2, 4, 5, -1, -1, -1], list(range(6))]
    assert got.parents.tolist() == [
        [-1, 0, 0, -1, -1, -1],
        [-1, 0, 0, -1, -1, -1],
        list(SMALL.parents),
    ]
    assert got.num_nodes.tolist() == [3, 3, 6]


def test_accepted_path_compaction_moves():
    def moves(path, **kw):
        return accepted_path_compaction(torch.tensor(path), **kw).tolist()

    assert moves([0, 1]) == []  # top-1 chain: already in place
    assert moves([-1, -1]) == []
    assert moves([2, 5]) == [[3, 1], [6, 2]]
    assert moves([0, 3]) == [[4, 2]]
    assert moves([2, -1]) == [[3, 1]]
    assert moves([[2, 5], [0, 3]], row_start=torch.tensor([0, 7])) == [[3, 1], [6, 2], [11, 9]]
    assert moves([2, 5], row_start=4, offset=0) == [[6, 4], [9, 5]]


@pytest.mark.parametrize("seed", range(5))
def test_compaction_moves_put_the_path_after_the_root(seed):
    rng = random.Random(seed)
    n = 12
    path = sorted(rng.sample(range(n), rng.randint(0, 5)))
    rows = torch.arange(1 + n) * 10  # row 0 is the root
    one_by_one, at_once = rows.clone(), rows.clone()
    pairs = accepted_path_compaction(torch.tensor(path + [-1] * 2, dtype=torch.long))
    for src, dst in pairs.tolist():
        one_by_one[dst] = one_by_one[src]
    if len(pairs):
        at_once[pairs[:, 1]] = rows[pairs[:, 0]]
    want = [0, *((p + 1) * 10 for p in path)]
    assert one_by_one[: 1 + len(path)].tolist() == want
    assert at_once[: 1 + len(path)].tolist() == want


def random_case(rng: random.Random, vocab: int = 5):
    """A random sparse template, one request's top-k (distinct per stream) and targets."""
    gamma = rng.randint(1, 4)
    top_k = [rng.randint(1, 3) for _ in range(gamma)]
    full = sum(math.prod(top_k[:g]) for g in range(1, gamma + 1))
    template = tree_template(gamma, top_k, max_nodes=rng.choice([None, rng.randint(1, full)]))
    topk = [rng.sample(range(vocab), max(top_k)) for _ in range(gamma)]
    return template, topk


@pytest.mark.parametrize("seed", range(40))
def test_accept_greedy_matches_reference_loop(seed):
    rng = random.Random(seed)
    template, topk = random_case(rng)
    tokens = fill_tree(template, torch.tensor(topk))
    tree = draft_tree(template, 0, topk)
    batch = [[rng.randrange(5) for _ in range(template.num_nodes + 1)] for _ in range(16)]
    got = tree_accept_greedy(template, tokens.expand(16, -1), torch.tensor(batch))
    for b, target in enumerate(batch):
        want = tree_accept(tree, target)
        a = got.num_accepted[b].item()
        assert got.path[b, :a].tolist() == [i - 1 for i in want[1:]]
        assert (got.path[b, a:] == -1).all()
        assert got.bonus_token[b].item() == target[want[-1]]


@pytest.mark.parametrize("seed", range(20))
def test_breadth_first_layout_accepts_the_same_tokens(seed):
    rng = random.Random(seed)
    gamma, k = rng.randint(1, 3), rng.randint(1, 3)
    topk = [rng.sample(range(5), k) for _ in range(gamma)]
    ours, bfs = draft_tree(tree_template(gamma, k), 0, topk), build_tree(0, topk)
    # the target's choice depends on the tokens so far, not on the layout
    choice = {}
    for i in range(len(bfs.tokens)):
        choice[tuple(bfs.tokens[j] for j in bfs.path_to(i))] = rng.randrange(5)

    def target(tree: DraftTree) -> list[int]:
        return [
            choice[tuple(tree.tokens[j] for j in tree.path_to(i))] for i in range(len(tree.tokens))
        ]

    got = tree_accept_greedy(
        torch.tensor(ours.parents[1:]) - 1,
        torch.tensor(ours.tokens[1:]),
        torch.tensor(target(ours)),
    )
    accepted = [0] + [ours.tokens[i + 1] for i in got.path[: got.num_accepted].tolist()]
    assert accepted == [bfs.tokens[i] for i in tree_accept(bfs, target(bfs))]


@pytest.mark.parametrize("seed", range(40))
def test_prune_and_compact_match_reference_loop(seed):
    rng = random.Random(seed)
    template, topk = random_case(rng)
    n = template.num_nodes
    keep_prob = torch.tensor([[rng.choice([0.005, 0.3, 0.9]) for _ in range(n)] for _ in range(8)])
    keep = prune_nodes(template, keep_prob, 0.01)
    parents = torch.tensor(template.parents)
    assert (keep[:, parents.clamp(min=0)] | ~keep | (parents < 0)).all()  # parent-closed
    compact = compact_tree(template, keep)
    tokens = fill_tree(template, torch.tensor(topk))
    tree = draft_tree(template, 0, topk)
    for b in range(8):
        want = prune_tree(tree, [1.0, *keep_prob[b].tolist()], 0.01)
        m = compact.num_nodes[b].item()
        assert m == len(want.tokens) - 1
        assert tokens[compact.index[b, :m]].tolist() == list(want.tokens[1:])
        assert compact.parents[b, :m].tolist() == [p - 1 for p in want.parents[1:]]
        assert (compact.parents[b, :m] < torch.arange(m)).all()  # every prefix a tree


#: A root with children 0 and 2; node 0 with children 1 and 4; node 1 with child 3.
SAMPLED_PARENTS = (-1, 0, -1, 1, 0)
SAMPLED_TOKENS = (1, 2, 2, 3, 4)


def _sampled_probs(vocab: int = 6) -> torch.Tensor:
    """Target distributions at [root, node 0..4] that put real mass on the drafts."""
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(len(SAMPLED_PARENTS) + 1, vocab, generator=g) + 0.2
    return probs / probs.sum(-1, keepdim=True)


def test_tree_sampling_follows_the_target_distribution():
    """Sampled through the tree, each output token is distributed as the target's at its
    context: the first as the root's; after node 0's token as node 0's row; after node 0
    and node 1 as node 1's row (20000 draws with a fixed seed, every cell within 5 sigma)."""
    probs = _sampled_probs()
    g = torch.Generator().manual_seed(1)
    n = 20000
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        path, bonus = tree_accept_sampled(SAMPLED_PARENTS, SAMPLED_TOKENS, probs, g)
        out = tuple(SAMPLED_TOKENS[i] for i in path) + (bonus,)
        for m in range(1, len(out) + 1):
            counts[out[:m]] = counts.get(out[:m], 0) + 1

    def check(prefix: tuple[int, ...], row: int) -> None:
        total = counts[prefix] if prefix else n
        for token in range(probs.shape[1]):
            want = float(probs[row, token])
            got = counts.get(prefix + (token,), 0) / total
            assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / total), (prefix, token)

    check((), 0)  # first token: the root's distribution
    check((1,), 1)  # after node 0's token: node 0's row (its children 1 and 4 tried)
    check((2,), 3)  # after node 2's token (a leaf): node 2's row, the bonus
    check((1, 2), 2)  # after nodes 0 and 1: node 1's row
    # Tokens after a prefix the tree does not hold come from the next step, not here.
    assert (0, 0) not in counts


def test_tree_sampling_at_the_greedy_limit_is_greedy_acceptance():
    for target in ([1, 2, 3, 5, 0, 0], [1, 4, 0, 0, 0, 5], [2, 0, 0, 1, 0, 0], [0] * 6):
        probs = torch.nn.functional.one_hot(torch.tensor(target), 6).double()
        path, bonus = tree_accept_sampled(SAMPLED_PARENTS, SAMPLED_TOKENS, probs)
        greedy = tree_accept_greedy(
            SAMPLED_PARENTS, torch.tensor(SAMPLED_TOKENS), torch.tensor(target)
        )
        m = int(greedy.num_accepted)
        assert (path, bonus) == (tuple(greedy.path[:m].tolist()), int(greedy.bonus_token))
