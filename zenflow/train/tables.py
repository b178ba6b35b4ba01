"""A user's own classification or regression data, read from table files.

Contract:

- ``read_rows`` reads one file: ``.jsonl`` (one JSON object per line, blank lines skipped),
  ``.json`` (an array of objects), ``.csv``, ``.tsv`` (``tsv_quoting="csv"``: standard
  quoting with a tab delimiter; ``"none"``: ``csv.QUOTE_NONE`` as GLUE's files need) or
  ``.parquet`` (pyarrow, imported only then). Text files are UTF-8, a leading byte-order
  mark allowed, and are read whole. It returns rows of (texts, raw label) and the file's
  counts; every row not kept is counted under a reason ("empty text", "missing text value",
  "missing label value"; the first that applies), never dropped silently.
- Raw labels keep their file types: JSON and Parquet give str/int/float/bool, CSV and TSV
  give stripped strings. One column holds one kind (class names or numbers); a mix, a
  non-finite number or a label that is neither is a ``DataError`` naming file and line.
- ``infer_labels`` decides the objective from the training labels only: integers (also
  integer-valued floats, digit strings and bools) or strings are classes, ordered by
  value (numbers numerically, strings by code point), ids 0..n-1 in that order; any
  non-integer number makes a regression (one output). Eval labels must be training classes.
- ``seeded_split`` holds out a random ``eval_fraction`` of the rows when no eval file is
  given. It splits by row (``random.Random(seed)``); it does not stratify by class.
- ``load_table_task`` puts it together: a ``GlueTask``-compatible task, ``TaskData`` and a
  ``TableReport`` whose ``lines()`` are sentences for the run header.
- The GLUE tasks are presets of this reader (``Preset``, made by ``GlueTask.preset``): the
  preset fixes the fields, the TSV quoting (``none``), the column names of a file without
  a header (CoLA), the label set in the hub's class order (MNLI's names are not sorted;
  STS-B is a regression whatever its scores look like) and the metrics; every label must
  be in that set (``DataError`` naming file and line). Nothing else differs: the same
  drops, counts, UTF-8 and width checks.

Every problem the user can fix is a ``DataError`` (exit 2 at the CLI) that says what is
wrong, where (file, line, byte) and how to fix it.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from zenflow.errors import DataError, os_error_message, undecodable_at
from zenflow.train.data import Example, GlueTask, TaskData
from zenflow.train.hub_data import hub_records, is_hub_id, shown_name

csv.field_size_limit(1 << 24)  # long documents in one field

FORMATS = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
EMPTY_TEXT, MISSING_TEXT, MISSING_LABEL = "empty text", "missing text value", "missing label value"

# CSV/TSV labels are strings; these decide which of them are numbers (ASCII digits only, so
# "1_000" or non-Latin digits stay class names, unlike int()).
_INT_RE = re.compile(r"[+-]?\d+", re.ASCII)
_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)
_NON_FINITE = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


class Row(NamedTuple):
    texts: tuple[str, ...]  # one or two text fields, as in the file
    label: Any  # raw: str/int/float/bool; None only when the label was not required
    where: str  # "line 7" (jsonl, csv, tsv), "item 7" (json array), "row 7" (parquet)


@dataclass(frozen=True)
class FileCounts:
    """What happened to one file's rows: read = kept + sum(dropped.values())."""

    path: Path
    format: str
    columns: tuple[str, ...]  # the file's column names (jsonl: keys in order of first use)
    read: int
    kept: int
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows

    def line(self) -> str:
        """One sentence: "train.jsonl: 1000 rows read, 998 kept, 2 dropped (2 empty text)"."""
        head = f"{shown_name(self.path)}: {_n(self.read, 'row')} read, {self.kept} kept"
        if not self.dropped:
            return f"{head}, none dropped"
        why = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items())
        return f"{head}, {sum(self.dropped.values())} dropped ({why})"


@dataclass
class TableRows:
    rows: list[Row]
    counts: FileCounts


def _n(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# ------------------------------------------------------------------------------ reading


def read_rows(
    path: str | Path,
    text_fields: Sequence[str],
    label_field: str,
    *,
    label_required: bool = True,
    tsv_quoting: str = "csv",
    headerless_columns: Sequence[str] | None = None,
    labels: LabelSet | None = None,
    fix: str | None = None,
) -> TableRows:
    """The rows of one table file (format from its suffix) with their counts.

    ``text_fields``: one or two column names. With ``label_required=False`` the label
    column may be absent and rows without a label are kept with label None. A preset's
    files (the GLUE tasks) also give: ``headerless_columns``, the names of a CSV/TSV file's
    columns when it has no header line (every line is a row); ``labels``, the fixed label
    set every label must belong to (instead of one inferred from the file); ``fix``, what
    to do when a field is missing (instead of "pass --text-field / --label-field").
    """
    hub = is_hub_id(path)
    path = Path(path) if hub else Path(path).expanduser()
    text_fields = tuple(text_fields)
    if len(text_fields) not in (1, 2):
        raise DataError(
            f"Give one or two text fields (--text-field), got {len(text_fields)}: "
            f"{', '.join(text_fields) or 'none'}."
        )
    fmt = "jsonl" if hub else FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(
            f"{path}: unknown table format {path.suffix or '(no suffix)'!r}; supported are "
            f"{', '.join(FORMATS)}. Rename the file to the suffix of its format."
        )
    if tsv_quoting not in ("csv", "none"):
        raise ValueError(f"tsv_quoting must be 'csv' or 'none', got {tsv_quoting!r}")
    if hub:  # a hub dataset's split: its rows as records, like a JSONL file's
        columns, records = _with_columns(hub_records(str(path)))
    elif fmt == "parquet":
        columns, records = _parquet_records(path, (*text_fields, label_field))
    elif fmt in ("csv", "tsv"):  # streamed, keeping only the wanted fields (MNLI: 393k rows)
        columns, records = _csv_file_records(path, fmt, tsv_quoting, (*text_fields, label_field),
                                             headerless_columns)  # fmt: skip
    else:
        text = read_text(path)
        if not text.strip():
            raise DataError(f"{path} is empty; expected a table of rows with a header or keys.")
        if fmt == "jsonl":
            columns, records = _with_columns(jsonl_objects(path, text))
        else:
            columns, records = _with_columns(json_objects(path, text))
    if not records:
        none = "has no rows" if headerless_columns else _NO_ROWS[fmt]
        raise DataError(f"{path} {none}; add rows to it.")
    _check_fields(path, columns, text_fields, label_field, label_required, fix)

    rows: list[Row] = []
    dropped: Counter[str] = Counter()
    for where, rec in records:
        texts = [rec.get(f) for f in text_fields]
        label = rec.get(label_field)
        for f, t in zip(text_fields, texts, strict=True):
            if t is not None and not isinstance(t, str):
                raise DataError(
                    f"{path}, {where}: text field {f!r} holds {kind_of(t)} ({t!r}), not a "
                    "string. Store the text as a string, or pick another --text-field."
                )
        if isinstance(label, str):
            label = label.strip() or None
        reason = _drop_reason(texts, label, label_required)
        if reason:
            dropped[reason] += 1
            continue
        if label is not None:
            _check_label(path, where, label_field, label, fmt)
            if labels is not None:
                _check_fixed_label(path, where, label_field, label, labels)
        rows.append(Row(tuple(texts), label, where))
    read = len(records)
    if not rows:
        why = ", ".join(f"{n} {r}" for r, n in dropped.items())
        check = fix or (
            "Check that --text-field and --label-field name the right columns (the file has "
            f"{_names(columns)}) and fill in the empty values."
        )
        raise DataError(f"{path}: all {_n(read, 'row')} were dropped ({why}). {check}")
    if labels is None:  # a fixed set has checked every label already
        _check_one_label_kind(path, label_field, rows, fmt)
    counts = FileCounts(path, fmt, tuple(columns), read, len(rows), dict(dropped))
    return TableRows(rows, counts)


_NO_ROWS = {
    "jsonl": "has no JSON objects",
    "json": "holds an empty array",
    "csv": "has a header line but no rows",
    "tsv": "has a header line but no rows",
    "parquet": "has no rows",
}


def _drop_reason(texts: list[Any], label: Any, label_required: bool) -> str | None:
    """Why a row is not kept (the first reason that applies), or None to keep it."""
    if any(t is None for t in texts):
        return MISSING_TEXT
    if any(not t.strip() for t in texts):
        return EMPTY_TEXT
    if label is None and label_required:
        return MISSING_LABEL
    return None


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


Records = list[tuple[str, dict[str, Any]]]  # (where, field -> value)
TABLE_EXAMPLE = '{"text": "...", "label": "..."}'


def jsonl_objects(path: Path, text: str, example: str = TABLE_EXAMPLE) -> Records:
    """The JSON objects of a .jsonl text, each with its line ("line 7"); blank lines are
    skipped; DataError naming the line for one that is not a JSON object (``example``: an
    object as the file should hold them, for the message)."""
    records: Records = []
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
                 what: str = "table") -> Records:  # fmt: skip
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
    records: Records = []
    for i, obj in enumerate(data, start=1):
        if not isinstance(obj, dict):
            raise DataError(
                f"{path}, item {i} of the array: {kind_of(obj)}, not a JSON object. Every "
                f"item of a .json {what} is one object such as {example}."
            )
        records.append((f"item {i}", obj))
    return records


def _with_columns(records: Records) -> tuple[list[str], Records]:
    """The field names of the records, in order of first appearance, and the records."""
    columns: dict[str, None] = {}
    for _, obj in records:
        columns.update(dict.fromkeys(obj))
    return list(columns), records


def _csv_file_records(path: Path, fmt: str, tsv_quoting: str, wanted: Sequence[str],
                      names: Sequence[str] | None) -> tuple[list[str], Records]:  # fmt: skip
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
                 ) -> tuple[list[str], Records]:  # fmt: skip
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
        records: Records = []
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
                    f"{len(header)} ({_names(header)}).{hint}"
                )
            records.append((f"line {start}", {h: fields[i] for i, h in keep}))
    except csv.Error as exc:
        raise DataError(
            f"{path}, line {reader.line_num}: not a readable {fmt} row ({exc}); fix that line."
        ) from None
    return header, records


def _parquet_records(path: Path, wanted: Sequence[str]) -> tuple[list[str], Records]:
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


def _check_fields(path, columns, text_fields, label_field, label_required, fix=None) -> None:
    missing = [(f, "--text-field") for f in text_fields if f not in columns]
    if label_required and label_field not in columns:
        missing.append((label_field, "--label-field"))
    if missing:
        if fix is None:
            what = ", ".join(f"{f!r} (asked for with {flag})" for f, flag in missing)
            fix = "Pass the right name with --text-field / --label-field, or rename the field."
        else:
            what = _names(f for f, _ in missing)
        raise DataError(
            f"{path}: no field {what}; the file's fields are {_names(columns) or 'none'}. {fix}"
        )
    duplicated = [f for f in dict.fromkeys((*text_fields, label_field)) if columns.count(f) > 1]
    if duplicated:
        raise DataError(
            f"{path}: the header names {_names(duplicated)} more than once; rename the "
            "duplicate so each column has its own name."
        )


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)


def kind_of(value: Any) -> str:
    """A JSON value's kind in words ("a number", "an array", ...), for messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return {list: "an array", dict: "an object", type(None): "null"}.get(type(value), "a value")


def _number(raw: Any) -> int | float | None:
    """A raw label as a number (bool -> 0/1, digit strings -> int), or None: a class name."""
    if isinstance(raw, bool):
        return int(raw)
    if isinstance(raw, int | float):
        return raw
    if isinstance(raw, str):
        s = raw.strip()
        if _INT_RE.fullmatch(s):
            return int(s)
        if _FLOAT_RE.fullmatch(s) or s.lower() in _NON_FINITE:
            return float(s)
    return None


def _check_label(path: Path, where: str, label_field: str, label: Any, fmt: str) -> None:
    if not isinstance(label, str | int | float):  # bool is an int
        raise DataError(
            f"{path}, {where}: label field {label_field!r} holds {kind_of(label)}; a label is "
            "a class name (string), an integer or a number. Fix that row."
        )
    # JSON and Parquet strings are class names; in CSV and TSV numbers are strings too.
    value = _number(label) if fmt in ("csv", "tsv") or not isinstance(label, str) else None
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(
            f"{path}, {where}: label {label!r} in field {label_field!r} is not a finite number. "
            "Fix or remove that row."
        )


def _check_fixed_label(path: Path, where: str, label_field: str, label: Any,
                       labels: LabelSet) -> None:  # fmt: skip
    """A label checked against a preset's fixed label set."""
    if labels.names is None:
        value = _number(label)
        if value is None or not math.isfinite(value):
            raise DataError(
                f"{path}, {where}: label {label!r} in field {label_field!r} is not a finite "
                "number (the task is a regression). Fix or remove that row."
            )
        return
    try:
        labels.id_of(label)
    except DataError:
        raise DataError(
            f"{path}, {where}: label {label!r} in field {label_field!r} is not one of the "
            f"task's classes ({', '.join(labels.names)}). Fix or remove that row."
        ) from None


def _check_one_label_kind(path: Path, label_field: str, rows: list[Row], fmt: str) -> None:
    """One kind of label per column: class names or numbers (in CSV: strings that look like
    numbers or not; in JSON: the value's type)."""
    first: dict[str, Row] = {}
    for row in rows:
        if row.label is None:
            continue
        if fmt in ("csv", "tsv"):
            is_number = _number(row.label) is not None
        else:
            is_number = not isinstance(row.label, str)
        first.setdefault("number" if is_number else "string", row)
        if len(first) == 2:
            s, n = first["string"], first["number"]
            raise DataError(
                f"{path}: field {label_field!r} mixes label kinds: {s.where} has the class "
                f"name {s.label!r} and {n.where} the number {n.label!r}. Use one kind for "
                "every label: all class names, or all numbers."
            )


# ------------------------------------------------------------------------------- labels


@dataclass(frozen=True)
class LabelSet:
    """The objective and the classes: ids 0..n-1 in ``names`` order (regression: None)."""

    kind: str  # "classification" | "regression"
    names: tuple[str, ...] | None
    value_type: str = "str"  # raw labels: "str", "int", "bool" (classes) or "float"

    @property
    def num_labels(self) -> int:
        return 1 if self.names is None else len(self.names)

    def key(self, raw: Any) -> str:
        """The class name a raw label stands for (it may not be a class)."""
        if self.value_type == "bool" and isinstance(raw, bool | str):
            return str(raw).strip().lower()
        if self.value_type == "int":
            value = _number(raw)
            if value is not None and math.isfinite(value) and value == int(value):
                return str(int(value))
        return raw.strip() if isinstance(raw, str) else str(raw)

    def id_of(self, raw: Any) -> int:
        """The class id of a raw label; DataError if it is no class (or a regression)."""
        if self.names is None:
            raise DataError("A regression task has no class ids; its labels are numbers.")
        try:
            return self._ids[self.key(raw)]
        except KeyError:
            raise DataError(
                f"Label {raw!r} is not one of the classes ({', '.join(self.names)})."
            ) from None

    def target(self, raw: Any) -> int | float:
        """What a training example holds: the class id, or the regression value."""
        return float(_number(raw)) if self.names is None else self.id_of(raw)

    @property
    def id2label(self) -> dict[int, str]:
        """For a Hugging Face config; a regression gets HF's own default {0: "LABEL_0"}."""
        return dict(enumerate(self.names or ("LABEL_0",)))

    @property
    def label2id(self) -> dict[str, int]:
        return dict(self._ids)

    @cached_property
    def _ids(self) -> dict[str, int]:
        return {name: i for i, name in self.id2label.items()}

    def to_json(self) -> dict[str, Any]:
        names = None if self.names is None else list(self.names)
        return {"kind": self.kind, "names": names, "value_type": self.value_type}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LabelSet:
        names = data.get("names")
        return cls(data["kind"], None if names is None else tuple(names), data["value_type"])


def infer_labels(train_labels: Iterable[Any], eval_labels: Iterable[Any] | None = None) -> LabelSet:
    """The label set the training labels define (see the module docstring), with the eval
    labels checked against it."""
    train = list(train_labels)
    if not train:
        raise DataError("There are no training labels; the training file needs labelled rows.")
    if None in train:
        raise DataError(
            f"{_n(train.count(None), 'training row')} without a label; every training row "
            "needs one (in the column that --label-field names)."
        )
    numbers = [_number(y) for y in train]
    is_name = [v is None for v in numbers]
    if any(is_name) and all(isinstance(y, str) for y in train):
        is_name = [True] * len(train)  # class names, some of which look like numbers
    elif any(is_name) and not all(is_name):
        name = train[is_name.index(True)]
        number = train[is_name.index(False)]
        raise DataError(
            f"The training labels mix class names ({name!r}) and numbers ({number!r}). "
            "Use one kind for every label: all class names, or all numbers."
        )
    names = all(is_name)
    if not names and any(not math.isfinite(v) for v in numbers):
        raise DataError("A training label is not a finite number (nan or inf); fix that row.")
    if not names and any(v != int(v) for v in numbers):
        labels = LabelSet("regression", None, "float")
    else:
        vtype = "str" if names else "bool" if all(isinstance(y, bool) for y in train) else "int"
        probe = LabelSet("classification", None, vtype)
        keys = {probe.key(y) for y in train}
        order = sorted(keys, key=int) if vtype == "int" else sorted(keys)
        labels = LabelSet("classification", tuple(order), vtype)
        if len(order) < 2:
            raise DataError(
                f"The training labels have one class only, {order[0]!r} ({_n(len(train), 'row')})"
                "; a classifier needs at least 2. Check that --label-field names the label "
                "column, or add rows of the other classes."
            )
    if eval_labels is not None:
        _check_eval(labels, list(eval_labels))
    return labels


def _check_eval(labels: LabelSet, evals: list[Any]) -> None:
    if labels.names is None:
        bad = [y for y in evals if (v := _number(y)) is None or not math.isfinite(v)]
        if bad:
            raise DataError(
                f"The task is a regression (the training labels are numbers) but "
                f"{_n(len(bad), 'eval label')} {'is' if len(bad) == 1 else 'are'} not a finite "
                f"number, e.g. {bad[0]!r}. Fix the eval file's labels."
            )
        return
    keys = (labels.key(y) for y in evals)
    unseen = Counter(k for k in keys if k not in labels._ids)
    if unseen:
        listed = ", ".join(f"{k!r} ({_n(n, 'row')})" for k, n in unseen.most_common())
        raise DataError(
            f"The eval labels {listed} do not occur in the training labels "
            f"({', '.join(labels.names)}); a classifier cannot predict a class it never saw. "
            "Remove those rows from the eval file, or add training rows with those labels."
        )


# -------------------------------------------------------------------------------- split


def seeded_split(rows: Sequence, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): ``round(eval_fraction * n)`` random rows held out, at least 1, and at
    least 1 left to train. Deterministic for a seed; by row, not stratified by class. Both
    parts keep the file's order."""
    n = len(rows)
    if not 0 < eval_fraction < 1:
        raise DataError(f"The eval fraction must be between 0 and 1, got {eval_fraction}.")
    if n < 2:
        raise DataError(
            f"Cannot hold out eval rows from {_n(n, 'row')}; give at least 2 rows or an eval file."
        )
    n_eval = min(max(1, round(eval_fraction * n)), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


# --------------------------------------------------------------------------------- task


def metrics_for(num_labels: int) -> tuple[str, ...]:
    """Names in data.METRICS; the first is the headline. Binary f1 and matthews score class
    id 1 (the later class in sorted order) as the positive one."""
    if num_labels == 1:
        return ("pearson", "spearman")
    return ("accuracy", "f1", "matthews") if num_labels == 2 else ("accuracy",)


@dataclass
class TableReport:
    train: FileCounts
    eval: FileCounts | None
    labels: LabelSet
    train_classes: dict[str, int]  # class name -> training examples (empty: regression)
    split: tuple[int, int] | None = None  # (rows held out, seed) when no eval file was given

    def lines(self) -> list[str]:
        """Sentences for the run header."""
        out = [self.train.line()]
        if self.eval is not None:
            out.append(self.eval.line())
        else:
            held, seed = self.split or (0, 0)
            out.append(
                f"eval: {held} of {self.train.kept} rows of {shown_name(self.train.path)} held out "
                f"(seeded split, seed {seed}, not stratified)"
            )
        if self.labels.names is None:
            out.append("labels: numbers with fractions, so a regression (one output)")
        else:
            shown = ", ".join(n if n == str(i) else f"{i} = {n}"  # "0, 1": ids are the names
                              for i, n in enumerate(self.labels.names[:10]))  # fmt: skip
            more = len(self.labels.names) - 10
            shown += f", and {more} more" if more > 0 else ""
            out.append(f"labels: {len(self.labels.names)} classes ({shown})")
            per_class = ", ".join(f"{name}: {n}" for name, n in self.train_classes.items())
            out.append(f"train rows per class: {per_class}")
        return out


def load_table_task(
    train_path: str | Path,
    eval_path: str | Path | None = None,
    *,
    text_fields: Sequence[str] = (),
    label_field: str = "label",
    seed: int = 42,
    eval_fraction: float = 0.1,
    name: str | None = None,
    tsv_quoting: str = "csv",
    preset: Preset | None = None,
) -> tuple[TaskData, TableReport]:
    """Train and eval examples from table files, as ``TaskData`` for the trainer.

    Without ``eval_path`` a seeded split of the training file is the eval set; the classes
    are then those of the whole training file, so they do not depend on the seed. A
    ``preset`` (a GLUE task) gives the fields, the quoting, the task, its label set and the
    names of header-less columns in place of the arguments and of what the files imply.
    """
    fixed = {}
    if preset is not None:
        text_fields, label_field, tsv_quoting = preset.text_fields, preset.label_field, "none"
        fixed = {"headerless_columns": preset.headerless_columns, "labels": preset.labels,
                 "fix": preset.fix}  # fmt: skip
    text_fields = tuple(text_fields)
    train = read_rows(train_path, text_fields, label_field, tsv_quoting=tsv_quoting, **fixed)
    evals = None
    if eval_path is not None:
        evals = read_rows(eval_path, text_fields, label_field, tsv_quoting=tsv_quoting, **fixed)
    if preset is not None:
        labels = preset.labels
    else:
        labels = infer_labels(
            (r.label for r in train.rows), None if evals is None else (r.label for r in evals.rows)
        )
    split = None
    if evals is None:
        train_rows, eval_rows = seeded_split(train.rows, eval_fraction, seed)
        split = (len(eval_rows), seed)
        source = (
            f"table file {train.counts.path}; seeded split: {len(eval_rows)} rows held out "
            f"(seed {seed})"
        )
    else:
        train_rows, eval_rows = train.rows, evals.rows
        source = f"table files: {train.counts.path} (train), {evals.counts.path} (eval)"
    n = labels.num_labels
    task = preset.task if preset is not None else GlueTask(
        name=name or train.counts.path.stem,
        text_columns=text_fields,
        label_column=label_field,
        num_labels=n,
        metrics=metrics_for(n),
        hub_config="",
        hub_text_columns=text_fields,
        dev_file="" if evals is None else evals.counts.path.name,
        label_names=labels.names,
    )  # fmt: skip
    train_ex = [Example(r.texts, labels.target(r.label)) for r in train_rows]
    eval_ex = [Example(r.texts, labels.target(r.label)) for r in eval_rows]
    per_class = Counter(ex.label for ex in train_ex) if labels.names else Counter()
    classes = {labels.names[i]: per_class[i] for i in range(n)} if labels.names else {}
    report = TableReport(
        train.counts, None if evals is None else evals.counts, labels, classes, split
    )
    return TaskData(task, train_ex, eval_ex, source, report), report


@dataclass(frozen=True)
class Preset:
    """A named task's fixed reading of its files (``data.load_task``: the GLUE tasks): the
    task it trains, its fields, its label set, the column names of files without a header
    line, and the fix for a file that lacks a field. Its TSV files are read with
    ``csv.QUOTE_NONE``."""

    task: GlueTask
    text_fields: tuple[str, ...]
    label_field: str
    labels: LabelSet
    headerless_columns: tuple[str, ...] | None
    fix: str
