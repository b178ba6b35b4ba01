"""The one interface every data source implements, and what the run and ``zfctl eval``
read of the data a source gives.

A source turns what the user named into ``SourceData``: the task, the train and eval rows,
where they came from (in words) and the run header's sentences on what was read, kept and
dropped. The sources, one module each:

- ``glue.GlueSource``: one of GLUE's tasks, from its TSV files or the hub's ``nyu-mll/glue``
  (presets of the table reader);
- ``tables.TableSource``: a user's ``.jsonl`` / ``.json`` / ``.csv`` / ``.tsv`` /
  ``.parquet`` table, for classification or regression;
- ``sft.RecordSource``: text, prompt/completion or chat records, for a causal LM.

A hub dataset (``hub``: ``NAME[:CONFIG][@SPLIT]``) is a place rows come from rather than a
kind of data: the table and record sources read its split as they read a file's.

Adding a source is adding one module: a ``DataSource`` subclass whose ``load`` returns
``SourceData``, built on the shared pieces (``readers``, ``labels``, ``encoding``,
``record_encoding``, ``packing``, ``batching``). A classification source returns
``task.TaskData`` (examples the run encodes with ``encoding.encode``), a causal-LM source
rows ready for the batcher (``sft.LMData``).

Owns: the interface (``DataSource``, ``SourceData``, ``Task``, ``Rows``) and ``OBJECTIVES``.
Must not: import a source module; the sources import this one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sized
from typing import ClassVar, Protocol

OBJECTIVES = ("classification", "causal-lm")


class Task(Protocol):
    """What the run, its header and its report read of a task (``task.GlueTask``,
    ``sft.LMTask``)."""

    name: str
    metrics: tuple[str, ...]  # the first is the headline (shown on the dashboard)
    num_labels: int  # 1: a regression; 0: no classification head (a causal LM)

    @property
    def is_regression(self) -> bool: ...


class Rows(Protocol):
    """Rows the batcher and the evaluations take (``encoding.Encoded``,
    ``packing.SFTData``): a batch is a dict of stacked tensors for ``model(**batch)``."""

    def __len__(self) -> int: ...

    def take(self, indices) -> dict: ...


class SourceData(Protocol):
    """What a source's ``load`` gives (``task.TaskData``, ``sft.LMData``)."""

    task: Task
    train: Sized  # the training examples (or rows)
    dev: Sized  # the eval examples (or rows)
    source: str  # where the rows came from, in words

    def header_lines(self) -> list[str]:
        """Sentences for the run header: what was read, kept and dropped, and why."""
        ...


class DataSource(ABC):
    """One source of a run's data (see the module docstring)."""

    objective: ClassVar[str]  # one of OBJECTIVES: what a model trained on it learns

    @abstractmethod
    def load(self, tokenizer=None) -> SourceData:
        """The task, the train and eval rows, their source and the header lines; a
        ``DataError`` naming the file, the row and the fix for anything the user can
        correct. ``tokenizer``: the model's, for a source whose rows are tokenised as they
        are read (records); the others leave tokenising to the run."""
