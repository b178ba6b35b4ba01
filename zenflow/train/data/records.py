"""SFT record files: ``.jsonl`` or ``.json`` records (or a hub dataset's split), one kind
per file, checked before anything is tokenised.

Contract:

- ``read_records`` reads ``.jsonl`` (one JSON object per line, blank lines skipped) or
  ``.json`` (an array of objects), UTF-8 (a byte-order mark allowed). The first record's
  fields decide the file's kind, one kind per file:

  - ``text``: ``{"text": ...}``, loss on every token (and the end-of-sequence token);
  - ``prompt/completion``: ``{"prompt": ..., "completion": ...}``; the input is prompt +
    completion + eos, the loss is on the completion and the eos only;
  - ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered by the
    tokenizer's own chat template; the loss is on the assistant turns only.

  Field names are configurable (``RecordFields``). A record of another kind than the first,
  an unknown role, a non-string content or a conversation without an assistant turn is a
  ``DataError`` naming file and line. A null or blank text/completion drops the record
  (counted under its reason by ``record_encoding.encode_records``).

Owns: the kinds, their field names and the records' shape. Must not: tokenise
(``record_encoding``) or build rows (``packing``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zenflow.errors import DataError
from zenflow.train.data.hub import hub_records, is_hub_id
from zenflow.train.data.readers import (
    check_input_file,
    json_objects,
    jsonl_objects,
    kind_of,
    read_text,
)

TEXT, PROMPT_COMPLETION, CHAT = "text", "prompt/completion", "chat"
ROLES = ("system", "user", "assistant", "tool")
FORMATS = (".jsonl", ".json")


@dataclass(frozen=True)
class RecordFields:
    """The field names of the records (defaults: text, prompt, completion, messages)."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"

    def kind_fields(self) -> dict[str, tuple[str, ...]]:
        return {
            TEXT: (self.text,),
            PROMPT_COMPLETION: (self.prompt, self.completion),
            CHAT: (self.messages,),
        }


@dataclass
class Records:
    """One file's records, all of one kind."""

    path: Path
    kind: str  # TEXT | PROMPT_COMPLETION | CHAT
    items: list[tuple[str, dict[str, Any]]]  # (where: "line 7" / "item 7", record)
    fields: RecordFields = field(default_factory=RecordFields)


def read_records(path: str | Path, fields: RecordFields = RecordFields()) -> Records:
    """The records of one .jsonl or .json file, or of a hub dataset's split
    (``zenflow.train.data.hub``), and their kind (from the first record)."""
    if is_hub_id(path):
        items = hub_records(str(path))
        if not items:
            raise DataError(f"The dataset {path} has no rows.")
        return Records(Path(path), _check_kinds(Path(path), items, fields), items, fields)
    path = Path(path).expanduser()
    check_input_file(path, FORMATS)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(
            f"{path}: unknown record format {path.suffix or '(no suffix)'!r}; supported are "
            f"{', '.join(FORMATS)} (one JSON object per line, or an array of objects)."
        )
    text = read_text(path, "Record")
    if not text.strip():
        raise DataError(f"{path} is empty; expected JSON records such as {_example(fields)}.")
    example = _example(fields)
    if suffix == ".jsonl":
        items = jsonl_objects(path, text, example)
    else:
        items = json_objects(path, text, example, "record file")
    if not items:
        raise DataError(f"{path} holds no records; add records such as {_example(fields)}.")
    return Records(path, _check_kinds(path, items, fields), items, fields)


def records_from(
    objects: Iterable[dict[str, Any]], name: str = "records", fields: RecordFields = RecordFields()
) -> Records:
    """Records already in memory (``name`` stands for the file in messages)."""
    items = [(f"record {i}", obj) for i, obj in enumerate(objects, start=1)]
    path = Path(name)
    if not items:
        raise DataError(f"{name}: no records.")
    for where, obj in items:
        if not isinstance(obj, dict):
            raise DataError(f"{name}, {where}: {kind_of(obj)}, not an object.")
    return Records(path, _check_kinds(path, items, fields), items, fields)


def _example(fields: RecordFields) -> str:
    return (
        f'{{"{fields.text}": "..."}}, {{"{fields.prompt}": "...", "{fields.completion}": "..."}}'
        f' or {{"{fields.messages}": [{{"role": "user", "content": "..."}}, ...]}}'
    )


def _kind_of_record(path: Path, where: str, rec: dict, fields: RecordFields) -> str:
    kinds = [k for k, names in fields.kind_fields().items() if all(n in rec for n in names)]
    if len(kinds) == 1:
        return kinds[0]
    if len(kinds) > 1:
        raise DataError(
            f"{path}, {where}: the record has the fields of more than one kind "
            f"({' and '.join(kinds)}: {', '.join(repr(k) for k in rec)}); it is unclear which "
            "to train on. Keep one kind's fields, or rename the others."
        )
    if fields.prompt in rec or fields.completion in rec:
        have, lack = (
            (fields.prompt, fields.completion)
            if fields.prompt in rec
            else (fields.completion, fields.prompt)
        )
        raise DataError(
            f"{path}, {where}: the record has {have!r} but no {lack!r}; a prompt/completion "
            f"record needs both. Add the field, or name the file's field with "
            f"--{'prompt' if lack == fields.prompt else 'completion'}-field."
        )
    raise DataError(
        f"{path}, {where}: none of the known fields; the record has "
        f"{', '.join(repr(k) for k in rec) or 'no fields'}. Expected {_example(fields)} "
        "(field names can be set with --text-field, --prompt-field, --completion-field, "
        "--messages-field)."
    )


def _check_kinds(path: Path, items: list[tuple[str, dict]], fields: RecordFields) -> str:
    first_where, first = items[0]
    kind = _kind_of_record(path, first_where, first, fields)
    for where, rec in items[1:]:
        other = _kind_of_record(path, where, rec, fields)
        if other != kind:
            raise DataError(
                f"{path}, {where}: a {other} record, but the file's first record "
                f"({first_where}) is a {kind} record; one file holds one kind. Split the "
                "file by kind, or convert the records to one kind."
            )
    return kind


def check_messages(messages: Any, where: str = "record", messages_field: str = "messages"):
    """DataError unless ``messages`` is a non-empty list of {"role", "content": str} with
    known roles and at least one assistant turn."""
    allowed = ", ".join(ROLES)
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: field {messages_field!r} holds {kind_of(messages)}"
            f"{' (empty)' if messages == [] else ''}; it must be a list of messages such as "
            '{"role": "user", "content": "..."}.'
        )
    for j, m in enumerate(messages, start=1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(
                f"{where}: message {j} is {kind_of(m)} without 'role' and 'content'; each "
                f'message is an object such as {{"role": "user", "content": "..."}}.'
            )
        if m["role"] not in ROLES:
            raise DataError(
                f"{where}: message {j} has the unknown role {m['role']!r}; the allowed roles "
                f"are {allowed}. Rename the role."
            )
        if not isinstance(m["content"], str):
            raise DataError(
                f"{where}: message {j} ({m['role']}) has content that is "
                f"{kind_of(m['content'])}, not a string. Write the content as text."
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"{where}: the conversation has no assistant turn, so nothing to learn from "
            f"(roles: {', '.join(m['role'] for m in messages)}; allowed: {allowed}). Add the "
            "assistant's reply, or remove the record."
        )
