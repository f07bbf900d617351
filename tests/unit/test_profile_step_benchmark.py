"""``benchmarks/profile_step.py``: the pieces it times exist, and its ``--field`` values."""

from helpers import load_benchmark


def test_every_profiled_range_names_a_callable_of_the_plugin():
    # The script wraps these by name: a piece renamed or moved must fail here, not at the
    # first profile after an hour of other work.
    ranges = load_benchmark("profile_step").profiled_ranges()
    assert len(ranges) >= 8
    for obj, name, label in ranges:
        assert callable(getattr(obj, name, None)), f"{label}: {obj!r} has no {name}"


def test_field_values_parse_as_json_where_they_can():
    parse = load_benchmark("profile_step").json_field
    assert parse("stream_dtype=int8") == ("stream_dtype", "int8")
    assert parse("draft_min_prob=0.5") == ("draft_min_prob", 0.5)
    assert parse("tree_top_k=[2,1]") == ("tree_top_k", [2, 1])
