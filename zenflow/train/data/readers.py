"""Files -> records: the readers the table and record sources share.

Contract:

- ``read_text``: a whole file as text, UTF-8 with a leading byte-order mark allowed; a byte
  that is not UTF-8 is a ``DataError`` naming its line and byte and how to re-encode the
  file.
- ``jsonl_objects`` (one JSON object per line, blank lines skipped) and ``json_objects`` (an
  array of objects) give records ``(where, object)``: "line 7", "item 7".
- ``csv_file_records`` streams a ``.csv`` or ``.tsv`` file line by line, keeping only the
  wanted fields (``tsv_quoting="csv"``: standard quoting with a tab delimiter; ``"none"``:
  ``csv.QUOTE_NONE`` as GLUE's files need); ``parquet_records`` reads a ``.parquet`` file
  (pyarrow, imported only then). A row of the wrong width is a ``DataError`` naming its line.
- ``kind_of``, ``quoted_names`` and ``plural`` word the messages.

Owns: decoding and the file formats. Must not: decide what a field means (texts, labels,
record kinds) or drop a row; the sources (``tables``, ``records``) do.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from zenflow.errors import DataError, os_error_message, undecodable_at

csv.field_size_limit(1 << 24)  # long documents in one field


def plural(n: int, word: str) -> str:
    """A count and its noun, for messages: "1 row", "2 rows"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def kind_of(value: Any) -> str:
    """A JSON value's kind in words ("a number", "an array", ...), for messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return {list: "an array", dict: "an object", type(None): "null"}.get(type(value), "a value")


def quoted_names(names: Iterable[str]) -> str:
    """Names quoted and listed, for messages: 'text', 'label'."""
    return ", ".join(repr(n) for n in names)


def read_text(path: Path, what: str = "Table") -> str:
    """The file as text: UTF-8, a byte-order mark dropped; DataError naming the line and
    byte of the first byte that is not UTF-8 (``what``: the kind of file, for the fix)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(os_error_message(exc, path, "Cannot read")) from exc
    try:
        return data.decode("utf-8-sig")  # a byte-order mark is not part of the first name
    except UnicodeDecodeError:
        raise _not_utf8(path, data, what) from None


def _not_utf8(path: Path, data: bytes, what: str = "Table") -> DataError:
    """The error for a file whose bytes ``data`` are not UTF-8: where the first bad byte is
    and how to re-encode the file."""
    try:  # decoded whole and without the BOM rule: utf-8-sig's offsets skip the mark
        data.decode("utf-8")
        where = "not UTF-8 text"
    except UnicodeDecodeError as exc:
        where = undecodable_at(data, exc, "not UTF-8 text")
    return DataError(
        f"{path}, {where}. {what} files are UTF-8; re-encode the file "
        f"(e.g. iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix})."
    )


RecordList = list[tuple[str, dict[str, Any]]]  # (where, field -> value)
TABLE_EXAMPLE = '{"text": "...", "label": "..."}'


def jsonl_objects(path: Path, text: str, example: str = TABLE_EXAMPLE) -> RecordList:
    """The JSON objects of a .jsonl text, each with its line ("line 7"); blank lines are
    skipped; DataError naming the line for one that is not a JSON object (``example``: an
    object as the file should hold them, for the message)."""
    records: RecordList = []
    for i, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}, line {i}: not valid JSON ({exc.msg} at column {exc.colno}). Each "
                "line of a .jsonl file is one JSON object; fix or remove that line."
            ) from None
        if not isinstance(obj, dict):
            raise DataError(
                f"{path}, line {i}: {kind_of(obj)}, not a JSON object. Each line of a .jsonl "
                f"file is one object such as {example}."
            )
        records.append((f"line {i}", obj))
    return records


def json_objects(path: Path, text: str, example: str = TABLE_EXAMPLE,
                 what: str = "table") -> RecordList:  # fmt: skip
    """The objects of a .json text holding an array of them, each with its position
    ("item 7"); DataError for anything else."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}, line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}). "
            "Fix the file, or for one object per line name it .jsonl."
        ) from None
    if not isinstance(data, list):
        raise DataError(
            f"{path} holds {kind_of(data)}; a .json {what} is an array of objects "
            f"([{example}, ...]). For one object per line name the file .jsonl."
        )
    records: RecordList = []
    for i, obj in enumerate(data, start=1):
        if not isinstance(obj, dict):
            raise DataError(
                f"{path}, item {i} of the array: {kind_of(obj)}, not a JSON object. Every "
                f"item of a .json {what} is one object such as {example}."
            )
        records.append((f"item {i}", obj))
    return records


def with_columns(records: RecordList) -> tuple[list[str], RecordList]:
    """The field names of the records, in order of first appearance, and the records."""
    columns: dict[str, None] = {}
    for _, obj in records:
        columns.update(dict.fromkeys(obj))
    return list(columns), records


def csv_file_records(path: Path, fmt: str, tsv_quoting: str, wanted: Sequence[str],
                      names: Sequence[str] | None) -> tuple[list[str], RecordList]:  # fmt: skip
    """The header (or ``names``, for a file without one) and the rows of a CSV/TSV file,
    read line by line; each record holds the ``wanted`` fields only."""
    try:
        f = open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise DataError(os_error_message(exc, path, "Cannot read")) from exc
    try:
        with f:
            return _csv_records(path, f, fmt, tsv_quoting, wanted, names)
    except UnicodeDecodeError:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise DataError(os_error_message(exc, path, "Cannot read")) from exc
        raise _not_utf8(path, data) from None


def _csv_records(path: Path, lines: Iterable[str], fmt: str, tsv_quoting: str,
                 wanted: Sequence[str], names: Sequence[str] | None,
                 ) -> tuple[list[str], RecordList]:  # fmt: skip
    if fmt == "csv":
        reader = csv.reader(lines)
    elif tsv_quoting == "none":
        reader = csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(lines, delimiter="\t")
    try:
        if names is not None:
            header = list(names)
        else:
            header = next(reader, None)
            while header is not None and not any(h.strip() for h in header):
                header = next(reader, None)  # blank lines before the header
            if header is None:
                raise DataError(f"{path} is empty; expected a table of rows with a header.")
        keep = [(i, h) for i, h in enumerate(header) if h in wanted]
        records: RecordList = []
        last = reader.line_num
        for fields in reader:
            start, last = last + 1, reader.line_num  # a quoted field may span lines
            if not fields or fields == [""]:
                continue
            if len(fields) != len(header):
                hint = (
                    " A tab inside a text field, or a quote that is text, shifts the columns; "
                    "GLUE-style TSV files need --tsv-quoting none."
                    if fmt == "tsv" and names is None
                    else " A comma inside a text field must be inside double quotes."
                    if fmt == "csv"
                    else ""
                )
                what = "the header has" if names is None else "the file's columns are"
                raise DataError(
                    f"{path}, line {start}: {len(fields)} field(s), but {what} "
                    f"{len(header)} ({quoted_names(header)}).{hint}"
                )
            records.append((f"line {start}", {h: fields[i] for i, h in keep}))
    except csv.Error as exc:
        raise DataError(
            f"{path}, line {reader.line_num}: not a readable {fmt} row ({exc}); fix that line."
        ) from None
    return header, records


def parquet_records(path: Path, wanted: Sequence[str]) -> tuple[list[str], RecordList]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataError(
            f"{path}: reading .parquet needs the pyarrow package, which is not installed. "
            "Install it (pip install pyarrow) or convert the table to .jsonl or .csv."
        ) from exc
    try:
        columns = list(pq.read_schema(path).names)
        table = pq.read_table(path, columns=[c for c in dict.fromkeys(wanted) if c in columns])
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        raise DataError(os_error_message(exc, path, "Cannot read")) from exc
    except (OSError, pa.ArrowException) as exc:  # not Parquet (ArrowInvalid), truncated
        raise DataError(
            f"{path} is not a readable Parquet file ({exc}). Check the file, or convert it "
            "to .jsonl or .csv."
        ) from exc
    records = [(f"row {i}", rec) for i, rec in enumerate(table.to_pylist(), start=1)]
    return columns, records
