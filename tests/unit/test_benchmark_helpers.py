"""``benchmarks/bs1_child.py``: helpers shared by the benchmark scripts."""

import importlib.util
from collections import Counter
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bs1_child.py"


def _module():
    spec = importlib.util.spec_from_file_location("bs1_child", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interleaved_turns_put_every_engine_in_every_position_alike():
    rotated = _module().rotated
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
