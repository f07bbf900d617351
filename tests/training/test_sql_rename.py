"""Schema renaming of SQL training records: consistent across schema, question and query."""

from __future__ import annotations

import random
import re

import pytest

from vllm_specstream.training.tasks.sql_rename import (
    entity_words,
    plural,
    pool_words,
    rename_schema,
    schema_identifiers,
    split_parts,
)

CONTEXT = (
    "CREATE TABLE singer (Singer_ID INTEGER, Name VARCHAR, Song_Name VARCHAR, Age INTEGER); "
    "CREATE TABLE concert (concert_ID INTEGER, CountryCode VARCHAR, Singer_ID VARCHAR)"
)
QUESTION = "How many singers sang a song in each concert?"
ANSWER = (
    "SELECT count(*) , T2.concert_ID FROM singer AS T1 JOIN concert AS T2 ON T1.Singer_ID = "
    "T2.Singer_ID WHERE T1.Song_Name != \"singer song\" AND T2.countrycode = 'NLD' "
    "GROUP BY T2.concert_ID"
)
POOL = ["vessel", "cargo", "harbour", "berth", "company", "box"]


def _identifiers(sql: str) -> set[str]:
    without_values = re.sub(r"\"[^\"]*\"|'[^']*'", "", sql)
    return {w.lower() for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", without_values)}


def test_parts_and_identifiers():
    assert split_parts("Song_Name") == ["Song", "_", "Name"]
    assert split_parts("CountryCode") == ["Country", "Code"]
    assert split_parts("GNPOld") == ["GNP", "Old"]
    assert split_parts("Code2") == ["Code", "2"]
    assert schema_identifiers(CONTEXT) == [
        "singer",
        "Singer_ID",
        "Name",
        "Song_Name",
        "Age",
        "concert",
        "concert_ID",
        "CountryCode",
        "Singer_ID",
    ]
    assert pool_words([CONTEXT]) == ["age", "code", "concert", "country", "name", "singer", "song"]
    assert len(entity_words()) > 100 and all(len(w) >= 3 for w in entity_words())


def test_every_part_renamed_consistently():
    ctx, question, answer = rename_schema(CONTEXT, QUESTION, ANSWER, POOL, random.Random(0), 1.0)
    schema = {i.lower() for i in schema_identifiers(ctx)}
    old = {i.lower() for i in schema_identifiers(CONTEXT)}
    # The query names only the renamed schema's tables and columns, none of the old ones
    # (besides the parts that are kept: ID, Name, Code).
    sql_words = _identifiers(answer) - {
        "select",
        "count",
        "from",
        "as",
        "join",
        "on",
        "where",
        "and",
        "group",
        "by",
        "t1",
        "t2",
    }
    assert sql_words <= schema
    assert not (sql_words & (old - schema))
    # Kept parts stay; renamed ones keep their letter case.
    assert "Name VARCHAR" in ctx and ctx.count("_ID") == 3
    assert re.search(r"\(([A-Z][a-z]+)_ID INTEGER", ctx).group(1).lower() in POOL
    # Quoted values are data, not names.
    assert '"singer song"' in answer and "'NLD'" in answer
    # The question follows: the plural of the renamed table, the renamed song.
    table = re.match(r"CREATE TABLE (\w+)", ctx).group(1)
    assert f"many {plural(table)} sang" in question
    assert "concert" not in question and "concert" not in answer.lower()
    # An identifier spelt with other parts than the schema's takes the schema's new name.
    country = re.search(r"(\w+)Code VARCHAR", ctx).group(1)
    assert f"T2.{country}Code = 'NLD'" in answer


def test_rate_zero_and_determinism():
    assert rename_schema(CONTEXT, QUESTION, ANSWER, POOL, random.Random(0), 0.0) == (
        CONTEXT,
        QUESTION,
        ANSWER,
    )
    a = rename_schema(CONTEXT, QUESTION, ANSWER, POOL, random.Random(3), 0.5)
    assert a == rename_schema(CONTEXT, QUESTION, ANSWER, POOL, random.Random(3), 0.5)


def test_new_words_are_new_and_one_to_one():
    pool = ["singer", "song", "vessel", "cargo", "harbour", "berth", "company", "box"]
    ctx, _, _ = rename_schema(CONTEXT, QUESTION, ANSWER, pool, random.Random(1), 1.0)
    words = [w.lower() for i in schema_identifiers(ctx) for w in split_parts(i) if w.isalpha()]
    # singer and song are words of the schema: never drawn as new names for other parts.
    assert "singer" not in words and "song" not in words
    renamed = {w for w in words if w in pool}
    assert len(renamed) == 5  # singer, song, age, concert, country: five distinct new words


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("company", "companies"),
        ("box", "boxes"),
        ("day", "days"),
        ("vessel", "vessels"),
        ("match", "matches"),
    ],
)
def test_plural(word, expected):
    assert plural(word) == expected


def test_a_schema_word_is_not_taken_for_a_plural():
    context = "CREATE TABLE matches (match_num INTEGER, winner_name VARCHAR)"
    question = "How many matches had a match number above 3?"
    answer = "SELECT count(*) FROM matches WHERE match_num > 3"
    rng = random.Random(0)
    # "matches" is a part of its own (kept here), not the plural of the renamed "match".
    for _ in range(100):
        ctx, q, a = rename_schema(context, question, answer, ["vessel", "cargo"], rng, 0.7)
        if "matches" in ctx and "match_num" not in ctx:
            break
    else:
        pytest.fail("no draw renamed match and kept matches")
    assert q.startswith("How many matches had a ")
    assert "FROM matches" in a and "match_num" not in a


def _records(tmp_path, n: int = 20):
    import json

    rows = [
        {"db_id": f"db{i % 4}", "context": CONTEXT, "question": QUESTION, "answer": ANSWER}
        for i in range(n)
    ]
    path = tmp_path / "sql.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_task_examples_add_renamed_copies_of_training_records_only(tmp_path):
    from vllm_specstream.training.tasks import task_examples

    src = _records(tmp_path)
    plain = task_examples("sql", "train", data=src, val_fraction=0.25)
    renamed = task_examples(
        "sql", "train", data=src, val_fraction=0.25, sql_rename_copies=2, sql_rename_rate=1.0
    )
    assert len(plain) == 15 and len(renamed) == 3 * 15  # the held-out database stays out
    assert renamed[:15] == plain
    copies = renamed[15:]
    assert all(e.messages[0]["content"] != plain[0].messages[0]["content"] for e in copies)
    for example in copies:  # every renamed query still names only its own schema's identifiers
        prompt, query = example.messages[0]["content"], example.completion
        schema = {w.lower() for w in schema_identifiers(prompt.split("\nQuestion:")[0])}
        aliases = {"t1", "t2", "as", "select", "count", "from", "join", "on", "where", "and"}
        assert _identifiers(query) - schema - aliases <= {"group", "by"}
    held = task_examples("sql", "test", data=src, val_fraction=0.25, sql_rename_copies=2)
    assert held == task_examples("sql", "test", data=src, val_fraction=0.25)


def test_cli_refuses_renaming_without_sql_data(tmp_path, capsys):
    from vllm_specstream.cli import main

    assert main(["train", "--out", str(tmp_path / "o"), "--sql-rename-copies", "1"]) == 2
    assert "--sql-rename-copies needs --task sql --data FILE" in capsys.readouterr().err
    src = _records(tmp_path)
    args = ["train", "--out", str(tmp_path / "o"), "--task", "sql", "--data", src]
    assert main([*args, "--sql-rename-copies", "1", "--sql-rename-rate", "1.5"]) == 2
    assert "--sql-rename-rate in [0, 1], got 1 and 1.5" in capsys.readouterr().err
