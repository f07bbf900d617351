"""``benchmarks/step_cost.py``: the interleaving the policy's step-cost tables are measured with."""

from collections import Counter

from helpers import load_benchmark


def test_interleaved_turns_put_every_engine_in_every_position_alike():
    rotated = load_benchmark("step_cost").rotated
    order = ["plain", "control", "specstream"]
    turns = [rotated(order, t) for t in range(2 * len(order))]
    assert turns[:3] == [order, order[1:] + order[:1], order[2:] + order[:2]]
    assert turns[3] == order[::-1]  # the second cycle runs reversed
    for position in range(len(order)):
        assert Counter(t[position] for t in turns) == Counter({name: 2 for name in order})
    # Over the two cycles each engine runs right before each other one equally often.
    pairs = Counter((t[i], t[i + 1]) for t in turns for i in range(len(order) - 1))
    assert len(pairs) == 6 and set(pairs.values()) == {2}
    assert order == ["plain", "control", "specstream"]  # not reordered in place
