"""A classification task and its examples: what the GLUE and table sources produce.

``GlueTask`` describes a task: its text and label fields, its classes and its metrics (one
of GLUE's nine tasks, or the task a user's table defines). ``Preset`` is a named task's
fixed reading of its files (``GlueTask.preset``), which the table reader applies to GLUE's
TSV files and to the hub's ``nyu-mll/glue``. ``TaskData`` holds the train and eval
``Example`` rows, where they came from and the reader's report.

Owns: these types. Must not: read files or tokenise (``glue``, ``tables``, ``encoding``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from zenflow.train.data.labels import LabelSet
from zenflow.train.data.reports import TableReport


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: where its text and label live and how it is scored."""

    name: str
    text_columns: tuple[str, ...]  # TSV column names of the text field(s)
    label_column: str  # TSV column name of the label
    num_labels: int  # 1 = regression
    metrics: tuple[str, ...]  # first one is the task's headline metric
    hub_config: str  # datasets.load_dataset("nyu-mll/glue", hub_config)
    hub_text_columns: tuple[str, ...]
    dev_file: str = "dev.tsv"
    hub_dev_split: str = "validation"
    glue_dir_name: str = ""  # directory name in GLUE's own download (e.g. "SST-2")
    # Label strings in the TSV -> class id (hub order); None: labels are numbers.
    label_names: tuple[str, ...] | None = None
    # Files without a header line: the column names by position.
    headerless_columns: tuple[str, ...] | None = None

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1

    def preset(self, hub: bool = False) -> Preset:
        """How the table reader reads this task's files (``hub``: the hub dataset's
        splits, whose labels are class ids in the same order as ``label_names``)."""
        if self.is_regression:
            labels = LabelSet("regression", None, "float")
        elif self.label_names is not None and not hub:
            labels = LabelSet("classification", self.label_names, "str")
        else:
            labels = LabelSet("classification", tuple(map(str, range(self.num_labels))), "int")
        texts, label = (self.hub_text_columns, "label") if hub else (
            self.text_columns, self.label_column
        )  # fmt: skip
        where = "the hub dataset nyu-mll/glue" if hub else f"GLUE's {self.name} files"
        fix = (
            f"{where} have the fields {', '.join(repr(c) for c in (*texts, label))}; restore "
            "the original files from the GLUE download, or train on your own table with --data."
        )
        headerless = None if hub else self.headerless_columns
        return Preset(self, texts, label, labels, headerless, fix)


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


class Example(NamedTuple):
    texts: tuple[str, ...]  # one or two text fields
    label: int | float


@dataclass
class TaskData:
    task: GlueTask
    train: list[Example]
    dev: list[Example]
    source: str  # human-readable: where the rows came from
    report: TableReport | None = None  # rows read, kept and dropped; the labels

    def header_lines(self) -> list[str]:
        """Sentences for the run header: the reader's counts and the labels."""
        return [] if self.report is None else self.report.lines()
