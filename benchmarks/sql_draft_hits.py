"""Which SQL tokens the streams draft right: hit rate of each stream by the kind of token it
had to draft, on the model's own greedy queries for held-out questions.

For each prompt the checkpoint's greedy query is decoded, then the prompt and the query are
run once with every query position as an anchor: stream ``j`` at position ``t`` drafts the
token at ``t + 1 + j`` (the main head gives ``t + 1``), the token a chain step would accept.
Each target token is classed by the word of the query it falls in:

- ``keyword``: an SQL keyword or function (``SELECT``, ``count``, ``GROUP``);
- ``schema``: a table or column name of the prompt's ``CREATE TABLE`` statements;
- ``alias``: a table alias (``T1``, ``T2``);
- ``other-word``: any other name (one the schema lacks);
- ``literal``: inside quotes, or a number;
- ``punct``: anything else (``(``, ``,``, ``=``, ``*``, spaces).

A model that memorised its training databases drafts the keywords and misses the held-out
schema's names. Prints a table, writes JSON.

    .venv/bin/python benchmarks/sql_draft_hits.py CHECKPOINT --data FILE [--split val]
        [-n 30] [--out benchmarks/results/sql/draft-hits/NAME.json]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import torch

from vllm_specstream.machine import describe_machine

CLASSES = ("keyword", "alias", "punct", "schema", "other-word", "literal")
KEYWORDS = frozenset(
    [
        "select",
        "from",
        "where",
        "group",
        "by",
        "order",
        "having",
        "limit",
        "join",
        "on",
        "as",
        "and",
        "or",
        "not",
        "in",
        "like",
        "between",
        "distinct",
        "count",
        "sum",
        "avg",
        "min",
        "max",
        "desc",
        "asc",
        "union",
        "intersect",
        "except",
        "is",
        "null",
        "inner",
        "left",
        "outer",
        "exists",
        "case",
        "when",
        "then",
        "else",
        "end",
        "cast",
    ]
)
_ALIAS = re.compile(r"T\d+", re.IGNORECASE)
_TOKEN_CLASS = re.compile(r"(\"[^\"]*\"?|'[^']*'?)|([A-Za-z_][A-Za-z0-9_]*)|(\d+(?:\.\d+)?)")


def char_classes(query: str, schema_names: set[str]) -> list[str]:
    """The class of each character of ``query`` (see the module docstring)."""
    classes = ["punct"] * len(query)
    for m in _TOKEN_CLASS.finditer(query):
        quoted, word, number = m.groups()
        if quoted or number:
            kind = "literal"
        elif word.lower() in KEYWORDS:
            kind = "keyword"
        elif _ALIAS.fullmatch(word):
            kind = "alias"
        elif word.lower() in schema_names:
            kind = "schema"
        else:
            kind = "other-word"
        classes[m.start() : m.end()] = [kind] * (m.end() - m.start())
    return classes


def token_classes(offsets: list[tuple[int, int]], classes: list[str]) -> list[str]:
    """A token's class: that of its first non-space character (``punct`` if it has none)."""
    out = []
    for start, end in offsets:
        kinds = [classes[i] for i in range(start, end) if i < len(classes)]
        word = [k for k in kinds if k != "punct"]
        out.append(word[0] if word else "punct")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="merged checkpoint or adapter directory")
    ap.add_argument("--data", required=True, help="SQL task file (sql-create-context form)")
    ap.add_argument("--split", default="val", choices=("val", "train"))
    ap.add_argument("-n", type=int, default=30, help="prompts (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vllm_specstream.training.data import end_of_turn_id, prompt_text
    from vllm_specstream.training.evaluate import eval_cases, load_any
    from vllm_specstream.training.reference_decoder import plain_greedy
    from vllm_specstream.training.tasks.sql_rename import schema_identifiers

    torch.set_num_threads(2)
    model = load_any(args.checkpoint).eval()
    tok = AutoTokenizer.from_pretrained(model.config.base_model)
    cases = eval_cases("sql", None, args.n, data=args.data, split=args.split)
    eos = end_of_turn_id(tok)
    streams = model.config.num_streams
    hits = {j: Counter() for j in range(streams + 1)}  # 0: the main head
    totals = {j: Counter() for j in range(streams + 1)}
    for case in cases:
        prompt = tok(prompt_text(tok, case.messages), add_special_tokens=False).input_ids
        with torch.no_grad():
            reply = plain_greedy(model, prompt, args.max_new_tokens, eos)
        if reply and reply[-1] == eos:
            reply = reply[:-1]
        text = tok.decode(reply)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        if enc["input_ids"] != reply:  # re-tokenising changed the ids: class by position only
            continue
        names = {n.lower() for n in schema_identifiers(case.messages[-1]["content"])}
        kinds = token_classes(enc["offset_mapping"], char_classes(text, names))
        ids = prompt + reply
        anchors = torch.arange(len(prompt) - 1, len(ids))[None]
        with torch.no_grad():
            out = model(torch.tensor([ids]), anchors=anchors)
            main = model.lm_head(out.main_hidden[0, anchors[0]]).argmax(-1)
            drafts = [model.stream_logits(h).argmax(-1) for h in out.stream_hidden[0]]
        for a, t in enumerate(range(len(prompt) - 1, len(ids))):
            for j in range(streams + 1):
                target = t + 1 + j
                if not len(prompt) <= target < len(ids):
                    continue
                kind = kinds[target - len(prompt)]
                guess = int(main[a]) if j == 0 else int(drafts[a][j - 1])
                hits[j][kind] += guess == ids[target]
                totals[j][kind] += 1
    rows = {
        kind: {
            "share": totals[1][kind] / max(1, sum(totals[1].values())),
            **{
                f"stream{j}" if j else "main": hits[j][kind] / max(1, totals[j][kind])
                for j in range(streams + 1)
            },
        }
        for kind in CLASSES
    }
    print(f"{args.checkpoint}, {len(cases)} {args.split} prompts ({describe_machine()})")
    print("| target token | share | main | " + " | ".join(f"s{j}" for j in range(1, streams + 1)))
    for kind, row in rows.items():
        cells = " | ".join(f"{row[f'stream{j}']:.2f}" for j in range(1, streams + 1))
        print(f"| {kind} | {row['share']:.0%} | {row['main']:.2f} | {cells}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        record = {"checkpoint": args.checkpoint, "split": args.split, "n": len(cases)}
        Path(args.out).write_text(json.dumps({**record, "classes": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
