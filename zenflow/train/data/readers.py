"""Files -> records: the readers the table and record sources share.

Contract:

- ``check_input_file``: a data file must be a regular file (or a link to one). A directory,
  a FIFO, a device or a socket is a ``DataError`` saying what it is, before anything opens
  it: a run reads its data more than once (the rows, then the sha256 that ``--resume`` and
  ``zfctl eval`` check, and once per data-parallel rank), which a FIFO cannot give; a
  symbolic link loop is named as one.
- ``read_text``: a whole file as text, UTF-8 with a leading byte-order mark allowed; a byte
  that is not UTF-8 is a ``DataError`` naming its line and byte and how to re-encode the
  file, or, for a compressed file (gzip, zip, bzip2, xz, zstd) or a Parquet file under a
  text suffix, saying what it is and how to decompress or rename it.
- ``jsonl_objects`` (one JSON object per line, blank lines skipped) and ``json_objects`` (an
  array of objects) give records ``(where, object)``: "line 7", "item 7". A key given twice
  in one object (JSON would keep the last silently) is a ``DataError`` naming the key and
  its line.
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
import errno
import json
import os
import stat
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


_NOT_FILES = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def check_input_file(path: Path, suffixes: Sequence[str]) -> None:
    """DataError unless ``path`` is a regular file (links followed) or does not exist (the
    reader then names it): a directory (its data files listed), a FIFO, a device or a
    socket is said to be one; a link loop is named. ``suffixes``: the data files' suffixes,
    for the directory's listing."""
    try:
        kind = stat.S_IFMT(os.stat(path).st_mode)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataError(
                f"{path} is a symbolic link loop (following its links comes back to "
                "itself); point the link at the data file, or pass the file itself."
            ) from None
        raise DataError(os_error_message(exc, path, "Cannot read")) from exc
    if kind == stat.S_IFREG:
        return
    if kind == stat.S_IFDIR:
        try:
            inside = sorted(n for n in os.listdir(path) if n.lower().endswith(tuple(suffixes)))
        except OSError:
            inside = []
        held = (f"; it holds {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''}"
                if inside else "")  # fmt: skip
        raise DataError(
            f"{path} is a directory, not a data file{held}. Pass one file ({', '.join(suffixes)})."
        )
    what = _NOT_FILES.get(kind, "not a regular file")
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        raise DataError(f"{path} is {what}, not a data file. Pass a file ({', '.join(suffixes)}).")
    raise DataError(
        f"{path} is {what}, not a regular file. A run reads its data file more than once (the "
        "rows, then the sha256 that --resume and zfctl eval check, and once per data-parallel "
        "rank), and a stream gives its bytes only once. Write the data to a file first (e.g. "
        f"cat {path} > data.jsonl) and pass that file."
    )


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two data paths name one file (links and hard links followed); two names that
    are not files (hub dataset ids) when they are equal."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return str(a) == str(b)


EVAL_IS_TRAIN = (
    "eval: --eval-data is the same file as --data, so the eval rows are training rows: the "
    "figures say how well the model fits what it trained on, not how it does on new rows. "
    "Pass another file, or drop --eval-data for a seeded split"
)


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


# Files that are not text at all, by their first bytes: (magic, what it is, how to fix).
_MAGIC = (
    (b"\x1f\x8b", "gzip-compressed", "decompress it (gunzip -k {name}, or zcat {name} > {plain})"),
    (b"PK\x03\x04", "a zip archive", "extract the file from it (unzip {name})"),
    (b"BZh", "bzip2-compressed", "decompress it (bunzip2 -k {name})"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it (unxz -k {name})"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it (unzstd {name})"),
    (b"PAR1", "a Parquet file", "name it .parquet (mv {name} {stem}.parquet)"),
)


def _binary_kind(path: Path, data: bytes) -> str | None:
    """The sentence for a file that is a known binary format under a text suffix, else
    None."""
    for magic, what, fix in _MAGIC:
        if data.startswith(magic):
            gz = path.name.endswith(".gz")
            plain = path.name[:-3] if gz else f"{path.stem}-plain{path.suffix}"
            how = fix.format(name=path.name, plain=plain, stem=path.stem)
            return f"{path} is {what}, not UTF-8 text; {how} and pass the result."
    return None


def _not_utf8(path: Path, data: bytes, what: str = "Table") -> DataError:
    """The error for a file whose bytes ``data`` are not UTF-8: a compressed or Parquet
    file said to be one; else where the first bad byte is and how to re-encode the file."""
    binary = _binary_kind(path, data)
    if binary is not None:
        return DataError(binary)
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


def _json_reason(exc: json.JSONDecodeError) -> str:
    """json's message without its dangling "at" ("Unterminated string starting at")."""
    return exc.msg.removesuffix(" starting at").removesuffix(" at")


class _KeyTwice(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _refuse_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: the object, or _KeyTwice for its first key given twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _KeyTwice(key)
            seen.add(key)
    return obj


def _twice_error(path: Path, where: str, key: str) -> DataError:
    return DataError(
        f"{path}, {where}: the key {key!r} appears twice in one object; JSON keeps only the "
        "last value, so the other would be lost silently. Remove or rename one of them."
    )


_STRICT = json.JSONDecoder(object_pairs_hook=_refuse_twice)  # made once: json.loads with a
# hook builds a decoder per call, which doubled a large .jsonl file's reading time


def _loads(path: Path, where: str, text: str):
    """``json.loads`` refusing a key given twice (DataError naming ``where``)."""
    try:
        return _STRICT.decode(text)
    except _KeyTwice as exc:
        raise _twice_error(path, where, exc.key) from None


def jsonl_objects(path: Path, text: str, example: str = TABLE_EXAMPLE) -> RecordList:
    """The JSON objects of a .jsonl text, each with its line ("line 7"); blank lines are
    skipped; DataError naming the line for one that is not a JSON object (``example``: an
    object as the file should hold them, for the message)."""
    records: RecordList = []
    for i, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = _loads(path, f"line {i}", line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}, line {i}: not valid JSON ({_json_reason(exc)}, column {exc.colno}). "
                "Each line of a .jsonl file is one JSON object; fix or remove that line."
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
    twice: list[bool] = []

    def note_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            twice.append(True)
        return obj

    try:
        data = json.loads(text, object_pairs_hook=note_twice)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}, line {exc.lineno}: not valid JSON ({_json_reason(exc)}, column "
            f"{exc.colno}). Fix the file, or for one object per line name it .jsonl."
        ) from None
    if twice and isinstance(data, list):  # read again, item by item, to name the item
        _check_items_keys(path, text)
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


def _check_items_keys(path: Path, text: str) -> None:
    """A .json array (valid JSON) read again item by item with keys given twice refused,
    so the message names the item and its line."""
    decoder = _STRICT
    pos = text.index("[") + 1
    item = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        item += 1
        try:
            _, pos = decoder.raw_decode(text, pos)
        except _KeyTwice as exc:
            line = text.count("\n", 0, pos) + 1
            raise _twice_error(path, f"item {item} of the array (line {line})", exc.key) from None


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
                hint = _width_hint(fmt, tsv_quoting, names)
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


def _width_hint(fmt: str, tsv_quoting: str, names: Sequence[str] | None) -> str:
    """What shifts a CSV/TSV row's columns, for the message of a row of the wrong width;
    never a flag that is already set."""
    if fmt == "csv":
        return " A comma inside a text field must be inside double quotes."
    if names is not None:
        return ""
    if tsv_quoting == "none":
        return (
            " With --tsv-quoting none every tab separates columns: a tab inside a text field "
            "shifts them. Remove the tabs from the text, or quote the fields and use "
            "--tsv-quoting csv."
        )
    return (
        " A tab inside a text field, or a quote that is text, shifts the columns; GLUE-style "
        "TSV files need --tsv-quoting none."
    )


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
