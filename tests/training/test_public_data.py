"""Public task formats (SQL, E2E, DialogSum): loaders, the by-group split, the paper's metrics."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import REPO

from vllm_specstream.training.data import DataError
from vllm_specstream.training.metrics import (
    canonical_sql,
    rouge_scores,
    split_sentences,
    sql_exact_match,
    task_metrics,
)
from vllm_specstream.training.tasks import (
    load_task_data,
    select_split,
    split_by_group,
    task_examples,
    write_split,
)

SCHEMA = "CREATE TABLE singer (name VARCHAR, age INTEGER)"


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _csv(path: Path, rows: list[list[str]]) -> Path:
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def _sql(i: int, db: str | None = "concert") -> dict:
    record = {"context": SCHEMA, "question": f"Question {i}?", "answer": f"SELECT {i}"}
    return record if db is None else {**record, "db_id": db}


# --------------------------------------------------------------------------- loaders


def test_sql_jsonl_and_json_list(tmp_path):
    jsonl = _jsonl(tmp_path / "a.jsonl", [_sql(1), _sql(2, db=None)])
    records = load_task_data("sql", jsonl)
    assert [r.prompt for r in records] == [f"{SCHEMA}\nQuestion: Question {i}?" for i in (1, 2)]
    assert records[0].references == ("SELECT 1",)
    assert records[0].group == "concert"
    assert records[1].group == SCHEMA.lower()  # no db_id: the schema is the group
    assert records[0].messages == [{"role": "user", "content": records[0].prompt}]
    listed = tmp_path / "a.json"
    listed.write_text(json.dumps([_sql(1), _sql(2, db=None)], indent=2), encoding="utf-8")
    from_list = load_task_data("sql", listed)
    assert [(r.prompt, r.references, r.group) for r in from_list] == [
        (r.prompt, r.references, r.group) for r in records
    ]
    assert [r.where for r in from_list] == [f"{listed}:2", f"{listed}:8"]


def test_json_list_items_know_their_lines(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(
        "[\n" + json.dumps(_sql(1)) + ",\n\n" + json.dumps({"context": "x"}) + "\n]\n",
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match=rf"{path}:4: missing field 'question'"):
        load_task_data("sql", path)
    path.write_text("[" + json.dumps(_sql(1)) + " " + json.dumps(_sql(2)) + "]")
    with pytest.raises(ValueError, match=r"a\.json:1: invalid JSON: expected ','"):
        load_task_data("sql", path)


def test_e2e_csv_groups_references_by_mr(tmp_path):
    mr_a = "name[Aromi], eatType[pub], area[riverside]"
    mr_b = "name[Zizzi], food[Italian]"
    path = _csv(
        tmp_path / "dev.csv",
        [["mr", "ref"], [mr_a, "Aromi is a pub."], [mr_b, "Zizzi serves pasta."], [mr_a, "A pub."]],
    )
    records = load_task_data("e2e", path)
    assert [r.references for r in records] == [
        ("Aromi is a pub.", "A pub."),
        ("Zizzi serves pasta.",),
    ]
    assert records[0].prompt == f"Describe this restaurant in one or two sentences.\n{mr_a}"
    assert records[0].where == f"{path}:2" and records[1].where == f"{path}:3"
    assert [e.completion for e in records[0].examples()] == ["Aromi is a pub.", "A pub."]


def test_dialogsum_single_and_multi_reference(tmp_path):
    dialogue = "#Person1#: Hi.\n#Person2#: Hello."
    path = _jsonl(
        tmp_path / "d.jsonl",
        [
            {"fname": "dev_0", "dialogue": dialogue, "summary": "They greet.", "topic": "greet"},
            {"dialogue": "#Person1#: Bye.", "summary1": "A", "summary2": "B", "summary3": "C"},
        ],
    )
    first, second = load_task_data("dialogsum", path)
    assert first.prompt == f"Summarize this dialogue.\n{dialogue}"
    assert first.references == ("They greet.",)
    assert second.references == ("A", "B", "C")


@pytest.mark.parametrize(
    ("task", "content", "message"),
    [
        ("sql", '{"context": "c", "question": "q"}\n', r"d\.jsonl:1: missing field 'answer'"),
        ("sql", '{"context": "c", "question": "q", "answer": "  "}\n', r":1: empty field 'answer'"),
        ("sql", '{"context": "c", "question": 3, "answer": "a"}\n', r"'question' must be a string"),
        ("sql", '{"prompt": "p", "completion": "c"}\n', r"'context'.*without --task"),
        ("dialogsum", '{"dialogue": "d"}\n', r":1: missing field 'summary'"),
        ("dialogsum", '{"dialogue": "d", "summary": null}\n', r":1: missing field 'summary'"),
        ("e2e", '\n{"mr": "m", "ref": "r"}\n{"mr": "m"}\n', r"d\.jsonl:3: missing field 'ref'"),
        ("sql", '{"context": "c"\n', r"d\.jsonl:1: invalid JSON"),
        ("sql", "[1]\n", r"d\.jsonl:1: expected a JSON object, got int"),
        ("sql", "\n\n", r"d\.jsonl: no records"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, task, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_task_data(task, path)


def test_bad_csv_rows_name_their_line(tmp_path):
    path = _csv(tmp_path / "e.csv", [["mr", "ref"], ["m1", "r1"], ["m2", ""]])
    with pytest.raises(ValueError, match=r"e\.csv:3: empty field 'ref'"):
        load_task_data("e2e", path)
    path = _csv(tmp_path / "e.csv", [["mr", "text"], ["m1", "r1"]])
    with pytest.raises(ValueError, match=r"e\.csv:2: missing field 'ref' \(fields: mr, text\)"):
        load_task_data("e2e", path)
    path = _csv(tmp_path / "e.csv", [["mr", "ref"], ["m1", "r1", "extra"]])
    with pytest.raises(ValueError, match=r"e\.csv:2: more cells than the header"):
        load_task_data("e2e", path)
    with pytest.raises(DataError, match="nope.csv: no such file"):
        load_task_data("e2e", tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="unknown task 'code'"):
        load_task_data("code", path)


# --------------------------------------------------------------------------- split


def _many_sql(tmp_path: Path) -> list:
    records = [_sql(i, db=f"db{i % 13}") for i in range(200)]
    return load_task_data("sql", _jsonl(tmp_path / "many.jsonl", records))


def test_split_by_group_has_no_leak_and_is_deterministic(tmp_path):
    records = _many_sql(tmp_path)
    train, val = split_by_group(records, 0.15, seed=0)
    assert not {r.group for r in train} & {r.group for r in val}
    assert sorted(train + val, key=records.index) == records
    assert train == sorted(train, key=records.index)  # file order kept
    assert 0.05 * len(records) <= len(val) <= 0.25 * len(records)
    assert (train, val) == split_by_group(records, 0.15, seed=0)
    assert any(split_by_group(records, 0.15, seed=s)[1] != val for s in range(1, 6))
    assert split_by_group(records, 0.0) == (records, [])


def test_split_is_independent_of_file_order(tmp_path):
    records = _many_sql(tmp_path)
    _, val = split_by_group(records, 0.15, seed=3)
    _, val_reversed = split_by_group(records[::-1], 0.15, seed=3)
    assert {r.group for r in val} == {r.group for r in val_reversed}


def test_split_edge_cases(tmp_path):
    records = _many_sql(tmp_path)
    with pytest.raises(ValueError, match="val_fraction must be in"):
        split_by_group(records, 1.0)
    one_group = [r for r in records if r.group == "db0"]
    with pytest.raises(ValueError, match="share one group"):
        split_by_group(one_group, 0.15)
    _, val = split_by_group(records[:26], 0.01)  # below one group: still one group held out
    assert len({r.group for r in val}) == 1
    train, _ = split_by_group(records, 0.99)  # one group always stays for training
    assert len({r.group for r in train}) == 1
    with pytest.raises(ValueError, match="--split val is empty"):
        select_split(records, "val", 0.0)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        select_split(records, "test", 0.15)
    assert select_split(records, "all", 0.15) == records


def test_write_split_round_trips_each_format(tmp_path):
    rows = [["mr", "ref"]] + [[f"name[R{i % 20}]", f"Ref {i}."] for i in range(60)]
    src = _csv(tmp_path / "dev.csv", rows)
    train_path, val_path = write_split("e2e", src, tmp_path / "out", 0.2, seed=1)
    assert (train_path.name, val_path.name) == ("train.csv", "val.csv")
    train, val = split_by_group(load_task_data("e2e", src), 0.2, seed=1)
    assert [r.references for r in load_task_data("e2e", train_path)] == [
        r.references for r in train
    ]
    assert [r.prompt for r in load_task_data("e2e", val_path)] == [r.prompt for r in val]
    listed = tmp_path / "sql.json"
    listed.write_text(json.dumps([_sql(i, db=f"db{i % 4}") for i in range(20)]), encoding="utf-8")
    _, val_json = write_split("sql", listed, tmp_path / "sql", 0.3)
    assert isinstance(json.loads(val_json.read_text()), list)
    assert all("db_id" in row for row in json.loads(val_json.read_text()))


def test_task_examples_public_and_synthetic(tmp_path):
    rows = [["mr", "ref"]] + [[f"name[R{i % 10}]", f"Ref {i}."] for i in range(40)]
    src = str(_csv(tmp_path / "dev.csv", rows))
    train = task_examples("e2e", "train", data=src, val_fraction=0.2)
    held = task_examples("e2e", "test", data=src, val_fraction=0.2)
    assert len(train) + 4 * len(held) == 40  # every ref trains; one held-out example per MR
    assert not {e.messages[0]["content"] for e in train} & {e.messages[0]["content"] for e in held}
    assert task_examples("e2e", "test", data=src, val_fraction=0.0) == []
    assert len(task_examples("e2e", "test", 3, data=src, eval_data=src)) == 3
    synthetic = task_examples("sql", "train", 5, seed=0)
    assert len(synthetic) == 5 and synthetic[0].messages[0]["content"].startswith("CREATE TABLE")
    with pytest.raises(ValueError, match="--task e2e needs --data"):
        task_examples("e2e", "train", 5)


def test_dialogsum_split_keeps_a_repeated_dialogue_on_one_side(tmp_path):
    """A dialogue that appears in several records (one summary each) is one group: its
    summaries train together or are held out together, never both."""
    records = [
        {"dialogue": f"#Person1#: Line {i % 12}.\n#Person2#: Yes.", "summary": f"Summary {i}."}
        for i in range(48)
    ]
    src = str(_jsonl(tmp_path / "d.jsonl", records))
    train = task_examples("dialogsum", "train", data=src, val_fraction=0.25)
    held = task_examples("dialogsum", "test", data=src, val_fraction=0.25)
    prompts = [{e.messages[0]["content"] for e in side} for side in (train, held)]
    assert prompts[0] and prompts[1] and not prompts[0] & prompts[1]
    assert len(prompts[0]) + len(prompts[1]) == 12
    assert len(train) == 4 * len(prompts[0])  # every summary of a training dialogue trains


def test_data_split_command(tmp_path, capsys):
    from vllm_specstream.cli import main

    src = _jsonl(tmp_path / "d.jsonl", [_sql(i, db=f"db{i % 5}") for i in range(30)])
    assert main(["data", "split", "--task", "sql", "--data", str(src), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [
        str(tmp_path / "train.jsonl"),
        str(tmp_path / "val.jsonl"),
    ]
    assert main(["data", "split", "--task", "e2e", "--data", str(src), "--out", str(tmp_path)]) == 2
    assert "d.jsonl:1: missing field 'mr'" in capsys.readouterr().err


def test_eval_cases_take_the_held_out_part_with_all_references(tmp_path):
    from vllm_specstream.training.evaluate import eval_cases

    rows = [["mr", "ref"]] + [[f"name[R{i % 10}]", f"Ref {i}."] for i in range(40)]
    src = str(_csv(tmp_path / "dev.csv", rows))
    cases = eval_cases("e2e", None, None, data=src, split="val", val_fraction=0.2, split_seed=4)
    _, val = split_by_group(load_task_data("e2e", src), 0.2, seed=4)
    assert [c.messages for c in cases] == [r.messages for r in val]
    assert all(len(c.references) == 4 for c in cases)
    assert len(eval_cases("e2e", None, 3, data=src)) == 3
    with pytest.raises(ValueError, match="--data needs --task"):
        eval_cases("code", None, None, data=src)
    assert eval_cases("sql", None, 2)[0].references[0].startswith("SELECT")  # synthetic


def test_cli_task_and_split_arguments():
    from vllm_specstream.cli import build_parser
    from vllm_specstream.cli.train import _train_task

    parser = build_parser()
    args = parser.parse_args(
        ["eval", "--checkpoint", "c", "--task", "e2e", "--data", "f", "--split", "val"]
    )
    assert (args.task, args.data, args.split, args.val_fraction, args.split_seed) == (
        "e2e",
        "f",
        "val",
        0.15,
        0,
    )
    train = ["train", "--out", "o"]
    assert _train_task(parser.parse_args(train)) == "sql"  # the synthetic SQL generator
    assert _train_task(parser.parse_args([*train, "--data", "f"])) is None  # generic JSONL
    assert _train_task(parser.parse_args([*train, "--task", "e2e", "--data", "f"])) == "e2e"
    assert _train_task(parser.parse_args([*train, "--task", "e2e"])) is None  # an error


def test_bench_prompts_from_a_task_file(tmp_path):
    from vllm_specstream.bench.bench import BenchConfig, load_prompts

    class Template:  # prompt_text's only need: the chat template
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return messages[0]["content"]

    (tmp_path / "config.json").write_text("{}")
    src = _jsonl(tmp_path / "d.jsonl", [_sql(i, db=f"db{i % 5}") for i in range(30)])
    cfg = BenchConfig(str(tmp_path), task="sql", data=str(src), split="val", num_prompts=50)
    _, val = split_by_group(load_task_data("sql", src), 0.15)
    prompts = load_prompts(cfg, Template())
    assert len(prompts) == 50 and set(prompts) == {r.prompt for r in val}
    with pytest.raises(ValueError, match="missing field 'mr'"):
        BenchConfig(str(tmp_path), task="e2e", data=str(src))


# --------------------------------------------------------------------------- metrics


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("select name from singer", "SELECT Name FROM Singer"),  # case
        ("SELECT  count(*)\n  FROM t", "SELECT count ( * ) FROM t"),  # whitespace
        ('SELECT a FROM t WHERE c = "France"', "SELECT a FROM t WHERE c = 'France'"),  # quotes
        ("SELECT a FROM t;", "SELECT a FROM t"),  # trailing semicolon
        ("SELECT a FROM t T1", "SELECT a FROM t AS T1"),  # sqlglot: same query
        ("SELECT a FROM t WHERE b != 1", "SELECT a FROM t WHERE b <> 1"),
        ("SELECT a FROM t WHERE b='x'", "SELECT a FROM t WHERE b  =  'x'"),
        ("SELEC a FORM t", "selec a  form t"),  # unparsable: text normalisation decides
    ],
)
def test_sql_exact_match_normalises(pred, gold):
    assert sql_exact_match(pred, gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("SELECT a FROM t WHERE x > 1", "SELECT a FROM t WHERE x >= 1"),
        ("SELECT a FROM t ORDER BY b", "SELECT a FROM t ORDER BY b DESC"),
        ("SELECT count(*) FROM t", "SELECT count(*) FROM u"),
        ("SELECT a, b FROM t", "SELECT b, a FROM t"),
        ("SELEC a FORM t", "SELECT a FROM t"),
        ("", "SELECT a FROM t"),
    ],
)
def test_sql_exact_match_rejects_different_queries(pred, gold):
    assert not sql_exact_match(pred, gold)


def test_canonical_sql():
    assert (
        canonical_sql("select A from T t1 where b = 'X';") == 'select a from t as t1 where b = "x"'
    )
    assert canonical_sql("SELECT 1; SELECT 2") is None
    assert canonical_sql("SELECT a FROM t WHERE") is None


def test_split_sentences():
    assert (
        split_sentences(" It is cheap.  It is near X!\nYes ") == "It is cheap.\nIt is near X!\nYes"
    )


def test_rouge_known_values():
    assert rouge_scores("The cat sat on the mat.", ["the cat sat on the mat"]) == {
        "rouge1": 1.0,
        "rougeLsum": 1.0,
    }
    assert rouge_scores("alpha beta", ["gamma delta"]) == {"rouge1": 0.0, "rougeLsum": 0.0}
    # 5 of 6 unigrams shared both ways; LCS "the cat on the mat" = 5: F = 5/6.
    scores = rouge_scores("the cat sat on the mat", ["the cat lay on the mat"])
    assert scores == pytest.approx({"rouge1": 5 / 6, "rougeLsum": 5 / 6})
    # Sentence order does not matter to ROUGE-Lsum (a union LCS per reference sentence);
    # without the split it would be LCS 3 of 6 tokens, F = 0.5.
    scores = rouge_scores("The dog ran. The cat sat.", ["The cat sat. The dog ran."])
    assert scores == pytest.approx({"rouge1": 1.0, "rougeLsum": 1.0})
    assert rouge_scores("cats running", ["cat runs"])["rouge1"] == 1.0  # Porter stemming


def test_rouge_matches_rouge_score_and_takes_the_best_reference():
    from rouge_score.rouge_scorer import RougeScorer

    pred, refs = "the small cat sat here", ["a dog barked", "the cat sat there", "cat"]
    direct = RougeScorer(["rouge1", "rougeLsum"], use_stemmer=True).score_multi(refs, pred)
    assert rouge_scores(pred, refs) == pytest.approx({k: v.fmeasure for k, v in direct.items()})
    assert rouge_scores(pred, refs)["rouge1"] == pytest.approx(
        rouge_scores(pred, [refs[1]])["rouge1"]
    )


def test_task_metrics_average_best_references_in_percent():
    refs = [["x y", "the cat sat"], ["unrelated words"]]
    e2e = task_metrics("e2e", ["the cat sat", "the cat sat"], refs)
    assert e2e == pytest.approx({"rouge1": 50.0, "rougeLsum": 50.0})
    sql = task_metrics(
        "sql",
        ["select a from t", "SELECT b FROM t"],
        [["SELECT c", "SELECT a FROM t"], ["SELECT a FROM t"]],
    )
    assert sql == {"exact_match": 50.0}
    assert task_metrics("text", ["a b"], [["c", "a b"]]) == {"rouge_l": 100.0}
    with pytest.raises(ValueError, match="one reference list per prediction"):
        task_metrics("sql", ["a"], [])


# --------------------------------------------------------------------------- the real files

DATA = REPO.parent / "shared" / "data"
REAL = {
    "sql": (DATA / "spider" / "spider-dev-half.jsonl", 580, 580, 11),
    "e2e": (DATA / "e2e" / "devset.csv", 547, 4672, 547),
    "dialogsum": (DATA / "dialogsum" / "dialogsum.dev.jsonl", 500, 500, 498),
}


@pytest.mark.parametrize("task", sorted(REAL))
def test_real_development_files(task):
    path, n_records, n_refs, n_groups = REAL[task]
    if not path.is_file():
        pytest.skip(f"{path} not present (the shared data sits beside the repository in CI)")
    records = load_task_data(task, path)
    assert len(records) == n_records
    assert sum(len(r.references) for r in records) == n_refs
    assert len({r.group for r in records}) == n_groups
    train, val = split_by_group(records, 0.15)
    assert val and not {r.group for r in train} & {r.group for r in val}
