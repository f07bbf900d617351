"""Schema renaming for SQL training records: the same question over a database whose tables
and columns carry other names.

With a few databases to learn from, a model (and its streams, which draft several tokens
ahead) memorises their identifiers instead of copying names from the schema in the prompt;
on an unseen database its drafts then miss exactly the names. A renamed copy keeps each
record's structure and meaning and changes the words its identifiers are made of,
consistently in the schema, the question and the gold query:

    CREATE TABLE singer (Singer_ID INTEGER, Name VARCHAR, Song_Name VARCHAR)
    Question: How many singers do we have?          SELECT count(*) FROM singer
->  CREATE TABLE vessel (Vessel_ID INTEGER, Name VARCHAR, Cargo_Name VARCHAR)
    Question: How many vessels do we have?          SELECT count(*) FROM vessel

Identifiers are split into word parts (``Song_Name`` -> ``Song``, ``_``, ``Name``;
``CountryCode`` -> ``Country``, ``Code``); a part is renamed with probability ``rate`` to a word
of ``pool`` not in the schema, keeping its letter case; a question word is renamed when it is
a renamed part or its plural. Quoted values in the query are left alone; a few parts that
name a column's role rather than its domain (:data:`KEPT_PARTS`) are kept.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence

#: Parts kept as they are: they say what a column is in any domain, or join the words of one.
DEFAULT_RENAME_RATE = 0.5
"""Share of a schema's word parts a renamed copy renames, unless told otherwise."""

KEPT_PARTS = frozenset(
    {
        "id",
        "code",
        "name",
        "type",
        "date",
        "year",
        "the",
        "and",
        "for",
        "has",
        "per",
        "with",
        "from",
        "num",
        "number",
    }
)
#: Shorter parts are kept too (``of``, ``by``, ``is``, abbreviations).
MIN_RENAMED_LENGTH = 3

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PART = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+|_")
_TABLE = re.compile(r"CREATE TABLE\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(([^)]*)\)", re.IGNORECASE)
_QUOTED = re.compile(r"(\"[^\"]*\"|'[^']*')")
_WORD = re.compile(r"[A-Za-z]+")


def schema_identifiers(context: str) -> list[str]:
    """Table and column names of ``CREATE TABLE t (col TYPE, ...)`` statements, in order."""
    names: list[str] = []
    for table, columns in _TABLE.findall(context):
        names.append(table)
        names += [c.split()[0] for c in columns.split(",") if c.strip()]
    return names


def split_parts(identifier: str) -> list[str] | None:
    """Word parts and separators of ``identifier`` (None where they do not rebuild it)."""
    parts = _PART.findall(identifier)
    return parts if "".join(parts) == identifier else None


def _word_parts(identifiers: Iterable[str]) -> set[str]:
    return {
        p.lower()
        for ident in identifiers
        for p in split_parts(ident) or ()
        if p.isalpha() and len(p) > 1
    }


def pool_words(contexts: Iterable[str]) -> list[str]:
    """Lower-case word parts (3+ letters) of the identifiers of ``contexts``, sorted."""
    return sorted(
        w for w in _word_parts(i for c in contexts for i in schema_identifiers(c)) if len(w) >= 3
    )


def _cased(word: str, like: str) -> str:
    if like.isupper() and len(like) > 1:
        return word.upper()
    if like[:1].isupper():
        return word.capitalize()
    return word


def part_mapping(
    identifiers: Sequence[str], pool: Sequence[str], rng: random.Random, rate: float
) -> dict[str, str]:
    """Lower-case part -> new lower-case word, one-to-one, new words not in the schema."""
    parts = sorted(p for p in _word_parts(identifiers) - KEPT_PARTS if len(p) >= MIN_RENAMED_LENGTH)
    taken = _word_parts(identifiers)
    free = [w for w in pool if w not in taken]
    rng.shuffle(free)
    mapping: dict[str, str] = {}
    for part in parts:
        if free and rng.random() < rate:
            mapping[part] = free.pop()
    return mapping


def _rename_identifier(identifier: str, mapping: dict[str, str]) -> str:
    parts = split_parts(identifier)
    if parts is None:
        return identifier
    return "".join(_cased(mapping[p.lower()], p) if p.lower() in mapping else p for p in parts)


def _rename_code(text: str, known: dict[str, str], mapping: dict[str, str]) -> str:
    """Schema identifiers of ``text`` (SQL or DDL) renamed; quoted values untouched.

    ``known``: lower-case identifier -> its spelling in the schema. An identifier spelt with
    other parts than in the schema (``countrycode`` for ``CountryCode``) takes the schema's
    renamed spelling, so both sides keep naming the same column."""

    def one(m: re.Match) -> str:
        ident = m.group()
        spelling = known.get(ident.lower())
        if spelling is None:
            return ident
        own, theirs = split_parts(ident), split_parts(spelling)
        if own is not None and theirs is not None and len(own) == len(theirs):
            return _rename_identifier(ident, mapping)
        return _rename_identifier(spelling, mapping)

    pieces = _QUOTED.split(text)
    for i in range(0, len(pieces), 2):  # odd pieces are the quoted values
        pieces[i] = _IDENT.sub(one, pieces[i])
    return "".join(pieces)


def plural(word: str) -> str:
    """English plural of a lower-case noun, by the regular rules."""
    if word.endswith("y") and word[-2:-1] not in ("a", "e", "i", "o", "u"):
        return word[:-1] + "ies"
    if word.endswith(("s", "x", "z", "ch", "sh")):
        return word + "es"
    return word + "s"


def _rename_words(text: str, parts: set[str], mapping: dict[str, str]) -> str:
    """Words of the question that are renamed parts, or their plurals, renamed; a word that
    is itself a part of the schema (``matches``) is only renamed as that part."""

    def one(m: re.Match) -> str:
        word = m.group()
        low = word.lower()
        if low in mapping:
            return _cased(mapping[low], word)
        if low in parts:
            return word
        for suffix, stem in (("ies", low[:-3] + "y"), ("es", low[:-2]), ("s", low[:-1])):
            if low.endswith(suffix) and stem in mapping:
                return _cased(plural(mapping[stem]), word)
        return word

    return _WORD.sub(one, text)


def rename_schema(
    context: str,
    question: str,
    answer: str,
    pool: Sequence[str],
    rng: random.Random,
    rate: float = DEFAULT_RENAME_RATE,
) -> tuple[str, str, str]:
    """``(context, question, answer)`` with the schema's word parts renamed consistently."""
    identifiers = schema_identifiers(context)
    mapping = part_mapping(identifiers, pool, rng, rate)
    if not mapping:
        return context, question, answer
    known = {i.lower(): i for i in identifiers}
    return (
        _rename_code(context, known, mapping),
        _rename_words(question, _word_parts(identifiers), mapping),
        _rename_code(answer, known, mapping),
    )


def entity_words() -> list[str]:
    """Domain words (3+ letters) of the synthetic SQL generator's tables and columns."""
    from vllm_specstream.training.tasks.sql import ENTITIES

    names = [t for e in ENTITIES.values() for t in e.tables]
    names += [c.name for e in ENTITIES.values() for c in e.columns]
    return sorted({w for n in names for w in n.lower().split("_") if len(w) >= 3 and w.isalpha()})
