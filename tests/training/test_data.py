"""Training data layer: JSONL parsing, tokenisation masks, task builders, metrics."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest
from helpers import run_python

from vllm_specstream.training.data import (
    ChatExample,
    encode_example,
    end_of_turn_id,
    load_jsonl,
    prompt_text,
)
from vllm_specstream.training.metrics import normalize_sql, rouge_l, sql_exact_match
from vllm_specstream.training.tasks import (
    TASKS,
    build_task,
    code_test_packages,
    record_split,
    reference,
    stdlib_files,
    to_example,
)

TINY_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """A byte-level tokenizer with no merges (one token per byte) and a toy chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", chat_template=TINY_TEMPLATE
    )


@pytest.fixture(scope="module")
def smollm_tokenizer(base_model_dir: Path):
    # The concrete class loads the same files as AutoTokenizer without importing torch (~5 s).
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(base_model_dir)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- JSONL


def test_load_jsonl_reads_all_three_shapes_and_skips_blank_lines(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "2+2?", "completion": "4"}),
            "",
            "   ",
            json.dumps({"messages": chat}),
            json.dumps(
                {
                    "context": "CREATE TABLE t (a VARCHAR)",
                    "question": "All a?",
                    "answer": "SELECT a FROM t",
                }
            ),
        ],
    )
    assert load_jsonl(path) == [
        ChatExample([{"role": "user", "content": "2+2?"}], "4"),
        ChatExample(chat[:2], "Hello!"),
        ChatExample(
            [{"role": "user", "content": "CREATE TABLE t (a VARCHAR)\nQuestion: All a?"}],
            "SELECT a FROM t",
        ),
    ]


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"prompt": "p"}', "missing field 'completion'"),
        ('{"completion": "c"}', "missing field 'prompt'"),
        ('{"prompt": "p", "completion": "  "}', "empty 'completion'"),
        ('{"prompt": 3, "completion": "c"}', "field 'prompt' must be a string"),
        ('{"prompt": "p", "completion": "c"', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "hello"}', "unknown record shape"),
        ('{"context": "c", "question": "q"}', "missing field 'answer'"),
        ('{"context": "c", "question": "q", "answer": ""}', "empty 'answer'"),
        (
            '{"messages": [{"role": "user", "content": "hi"}]}',
            "field 'messages': last message must have role 'assistant'",
        ),
        ('{"messages": [{"role": "assistant", "content": "hi"}]}', "no prompt before"),
        (
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}',
            "empty assistant 'content'",
        ),
        (
            '{"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}',
            "messages[0]: missing field 'content'",
        ),
        ('{"messages": []}', "field 'messages' must be a non-empty list"),
    ],
)
def test_load_jsonl_errors_name_file_line_and_field(tmp_path, line, expected):
    good = json.dumps({"prompt": "p", "completion": "c"})
    path = _write(tmp_path, [good, "", line])  # the bad record is on line 3
    with pytest.raises(ValueError) as err:
        load_jsonl(path)
    message = str(err.value)
    assert message.startswith(f"{path}:3: "), message
    assert "data.jsonl" in message and expected in message, message


# --------------------------------------------------------------------------- encode_example

EXAMPLE = ChatExample(
    [
        {"role": "system", "content": "Answer in SQL."},
        {"role": "user", "content": "Count the rows of t."},
    ],
    "SELECT COUNT(*) FROM t",
)


def _split_by_mask(encoded: dict) -> tuple[list[int], list[int]]:
    ids, mask = encoded["input_ids"], encoded["labels_mask"]
    assert len(ids) == len(mask)
    prompt = [i for i, m in zip(ids, mask, strict=True) if not m]
    completion = [i for i, m in zip(ids, mask, strict=True) if m]
    # The mask is one False run then one True run: the completion is a suffix.
    assert mask == [False] * len(prompt) + [True] * len(completion)
    return prompt, completion


def test_mask_covers_exactly_completion_and_eos(tiny_tokenizer):
    encoded = encode_example(tiny_tokenizer, EXAMPLE, max_length=4096)
    prompt, completion = _split_by_mask(encoded)
    assert tiny_tokenizer.decode(completion) == EXAMPLE.completion + "<eos>"
    assert tiny_tokenizer.decode(prompt) == prompt_text(tiny_tokenizer, EXAMPLE.messages)
    assert prompt_text(tiny_tokenizer, EXAMPLE.messages).endswith("<assistant>")


def test_truncation_drops_prompt_from_the_left(tiny_tokenizer):
    full = encode_example(tiny_tokenizer, EXAMPLE, max_length=4096)
    n_completion = sum(full["labels_mask"])
    short = encode_example(tiny_tokenizer, EXAMPLE, max_length=n_completion + 5)
    assert len(short["input_ids"]) == n_completion + 5
    assert short["input_ids"] == full["input_ids"][-(n_completion + 5) :]
    assert short["labels_mask"] == [False] * 5 + [True] * n_completion


def test_completion_longer_than_max_length_is_cut_on_the_right(tiny_tokenizer):
    full = encode_example(tiny_tokenizer, EXAMPLE, max_length=4096)
    completion = [i for i, m in zip(full["input_ids"], full["labels_mask"], strict=True) if m]
    for max_length in (len(completion), 7):
        cut = encode_example(tiny_tokenizer, EXAMPLE, max_length=max_length)
        assert cut["input_ids"] == completion[:max_length]
        assert cut["labels_mask"] == [True] * max_length
    with pytest.raises(ValueError, match="max_length"):
        encode_example(tiny_tokenizer, EXAMPLE, max_length=0)


@pytest.mark.model
def test_smollm_mask_boundary(smollm_tokenizer):
    tok = smollm_tokenizer
    encoded = encode_example(tok, EXAMPLE, max_length=512)
    prompt, completion = _split_by_mask(encoded)
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode(completion) == EXAMPLE.completion + "<|im_end|>"
    text = prompt_text(tok, EXAMPLE.messages)
    assert tok.decode(prompt) == text and text.endswith("<|im_start|>assistant\n")
    # The template ends in a newline, so separate tokenisation equals tokenising the whole.
    whole = tok(text + EXAMPLE.completion + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert encoded["input_ids"] == whole
    short = encode_example(tok, EXAMPLE, max_length=len(completion) + 3)
    assert short["input_ids"] == whole[-(len(completion) + 3) :]


@pytest.mark.model
def test_replies_end_with_the_chat_templates_end_of_turn_whatever_the_eos(base_model_dir):
    """A tokenizer converted with a wrong eos (<|im_start|>) still ends every completion, and
    the reference decoder's stop, with <|im_end|>: the token the chat format and vLLM stop at
    (trained with the wrong one, a model never ends its replies)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(base_model_dir)
    assert end_of_turn_id(tok) == 2
    tok = PreTrainedTokenizerFast.from_pretrained(base_model_dir)
    tok.eos_token = "<|im_start|>"
    assert tok.eos_token_id == 1 and end_of_turn_id(tok) == 2
    encoded = encode_example(tok, EXAMPLE, max_length=512)
    assert encoded["input_ids"][-1] == 2 and encoded["labels_mask"][-1]


# --------------------------------------------------------------------------- task builders


def test_build_task_rejects_unknown_names():
    with pytest.raises(ValueError, match="sql, code, text"):
        build_task("poetry", "train")
    with pytest.raises(ValueError, match="train, test"):
        build_task("sql", "validation")
    with pytest.raises(ValueError, match="sql, code, text"):
        to_example("poetry", {})


@pytest.mark.parametrize("task", TASKS)
def test_builders_are_deterministic_per_seed(task):
    first = build_task(task, "train", n=50, seed=0)
    assert len(first) == 50
    assert build_task(task, "train", n=50, seed=0) == first
    assert build_task(task, "train", n=50, seed=1) != first
    assert build_task(task, "test", n=20, seed=0) == build_task(task, "test", n=20, seed=0)


@pytest.fixture(scope="module")
def sql_splits() -> tuple[list[dict], list[dict]]:
    return build_task("sql", "train", n=2000), build_task("sql", "test", n=300)


def test_sql_splits_do_not_leak(sql_splits):
    train, test = sql_splits
    assert len(train) == 2000 and len(test) == 300
    train_pairs = {(r["context"], r["question"]) for r in train}
    test_pairs = {(r["context"], r["question"]) for r in test}
    assert len(train_pairs) == 2000 and len(test_pairs) == 300
    assert not train_pairs & test_pairs
    # Split membership is a property of the pair, not of the draw.
    assert {record_split("sql", r) for r in train} == {"train"}
    assert {record_split("sql", r) for r in test} == {"test"}


def test_sql_variety(sql_splits):
    train, _ = sql_splits
    assert len({r["context"] for r in train}) >= 500
    assert len({r["question"] for r in train}) >= 1900
    answers = [r["answer"] for r in train]
    shapes = {
        "where": r"WHERE \w+ = ",
        "count": r"COUNT\(\*\)",
        "aggregate": r"(MAX|MIN|AVG|SUM)\(",
        "order": r"ORDER BY \w+( DESC)? LIMIT \d+$",
        "group": r"GROUP BY",
        "having": r"HAVING",
        "and": r" AND ",
        "distinct": r"SELECT DISTINCT",
        "greater": r" > ",
        "less": r" < ",
        "join": r"JOIN \w+ AS T2 ON T1\.\w+ = T2\.\w+",
    }
    for shape, pattern in shapes.items():
        assert sum(bool(re.search(pattern, a)) for a in answers) >= 20, shape
    contexts = "\n".join(r["context"] for r in train)
    for sql_type in ("VARCHAR", "INTEGER", "REAL", "TEXT", "DATE"):
        assert f" {sql_type}" in contexts
    assert sum(", CREATE TABLE " in r["context"] for r in train) >= 100
    assert not any("'" in a for a in answers)  # string literals are double-quoted
    assert any(re.search(r'= "[A-Z][a-z]+"', a) for a in answers)
    for r in train:
        for table in r["context"].split(", CREATE TABLE "):
            assert 2 <= table.count(",") + 1 <= 7  # 2-6 columns, plus a join key


def test_sql_answers_run_against_their_schema(sql_splits):
    """Every query is valid SQL over exactly the columns and tables of its context."""
    for r in sql_splits[0][:600] + sql_splits[1]:
        db = sqlite3.connect(":memory:")
        for create in r["context"].split(", CREATE TABLE "):
            db.execute(create if create.startswith("CREATE") else f"CREATE TABLE {create}")
        # Literals hold no quotes; single quotes keep sqlite from reading them as identifiers.
        db.execute(r["answer"].replace('"', "'")).fetchall()
        db.close()


def test_text_task_splits_and_records():
    train, test = build_task("text", "train"), build_task("text", "test")
    assert len(train) == 2000 and len(test) == 300
    assert not {r["mr"] for r in train} & {r["mr"] for r in test}
    assert {record_split("text", r) for r in test} == {"test"}
    assert len({r["mr"] for r in train}) == 2000
    assert len({r["ref"].split()[0] for r in train}) >= 3  # several sentence templates
    for r in train + test:
        name = re.match(r"name\[([^\]]+)\]", r["mr"]).group(1)
        assert name in r["ref"] and r["ref"].endswith(".")
        for value in re.findall(r"(?:near|food)\[([^\]]+)\]", r["mr"]):
            assert value.lower() in r["ref"].lower()


def test_code_task_splits_by_module():
    train, test = build_task("code", "train"), build_task("code", "test")
    assert len(train) == 2000 and len(test) == 200
    packages = {
        split: {r["module"].split(".")[0] for r in records}
        for split, records in (("train", train), ("test", test))
    }
    assert not packages["train"] & packages["test"]
    assert packages["test"] <= code_test_packages()
    assert {record_split("code", r) for r in test} == {"test"}
    assert {record_split("code", r) for r in train[:100]} == {"train"}
    assert len({r["module"] for r in train}) >= 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train[:200] + test:
        body = re.fullmatch(
            r"Continue this Python code:\n```python\n(.*)\n```", r["prompt"], re.DOTALL
        )
        assert body, r["prompt"][:80]
        assert 20 <= len(body.group(1).split("\n")) <= 40
        assert 8 <= len(r["completion"].split("\n")) <= 16
    assert not any(m.startswith(("test.", "idlelib")) for m, _ in stdlib_files())


def test_to_example_and_reference():
    sql = {"context": "CREATE TABLE t (a VARCHAR)", "question": "Q?", "answer": "SELECT a FROM t"}
    assert to_example("sql", sql) == ChatExample(
        [{"role": "user", "content": "CREATE TABLE t (a VARCHAR)\nQuestion: Q?"}], "SELECT a FROM t"
    )
    text = {"mr": "name[X], area[riverside]", "ref": "X is by the riverside."}
    assert to_example("text", text).messages[0]["content"] == (
        "Write one sentence describing this restaurant: name[X], area[riverside]"
    )
    code = {
        "module": "m",
        "prompt": "Continue this Python code:\n```python\nx = 1\n```",
        "completion": "y = 2",
    }
    assert to_example("code", code).messages == [{"role": "user", "content": code["prompt"]}]
    assert [reference(t, r) for t, r in (("sql", sql), ("text", text), ("code", code))] == [
        "SELECT a FROM t",
        "X is by the riverside.",
        "y = 2",
    ]


# --------------------------------------------------------------------------- metrics


def test_normalize_sql_and_exact_match():
    assert normalize_sql("  SELECT  name\nFROM t WHERE city = 'Paris' ; ") == (
        'select name from t where city = "paris"'
    )
    assert sql_exact_match("select COUNT( * ) from t;", "SELECT COUNT(*) FROM t")
    assert sql_exact_match("SELECT a , b FROM t", "SELECT a, b FROM t")
    assert not sql_exact_match("SELECT a FROM t", "SELECT b FROM t")
    assert not sql_exact_match("SELECT a FROM t WHERE x = 1", "SELECT a FROM t WHERE x = 2")


def test_rouge_l():
    assert rouge_l("The cat sat.", "the cat sat") == 1.0
    assert rouge_l("alpha beta", "gamma delta") == 0.0
    # LCS(the cat sat on the mat, the cat lay on a mat) = the cat on mat: P = R = 4/6.
    assert rouge_l("the cat sat on the mat", "the cat lay on a mat") == pytest.approx(2 / 3)
    # LCS = a c: P = 2/3, R = 2/4, F = 2PR / (P + R) = 4/7.
    assert rouge_l("a b c", "a x c d") == pytest.approx(4 / 7)
    assert rouge_l("", "") == 1.0 and rouge_l("", "a") == 0.0


def test_modules_import_without_heavy_dependencies():
    out = run_python(
        "import sys, vllm_specstream.training.data, vllm_specstream.training.tasks\n"
        "import vllm_specstream.training.metrics\n"
        "print([m for m in ('torch', 'transformers', 'vllm') if m in sys.modules])"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
