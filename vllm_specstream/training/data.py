"""Training data: read chat examples from JSONL and tokenise them with a completion mask.

Three record shapes are accepted, one JSON object per line:

* ``{"prompt": str, "completion": str}`` - the prompt becomes one user message;
* ``{"messages": [...]}`` - the last message must be the assistant reply to learn;
* ``{"context": str, "question": str, "answer": str}`` - sql-create-context records,
  rendered with :func:`sql_example`.

Nothing here imports torch or transformers; a tokenizer is passed in by the caller.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.logger import init_logger

logger = init_logger(__name__)


class DataError(ConfigError):
    """A data file or a data flag is unusable; the message names the file (and line) or flag
    and what it must hold."""


SQL_FIELDS = ("context", "question", "answer")
PROMPT_FIELDS = ("prompt", "completion")


@dataclass(frozen=True)
class ChatExample:
    """One supervised example: the chat so far and the assistant reply to learn."""

    messages: list[dict]  # chat messages ending with the user turn
    completion: str  # the assistant reply to learn


def user_example(prompt: str, completion: str) -> ChatExample:
    """A single-user-turn example."""
    return ChatExample(messages=[{"role": "user", "content": prompt}], completion=completion)


def sql_example(context: str, question: str, answer: str) -> ChatExample:
    """The SQL prompt format shared by training and evaluators: the schema, then the question."""
    return user_example(f"{context}\nQuestion: {question}", answer)


# --------------------------------------------------------------------------- JSONL


def _string_field(record: dict, field: str, where: str, *, nonempty: bool = False) -> str:
    if field not in record:
        raise DataError(f"{where}: missing field {field!r}")
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if nonempty and not value.strip():
        raise DataError(f"{where}: empty {field!r}")
    return value


def _from_messages(record: dict, where: str) -> ChatExample:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field 'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{at} must be an object")
        _string_field(message, "role", at)
        _string_field(message, "content", at)
    last = messages[-1]
    if last["role"] != "assistant":
        raise DataError(
            f"{where}: field 'messages': last message must have role 'assistant', "
            f"got {last['role']!r}"
        )
    if not last["content"].strip():
        raise DataError(f"{where}: field 'messages': empty assistant 'content'")
    if len(messages) < 2:
        raise DataError(f"{where}: field 'messages': no prompt before the assistant reply")
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
    return ChatExample(messages=prompt, completion=last["content"])


def parse_record(record: Any, where: str) -> ChatExample:
    """Turn one decoded JSONL record into a :class:`ChatExample`; ``where`` prefixes errors."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return _from_messages(record, where)
    if any(field in record for field in SQL_FIELDS):
        context, question, answer = (
            _string_field(record, field, where, nonempty=(field == "answer"))
            for field in SQL_FIELDS
        )
        return sql_example(context, question, answer)
    if any(field in record for field in PROMPT_FIELDS):
        prompt = _string_field(record, "prompt", where)
        completion = _string_field(record, "completion", where, nonempty=True)
        return user_example(prompt, completion)
    raise DataError(
        f"{where}: unknown record shape with fields {sorted(record)}; expected "
        "'prompt'+'completion', 'messages', or 'context'+'question'+'answer'"
    )


def jsonl_records(path: str | Path, text: str | None = None) -> Iterator[tuple[str, Any]]:
    """``("file:line", decoded value)`` of every non-blank line of a JSONL file (``text``: its
    contents, when the caller has read them already)."""
    if text is None:
        text = Path(path).read_text(encoding="utf-8")
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other line separators.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
        yield where, record


def load_jsonl(path: str | Path) -> list[ChatExample]:
    """Read every non-blank line of a JSONL file as a :class:`ChatExample`."""
    return [parse_record(record, where) for where, record in jsonl_records(path)]


# --------------------------------------------------------------------------- tokenisation


def prompt_text(tokenizer: Any, messages: list[dict]) -> str:
    """The chat-templated prompt, ending where the assistant's reply starts."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


#: Stands for a reply's text when reading what the chat template puts after it.
_REPLY_MARK = "specstream-reply-mark"
_END_OF_TURN_ATTR = "_specstream_end_of_turn_id"


def end_of_turn_id(tokenizer: Any) -> int:
    """The token that ends an assistant reply: the first token the chat template puts after
    the reply's text when that is a special token (``<|im_end|>`` for SmolLM2), else the
    tokenizer's eos. Training appends it to every completion and decoding stops at it, so a
    tokenizer whose ``eos_token`` was converted wrongly (a GGUF read by another Transformers
    release) cannot teach the model to end its replies with another token than the one its
    chat format and its servers stop at."""
    found = getattr(tokenizer, _END_OF_TURN_ATTR, None)
    if found is None:
        found = _end_of_turn(tokenizer)
        setattr(tokenizer, _END_OF_TURN_ATTR, found)  # one template render per tokenizer
    return found


def _end_of_turn(tokenizer: Any) -> int:
    eos = tokenizer.eos_token_id
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _REPLY_MARK}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        after = text.split(_REPLY_MARK, 1)[1] if _REPLY_MARK in text else ""
        ids = _ids(tokenizer, after) if after else []
        special = {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
        }
        if ids and ids[0] in special:
            if ids[0] != eos:
                logger.warning(
                    "The chat template ends a reply with %r (id %d) but the tokenizer's eos is "
                    "%r (id %s): replies end with the chat template's token",
                    tokenizer.convert_ids_to_tokens(ids[0]),
                    ids[0],
                    tokenizer.eos_token,
                    eos,
                )
            return ids[0]
    if eos is None:
        raise DataError("tokenizer has no eos token and its chat template no end-of-turn token")
    return eos


def prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of the chat-templated prompt, exactly as training tokenises it."""
    return _ids(tokenizer, prompt_text(tokenizer, messages))


def encode_example(tokenizer: Any, example: ChatExample, max_length: int) -> dict:
    """Token ids of prompt + completion + end of turn (:func:`end_of_turn_id`) and a mask
    that is True on completion tokens.

    Prompt and completion are tokenised separately so the mask boundary is exact. Too-long
    examples lose prompt tokens from the left (the completion is what is learned); a
    completion longer than ``max_length`` on its own is cut on the right.
    """
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    eos_id = end_of_turn_id(tokenizer)
    prompt = prompt_ids(tokenizer, example.messages)
    # Appended as an id: tokenising its text is not guaranteed to give the special id.
    completion_ids = _ids(tokenizer, example.completion) + [eos_id]
    if len(completion_ids) >= max_length:
        return {"input_ids": completion_ids[:max_length], "labels_mask": [True] * max_length}
    keep = max_length - len(completion_ids)
    prompt = prompt[-keep:] if len(prompt) > keep else prompt
    return {
        "input_ids": prompt + completion_ids,
        "labels_mask": [False] * len(prompt) + [True] * len(completion_ids),
    }


# --------------------------------------------------------------------------- self-distillation


def prompt_key(messages: list[dict]) -> str:
    """The key of a prompt in a self-distillation file: its messages as canonical JSON."""
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def read_replies(path: str | Path) -> dict[str, str]:
    """``prompt_key -> reply`` of a self-distillation file (JSONL of ``messages`` and
    ``completion``: the base model's own greedy reply to each prompt)."""
    replies = {}
    for where, record in jsonl_records(path):
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
            raise DataError(f"{where}: expected an object with 'messages' (the prompt)")
        replies[prompt_key(record["messages"])] = _string_field(record, "completion", where)
    return replies


def with_replies(
    examples: list[ChatExample], replies: dict[str, str], where: str
) -> list[ChatExample]:
    """``examples`` with each completion replaced by the model's own reply to the prompt
    (examples that share a prompt, e.g. several references, collapse into one)."""
    out, seen = [], set()
    for e in examples:
        key = prompt_key(e.messages)
        if key in seen:
            continue
        if key not in replies:
            raise DataError(f"{where}: no reply for a prompt of the task data; distil again")
        seen.add(key)
        out.append(ChatExample(messages=e.messages, completion=replies[key]))
    return out
