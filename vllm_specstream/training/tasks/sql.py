"""Synthetic text-to-SQL task: schema vocabularies, query shapes and the record builder."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

from vllm_specstream.training.tasks._english import articled
from vllm_specstream.training.tasks._split import draw, normalise_key

# =========================================================================== SQL schemas

#: The generator's vocabulary (names, value pools, entities and their columns), package data.
_VOCABULARY = json.loads(
    resources.files("vllm_specstream.training.tasks").joinpath("sql_vocabulary.json").read_text()
)
_FIRST = tuple(_VOCABULARY["first_names"])
_LAST = tuple(_VOCABULARY["last_names"])
_ADJ = tuple(_VOCABULARY["adjectives"])
_NOUN = tuple(_VOCABULARY["nouns"])
_COMPANIES = tuple(_VOCABULARY["companies"])
#: Value pools for string columns, keyed by kind.
_POOLS: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in _VOCABULARY["pools"].items()}


def _value(kind: str, rng: random.Random) -> str | int | float:
    """A random value for a column of ``kind``: ``int:lo:hi[:step]``, ``real:lo:hi``,
    ``date``, ``person``, ``title``, ``company`` or a pool name."""
    head, *args = kind.split(":")
    if head == "int":
        lo, hi, *step = (int(a) for a in args)
        return rng.randrange(lo, hi + 1, step[0] if step else 1)
    if head == "real":
        return round(rng.uniform(float(args[0]), float(args[1])), 1)
    if head == "date":
        return f"{rng.randint(1990, 2023)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if head == "person":
        return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    if head == "title":
        return f"{rng.choice(_ADJ)} {rng.choice(_NOUN)}"
    if head == "company":
        return rng.choice(_COMPANIES)
    return rng.choice(_POOLS[head])


@dataclass(frozen=True)
class Column:
    """A column a table of an entity may have: SQL type and how to draw its values."""

    name: str
    sql_type: str
    kind: str

    @property
    def numeric(self) -> bool:
        return self.sql_type in ("INTEGER", "REAL")

    @property
    def phrase(self) -> str:
        return self.name.replace("_", " ")


@dataclass(frozen=True)
class Entity:
    """A kind of row (employee, flight, ...) with the table names and columns it may use."""

    singular: str
    plural: str
    tables: tuple[str, ...]
    columns: tuple[Column, ...]


def _cols(spec: str) -> tuple[Column, ...]:
    """Parse ``"name TYPE kind, ..."`` into columns (the vocabulary file's spelling)."""
    return tuple(Column(*part.split()) for part in spec.split(", "))


ENTITIES: dict[str, Entity] = {
    e["plural"]: Entity(e["singular"], e["plural"], tuple(e["tables"]), _cols(e["columns"]))
    for e in _VOCABULARY["entities"]
}

#: Joinable pairs (child, parent, key): ``child.key = parent.key``.
JOINS = (
    ("employees", "departments", "department_id"),
    ("orders", "customers", "customer_id"),
    ("products", "suppliers", "supplier_id"),
    ("students", "courses", "course_id"),
    ("flights", "airlines", "airline_id"),
    ("games", "publishers", "publisher_id"),
    ("songs", "artists", "artist_id"),
    ("doctors", "hospitals", "hospital_id"),
    ("movies", "directors", "director_id"),
    ("books", "authors", "author_id"),
    ("players", "teams", "team_id"),
)


# =========================================================================== SQL queries


def _sql_literal(value: str | int | float) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


class _Table:
    """A concrete table for one query: name, entity and the columns the query uses."""

    def __init__(self, entity: Entity, rng: random.Random, name: str | None = None):
        self.entity = entity
        self.rng = rng
        # Like sql-create-context, some tables carry WikiSQL's generic names.
        self.name = name or (
            f"table_name_{rng.randint(1, 99)}" if rng.random() < 0.15 else rng.choice(entity.tables)
        )
        self.used: list[Column] = []
        self.extra: list[Column] = []

    def pick(self, numeric: bool | None = None) -> Column:
        """An unused column (optionally only numeric / non-numeric); recorded for the schema."""
        options = [
            c
            for c in self.entity.columns
            if c not in self.used and (numeric is None or c.numeric == numeric)
        ]
        column = self.rng.choice(options)
        self.used.append(column)
        return column

    def value(self, column: Column) -> str | int | float:
        return _value(column.kind, self.rng)

    def create(self, pad: int) -> str:
        """``CREATE TABLE`` with the used columns plus up to ``pad`` distractors, shuffled."""
        spare = [c for c in self.entity.columns if c not in self.used]
        columns = self.used + self.extra + self.rng.sample(spare, min(pad, len(spare)))
        self.rng.shuffle(columns)
        body = ", ".join(f"{c.name} {c.sql_type}" for c in columns)
        return f"CREATE TABLE {self.name} ({body})"


def _q_select_where(t: _Table, r: random.Random) -> tuple[str, str]:
    a, b = t.pick(), t.pick()
    v = t.value(b)
    e = t.entity
    question = r.choice(
        (
            f"What is the {a.phrase} of the {e.singular} with {b.phrase} {v}?",
            f"What is the {a.phrase} of the {e.singular} whose {b.phrase} is {v}?",
            f"Which {a.phrase} belongs to the {e.singular} with a {b.phrase} of {v}?",
            f"Name the {a.phrase} when the {b.phrase} is {v}.",
            f"Tell me the {a.phrase} for {b.phrase} of {v}.",
        )
    )
    return question, f"SELECT {a.name} FROM {t.name} WHERE {b.name} = {_sql_literal(v)}"


def _q_count_where(t: _Table, r: random.Random) -> tuple[str, str]:
    b = t.pick()
    v = t.value(b)
    question = r.choice(
        (
            f"How many {t.entity.plural} have {b.phrase} {v}?",
            f"How many {t.entity.plural} are there whose {b.phrase} is {v}?",
            f"Count the number of {t.entity.plural} with a {b.phrase} of {v}.",
        )
    )
    return question, f"SELECT COUNT(*) FROM {t.name} WHERE {b.name} = {_sql_literal(v)}"


_AGGREGATES = {
    "MAX": ("highest", "maximum", "largest"),
    "MIN": ("lowest", "minimum", "smallest"),
    "AVG": ("average", "mean"),
    "SUM": ("total",),
}


def _q_aggregate(t: _Table, r: random.Random) -> tuple[str, str]:
    fn = r.choice(tuple(_AGGREGATES))
    word = r.choice(_AGGREGATES[fn])
    n = t.pick(numeric=True)
    select = f"SELECT {fn}({n.name}) FROM {t.name}"
    if r.random() < 0.5:
        return f"What is the {word} {n.phrase} of all {t.entity.plural}?", select
    b = t.pick()
    v = t.value(b)
    question = r.choice(
        (
            f"What is the {word} {n.phrase} of {t.entity.plural} whose {b.phrase} is {v}?",
            f"What is the {word} {n.phrase} when the {b.phrase} is {v}?",
        )
    )
    return question, f"{select} WHERE {b.name} = {_sql_literal(v)}"


def _q_order_limit(t: _Table, r: random.Random) -> tuple[str, str]:
    a, n = t.pick(), t.pick(numeric=True)
    desc = r.random() < 0.6
    extreme = "highest" if desc else "lowest"
    order = f"ORDER BY {n.name} DESC" if desc else f"ORDER BY {n.name}"
    select = f"SELECT {a.name} FROM {t.name} {order}"
    k = r.choice((1, 1, 3, 5, 10))
    if r.random() < 0.2:
        direction = "descending" if desc else "ascending"
        return (
            f"List the {a.phrase} of all {t.entity.plural} sorted by {n.phrase} in "
            f"{direction} order.",
            select,
        )
    if k == 1:
        question = r.choice(
            (
                f"What is the {a.phrase} of the {t.entity.singular} with the {extreme} {n.phrase}?",
                f"Which {t.entity.singular} has the {extreme} {n.phrase}? Give its {a.phrase}.",
            )
        )
    else:
        question = (
            f"List the {a.phrase} of the {k} {t.entity.plural} with the {extreme} {n.phrase}."
        )
    return question, f"{select} LIMIT {k}"


def _q_group_by(t: _Table, r: random.Random) -> tuple[str, str]:
    g = t.pick(numeric=False)
    roll = r.random()
    if roll < 0.4:
        return (
            f"How many {t.entity.plural} are there for each {g.phrase}?",
            f"SELECT {g.name}, COUNT(*) FROM {t.name} GROUP BY {g.name}",
        )
    if roll < 0.75:
        fn = r.choice(("AVG", "MAX", "MIN", "SUM"))
        word = _AGGREGATES[fn][0]
        n = t.pick(numeric=True)
        return (
            f"What is the {word} {n.phrase} for each {g.phrase}?",
            f"SELECT {g.name}, {fn}({n.name}) FROM {t.name} GROUP BY {g.name}",
        )
    k = r.randint(1, 20)
    return (
        f"Which {g.phrase} values have more than {k} {t.entity.plural}?",
        f"SELECT {g.name} FROM {t.name} GROUP BY {g.name} HAVING COUNT(*) > {k}",
    )


def _q_where_and(t: _Table, r: random.Random) -> tuple[str, str]:
    a, b, c = t.pick(), t.pick(), t.pick()
    vb, vc = t.value(b), t.value(c)
    question = r.choice(
        (
            f"What is the {a.phrase} of the {t.entity.singular} whose {b.phrase} is {vb} and "
            f"{c.phrase} is {vc}?",
            f"Name the {a.phrase} when the {b.phrase} is {vb} and the {c.phrase} is {vc}.",
            f"Which {a.phrase} has {b.phrase} {vb} and {c.phrase} {vc}?",
        )
    )
    where = f"{b.name} = {_sql_literal(vb)} AND {c.name} = {_sql_literal(vc)}"
    return question, f"SELECT {a.name} FROM {t.name} WHERE {where}"


def _q_distinct(t: _Table, r: random.Random) -> tuple[str, str]:
    a = t.pick(numeric=False)
    select = f"SELECT DISTINCT {a.name} FROM {t.name}"
    if r.random() < 0.5:
        return r.choice(
            (
                f"What are the distinct {a.phrase} values of all {t.entity.plural}?",
                f"List the different {a.phrase} values among the {t.entity.plural}.",
            )
        ), select
    n = t.pick(numeric=True)
    v = t.value(n)
    return (
        f"What are the distinct {a.phrase} values of {t.entity.plural} with {n.phrase} "
        f"greater than {v}?",
        f"{select} WHERE {n.name} > {v}",
    )


def _q_compare(t: _Table, r: random.Random) -> tuple[str, str]:
    n = t.pick(numeric=True)
    lo, hi = sorted((t.value(n), t.value(n)))
    roll = r.random()
    if roll < 0.3:
        a = t.pick()
        return (
            f"List the {a.phrase} of {t.entity.plural} whose {n.phrase} is between {lo} and {hi}.",
            f"SELECT {a.name} FROM {t.name} WHERE {n.name} > {lo} AND {n.name} < {hi}",
        )
    op, words = r.choice(
        ((">", ("greater than", "more than", "above")), ("<", ("less than", "below", "under")))
    )
    word = r.choice(words)
    if roll < 0.5:
        return (
            f"How many {t.entity.plural} have a {n.phrase} {word} {lo}?",
            f"SELECT COUNT(*) FROM {t.name} WHERE {n.name} {op} {lo}",
        )
    a = t.pick()
    return (
        f"Which {a.phrase} values belong to {t.entity.plural} with {n.phrase} {word} {lo}?",
        f"SELECT {a.name} FROM {t.name} WHERE {n.name} {op} {lo}",
    )


QueryShape = Callable[[_Table, random.Random], tuple[str, str]]
#: Single-table shapes and their weights.
SQL_SHAPES: dict[str, tuple[QueryShape, int]] = {
    "select_where": (_q_select_where, 4),
    "count_where": (_q_count_where, 2),
    "aggregate": (_q_aggregate, 2),
    "order_limit": (_q_order_limit, 2),
    "group_by": (_q_group_by, 2),
    "where_and": (_q_where_and, 2),
    "distinct": (_q_distinct, 1),
    "compare": (_q_compare, 2),
}
JOIN_WEIGHT = 2


def _sql_join(rng: random.Random) -> dict:
    child_name, parent_name, key_name = rng.choice(JOINS)
    child = _Table(ENTITIES[child_name], rng, rng.choice(ENTITIES[child_name].tables))
    parent = _Table(ENTITIES[parent_name], rng, rng.choice(ENTITIES[parent_name].tables))
    key = Column(key_name, "INTEGER", "int:1:999")
    child.extra.append(key)
    parent.extra.append(key)
    p = parent.pick()
    v = parent.value(p)
    ce, pe = child.entity, parent.entity
    on = f"{child.name} AS T1 JOIN {parent.name} AS T2 ON T1.{key.name} = T2.{key.name}"
    where = f"WHERE T2.{p.name} = {_sql_literal(v)}"
    if rng.random() < 0.35:
        question = (
            f"How many {ce.plural} belong to {articled(pe.singular)} whose {p.phrase} is {v}?"
        )
        answer = f"SELECT COUNT(*) FROM {on} {where}"
    else:
        a = child.pick()
        question = rng.choice(
            (
                f"What are the {a.phrase} values of {ce.plural} whose {pe.singular} has "
                f"{p.phrase} {v}?",
                f"Find the {a.phrase} of the {ce.plural} linked to the {pe.singular} with "
                f"{p.phrase} {v}.",
            )
        )
        answer = f"SELECT T1.{a.name} FROM {on} {where}"
    context = f"{child.create(rng.randint(1, 3))}, {parent.create(rng.randint(0, 2))}"
    return {"context": context, "question": question, "answer": answer}


def sql_record(rng: random.Random) -> dict:
    """One random text-to-SQL record ``{"context", "question", "answer"}``."""
    names = list(SQL_SHAPES) + ["join"]
    weights = [w for _, w in SQL_SHAPES.values()] + [JOIN_WEIGHT]
    shape = rng.choices(names, weights)[0]
    if shape == "join":
        return _sql_join(rng)
    table = _Table(rng.choice(list(ENTITIES.values())), rng)
    question, answer = SQL_SHAPES[shape][0](table, rng)
    # 2-6 columns in all, as in the task statement; the query may already use up to 3.
    pad = max(0, rng.randint(2, 6) - len(table.used))
    return {"context": table.create(pad), "question": question, "answer": answer}


def sql_key(record: dict) -> str:
    return normalise_key(record["context"], record["question"])


def build_sql(split: str, n: int, seed: int) -> list[dict]:
    """``n`` distinct text-to-SQL records of ``split``."""
    return draw("sql", split, n, seed, sql_record, sql_key)
