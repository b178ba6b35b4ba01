"""Label sets: what a table's raw labels mean, decided from the training labels only.

Contract:

- Raw labels keep their file types: JSON and Parquet give str/int/float/bool, CSV and TSV
  give stripped strings. One column holds one kind (class names or numbers); a mix, a
  non-finite number or a label that is neither is a ``DataError`` naming file and line
  (``check_label``, ``check_one_label_kind``).
- ``infer_labels`` decides the objective from the training labels only: integers (also
  integer-valued floats, digit strings and bools) or strings are classes, ordered by
  value (numbers numerically, strings by code point), ids 0..n-1 in that order; any
  non-integer number makes a regression (one output). Eval labels must be training classes.
- A preset's label set is fixed (the GLUE tasks: ``task.GlueTask.preset``); every label must
  be in it (``check_fixed_label``).

Owns: ``LabelSet`` and the rules above. Must not: read files (``tables`` hands the rows in).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from zenflow.errors import DataError
from zenflow.train.data.readers import kind_of, plural

# CSV/TSV labels are strings; these decide which of them are numbers (ASCII digits only, so
# "1_000" or non-Latin digits stay class names, unlike int()).
_INT_RE = re.compile(r"[+-]?\d+", re.ASCII)
_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)
_NON_FINITE = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


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
            f"{plural(train.count(None), 'training row')} without a label; every training row "
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
                f"The training labels have one class only, {order[0]!r} "
                f"({plural(len(train), 'row')}); a classifier needs at least 2. Check that "
                "--label-field names the label column, or add rows of the other classes."
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
                f"{plural(len(bad), 'eval label')} {'is' if len(bad) == 1 else 'are'} not a finite "
                f"number, e.g. {bad[0]!r}. Fix the eval file's labels."
            )
        return
    keys = (labels.key(y) for y in evals)
    unseen = Counter(k for k in keys if k not in labels._ids)
    if unseen:
        listed = ", ".join(f"{k!r} ({plural(n, 'row')})" for k, n in unseen.most_common())
        raise DataError(
            f"The eval labels {listed} do not occur in the training labels "
            f"({', '.join(labels.names)}); a classifier cannot predict a class it never saw. "
            "Remove those rows from the eval file, or add training rows with those labels."
        )


def check_label(path: Path, where: str, label_field: str, label: Any, fmt: str) -> None:
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


def check_fixed_label(path: Path, where: str, label_field: str, label: Any,
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


def check_one_label_kind(path: Path, label_field: str, rows: Iterable[Any], fmt: str) -> None:
    """One kind of label per column: class names or numbers (in CSV: strings that look like
    numbers or not; in JSON: the value's type). ``rows``: ``tables.Row``s, each with its
    label and where it is."""
    first: dict[str, Any] = {}
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
