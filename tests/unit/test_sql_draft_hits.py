"""``benchmarks/sql_draft_hits.py``: the class of each token of a generated query."""

from helpers import load_benchmark


def test_characters_and_tokens_are_classed_by_their_word():
    hits = load_benchmark("sql_draft_hits")
    query = "SELECT T1.Name FROM city AS T1 WHERE Popul > 10 AND T1.Code = 'NLD'"
    classes = hits.char_classes(query, {"city", "name", "population", "code"})
    words = {w: classes[query.index(w)] for w in ("SELECT", "T1", "Name", "Popul", "10", "'NLD'")}
    assert words == {
        "SELECT": "keyword",
        "T1": "alias",
        "Name": "schema",
        "Popul": "other-word",  # a name the schema lacks
        "10": "literal",
        "'NLD'": "literal",
    }
    assert classes[query.index(" = ")] == "punct" and set(hits.CLASSES) >= set(classes)
    # A token takes the class of its first non-space character; spaces alone are punct.
    offsets = [(0, 6), (6, 9), (9, 10), (10, 14), (14, 15)]
    assert hits.token_classes(offsets, classes) == ["keyword", "alias", "punct", "schema", "punct"]
