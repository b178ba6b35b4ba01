"""The table source: a user's own classification or regression data, read from table files
(or a hub dataset's split), and GLUE's files through the same reader.

Contract:

- ``read_rows`` reads one file: ``.jsonl`` (one JSON object per line, blank lines skipped),
  ``.json`` (an array of objects), ``.csv``, ``.tsv`` (``tsv_quoting="csv"``: standard
  quoting with a tab delimiter; ``"none"``: ``csv.QUOTE_NONE`` as GLUE's files need) or
  ``.parquet`` (pyarrow, imported only then), through ``readers``; or a hub dataset's
  split (``hub``). Text files are UTF-8, a leading byte-order mark allowed, and are read
  whole. It returns rows of (texts, raw label) and the file's
  counts; every row not kept is counted under a reason ("empty text", "missing text value",
  "missing label value"; the first that applies), never dropped silently.
- The labels follow ``labels``: raw labels keep their file types, one kind per column, and
  ``infer_labels`` decides the objective and the classes from the training labels only.
- ``seeded_split`` (``batching``) holds out a random ``eval_fraction`` of the rows when no
  eval file is given. It splits by row (``random.Random(seed)``); it does not stratify by
  class.
- ``load_table_task`` puts it together: a ``GlueTask``-compatible task, ``TaskData`` and a
  ``TableReport`` whose ``lines()`` are sentences for the run header.
- The GLUE tasks are presets of this reader (``Preset``, made by ``GlueTask.preset``): the
  preset fixes the fields, the TSV quoting (``none``), the column names of a file without
  a header (CoLA), the label set in the hub's class order (MNLI's names are not sorted;
  STS-B is a regression whatever its scores look like) and the metrics; every label must
  be in that set (``DataError`` naming file and line). Nothing else differs: the same
  drops, counts, UTF-8 and width checks.
- ``TableSource`` is this source's ``source.DataSource``.

Every problem the user can fix is a ``DataError`` (exit 2 at the CLI) that says what is
wrong, where (file, line, byte) and how to fix it.

Owns: reading a table's rows and assembling its task. Must not: decode file formats
(``readers``) or decide what labels mean (``labels``).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from zenflow.errors import DataError
from zenflow.train.data.batching import seeded_split
from zenflow.train.data.hub import hub_records, is_hub_id
from zenflow.train.data.labels import (
    LabelSet,
    check_fixed_label,
    check_label,
    check_one_label_kind,
    infer_labels,
)
from zenflow.train.data.metrics import metrics_for
from zenflow.train.data.readers import (
    RecordList,
    check_input_file,
    csv_file_records,
    json_objects,
    jsonl_objects,
    kind_of,
    parquet_records,
    plural,
    quoted_names,
    read_text,
    with_columns,
)
from zenflow.train.data.reports import FileCounts, TableReport
from zenflow.train.data.source import DataSource
from zenflow.train.data.task import Example, GlueTask, Preset, TaskData

FORMATS = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
EMPTY_TEXT, MISSING_TEXT, MISSING_LABEL = "empty text", "missing text value", "missing label value"


class Row(NamedTuple):
    texts: tuple[str, ...]  # one or two text fields, as in the file
    label: Any  # raw: str/int/float/bool; None only when the label was not required
    where: str  # "line 7" (jsonl, csv, tsv), "item 7" (json array), "row 7" (parquet)


@dataclass
class TableRows:
    rows: list[Row]
    counts: FileCounts


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
    if not hub:
        check_input_file(path, tuple(FORMATS))
    fmt = "jsonl" if hub else FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(
            f"{path}: unknown table format {path.suffix or '(no suffix)'!r}; supported are "
            f"{', '.join(FORMATS)}. Rename the file to the suffix of its format."
        )
    if tsv_quoting not in ("csv", "none"):
        raise ValueError(f"tsv_quoting must be 'csv' or 'none', got {tsv_quoting!r}")
    columns, records = _file_records(path, fmt, hub, tsv_quoting, (*text_fields, label_field),
                                     headerless_columns)  # fmt: skip
    if not records:
        none = "has no rows" if headerless_columns else _NO_ROWS[fmt]
        raise DataError(f"{path} {none}; add rows to it.")
    _check_fields(path, columns, text_fields, label_field, label_required, fix)
    rows, dropped = _kept_rows(path, fmt, records, text_fields, label_field, label_required,
                               labels)  # fmt: skip
    read = len(records)
    if not rows:
        why = ", ".join(f"{n} {r}" for r, n in dropped.items())
        check = fix or (
            "Check that --text-field and --label-field name the right columns (the file has "
            f"{quoted_names(columns)}) and fill in the empty values."
        )
        raise DataError(f"{path}: all {plural(read, 'row')} were dropped ({why}). {check}")
    if labels is None:  # a fixed set has checked every label already
        check_one_label_kind(path, label_field, rows, fmt)
    counts = FileCounts(path, fmt, tuple(columns), read, len(rows), dict(dropped))
    return TableRows(rows, counts)


def _file_records(path: Path, fmt: str, hub: bool, tsv_quoting: str, wanted: Sequence[str],
                  headerless_columns: Sequence[str] | None,
                  ) -> tuple[list[str], RecordList]:  # fmt: skip
    """The column names and the records of one table, by its format."""
    if hub:  # a hub dataset's split: its rows as records, like a JSONL file's
        return with_columns(hub_records(str(path)))
    if fmt == "parquet":
        return parquet_records(path, wanted)
    if fmt in ("csv", "tsv"):  # streamed, keeping only the wanted fields (MNLI: 393k rows)
        return csv_file_records(path, fmt, tsv_quoting, wanted, headerless_columns)
    text = read_text(path)
    if not text.strip():
        raise DataError(f"{path} is empty; expected a table of rows with a header or keys.")
    if fmt == "jsonl":
        return with_columns(jsonl_objects(path, text))
    return with_columns(json_objects(path, text))


def _kept_rows(path: Path, fmt: str, records: RecordList, text_fields: tuple[str, ...],
               label_field: str, label_required: bool, labels: LabelSet | None,
               ) -> tuple[list[Row], Counter[str]]:  # fmt: skip
    """The rows kept, in order, and the rows dropped by reason (``_drop_reason``); a text
    that is not a string, or a label that is no label, is a DataError naming its row."""
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
            check_label(path, where, label_field, label, fmt)
            if labels is not None:
                check_fixed_label(path, where, label_field, label, labels)
        rows.append(Row(tuple(texts), label, where))
    return rows, dropped


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


def _check_fields(path, columns, text_fields, label_field, label_required, fix=None) -> None:
    missing = [(f, "--text-field") for f in text_fields if f not in columns]
    if label_required and label_field not in columns:
        missing.append((label_field, "--label-field"))
    if missing:
        if fix is None:
            what = ", ".join(f"{f!r} (asked for with {flag})" for f, flag in missing)
            fix = "Pass the right name with --text-field / --label-field, or rename the field."
        else:
            what = quoted_names(f for f, _ in missing)
        raise DataError(
            f"{path}: no field {what}; the file's fields are "
            f"{quoted_names(columns) or 'none'}. {fix}"
        )
    duplicated = [f for f in dict.fromkeys((*text_fields, label_field)) if columns.count(f) > 1]
    if duplicated:
        raise DataError(
            f"{path}: the header names {quoted_names(duplicated)} more than once; rename the "
            "duplicate so each column has its own name."
        )


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


@dataclass(frozen=True, kw_only=True)
class TableSource(DataSource):
    """A user's table file (or a hub dataset's split) and its eval file, if any
    (``load_table_task``; without an eval file, a seeded split of the training rows)."""

    train_path: str | Path
    eval_path: str | Path | None = None
    text_fields: tuple[str, ...] = ("text",)
    label_field: str = "label"
    seed: int = 42
    eval_fraction: float = 0.1
    name: str | None = None
    tsv_quoting: str = "csv"
    objective: ClassVar[str] = "classification"

    def load(self, tokenizer=None) -> TaskData:
        """The table's task and rows (``data.report``: the reader's counts and the labels),
        read once per source and files: a file that changed (size or modification time) is
        read again. The CLI's preflight and the run in one process read a table once."""
        files = tuple(_stamp(p) for p in (self.train_path, self.eval_path) if p is not None)
        return _load_once(self, files)


def _stamp(path: str | Path) -> tuple[str, int, int]:
    """A file's path, size and modification time (ns); (path, -1, -1) when it cannot be read
    (a hub dataset's id; the reader then names any problem)."""
    try:
        st = Path(path).stat()
    except OSError:
        return (str(path), -1, -1)
    return (str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _load_once(source: TableSource, files: tuple) -> TaskData:
    del files  # the cache key: the files as they are now
    data, _ = load_table_task(source.train_path, source.eval_path,
                              text_fields=source.text_fields, label_field=source.label_field,
                              seed=source.seed, eval_fraction=source.eval_fraction,
                              name=source.name, tsv_quoting=source.tsv_quoting)  # fmt: skip
    return data
