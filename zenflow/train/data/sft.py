"""The SFT records source: a causal LM's train and eval rows, from text, prompt/completion
or chat records (a ``.jsonl`` / ``.json`` file, or a hub dataset's split).

Contract:

- ``load_lm_data`` reads the ``--data`` record file (and ``--eval-data``, else a seeded
  10% of the records, ``batching.seeded_split``), tokenises both with the model's tokenizer
  and returns ``LMData``: ``train``/``dev`` (``packing.SFTData`` rows the trainer's batcher
  takes), the ``LMTask`` and header lines stating what was read, kept, dropped and
  truncated, and where the loss is.
- Eval rows are never packed (each example is scored alone, as the user reads it). When
  the eval records are prompt/completion records whose completions come from a small set
  (``choice_set``), the task also scores ``choice_accuracy`` (``lm_scoring.evaluate_lm``).
- ``load_sft`` / ``build_sft``: one record file (or records already read) tokenised,
  truncated and put into rows, with its ``reports.SFTReport``.
- ``RecordSource`` is this source's ``source.DataSource``.

Owns: the causal-LM task and the assembly of its rows. Must not: score or train a model
(``lm_scoring``); the reading, tokenising and packing are ``records``,
``record_encoding`` and ``packing``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from zenflow.errors import DataError
from zenflow.train.data.batching import seeded_split
from zenflow.train.data.hub import shown_name
from zenflow.train.data.packing import SFTData
from zenflow.train.data.readers import EVAL_IS_TRAIN, same_file
from zenflow.train.data.record_encoding import encode_records, pad_token_id
from zenflow.train.data.records import (
    PROMPT_COMPLETION,
    TEXT,
    RecordFields,
    Records,
    read_records,
)
from zenflow.train.data.reports import SFTReport
from zenflow.train.data.source import DataSource

EVAL_FRACTION = 0.1
MAX_CHOICES = 16


@dataclass(frozen=True)
class LMTask:
    """What the trainer, the header and the report need of a task, for a causal LM."""

    name: str
    metrics: tuple[str, ...]  # the first is the headline (shown on the dashboard)
    choices: tuple[str, ...] | None = None  # the completion set choice_accuracy scores
    kind: str = TEXT  # the records' kind (records.TEXT / PROMPT_COMPLETION / CHAT)
    num_labels: int = 0  # no classification head
    objective: str = "causal-lm"

    @property
    def is_regression(self) -> bool:
        return False


@dataclass
class LMData:
    task: LMTask
    train: SFTData
    dev: SFTData
    dev_pairs: list[tuple[str, str]]  # (prompt, completion) of the eval records, in order
    source: str
    lines: list[str] = field(default_factory=list)

    def header_lines(self) -> list[str]:
        """Sentences for the run header: what was read, kept, dropped and truncated, and
        where the loss is."""
        return list(self.lines)


def load_sft(
    path: str | Path,
    tokenizer,
    seq_len: int,
    *,
    pack: bool = False,
    fields: RecordFields = RecordFields(),
    add_eos: bool = True,
) -> tuple[SFTData, SFTReport]:
    """Read, tokenise, truncate and (optionally) pack one record file."""
    return build_sft(read_records(path, fields), tokenizer, seq_len, pack=pack, add_eos=add_eos)


def build_sft(
    records: Records, tokenizer, seq_len: int, *, pack: bool = False, add_eos: bool = True
) -> tuple[SFTData, SFTReport]:
    """``load_sft`` for records already read (``read_records`` or ``records_from``)."""
    examples, counts = encode_records(records, tokenizer, seq_len, add_eos=add_eos)
    data = SFTData(examples, seq_len, pad_id=pad_token_id(tokenizer), pack=pack)
    loss_tokens = int(data.loss_tokens.sum())
    report = SFTReport(
        counts, len(data), len(examples), pack, data.real_tokens, loss_tokens, add_eos
    )
    return data, report


def choice_set(completions: Sequence[str]) -> tuple[str, ...] | None:
    """The sorted distinct completions when they look like a label set (2..MAX_CHOICES
    distinct values, and at least 4 times as many records), else None."""
    distinct = sorted(set(completions))
    if not 2 <= len(distinct) <= MAX_CHOICES or len(completions) < 4 * len(distinct):
        return None
    return tuple(distinct)


def eval_pairs(records: Records) -> list[tuple[str, str]]:
    """(prompt, completion) of prompt/completion records (others: none), in order; records
    without a completion are left out, as training drops them."""
    if records.kind != PROMPT_COMPLETION:
        return []
    f = records.fields
    out = []
    for _, rec in records.items:
        p, c = rec.get(f.prompt), rec.get(f.completion)
        if isinstance(p, str) and isinstance(c, str) and c.strip():
            out.append((p, c))
    return out


def load_lm_data(
    data_file: str | Path,
    eval_file: str | Path | None,
    tokenizer,
    seq_len: int,
    *,
    fields: RecordFields = RecordFields(),
    pack: bool = False,
    seed: int = 42,
    name: str | None = None,
) -> LMData:
    """Train and eval rows of a causal-LM run (see the module docstring)."""
    train = read_records(data_file, fields)
    lines = []
    if eval_file is not None:
        dev = read_records(eval_file, fields)
        if dev.kind != train.kind:
            raise DataError(
                f"{eval_file} holds {dev.kind} records but {data_file} holds {train.kind} "
                "records; give both files records of one kind."
            )
        source = f"records: {data_file} (train), {eval_file} (eval)"
        if same_file(data_file, eval_file):
            lines.append(EVAL_IS_TRAIN)
    else:
        kept, held = seeded_split(train.items, EVAL_FRACTION, seed)
        train, dev = (Records(train.path, train.kind, items, fields) for items in (kept, held))
        source = f"records: {data_file} (seeded split, seed {seed})"
        lines.append(
            f"eval: {len(held)} of the {len(kept) + len(held)} records of {shown_name(data_file)}"
            f" held out (seed {seed}, {EVAL_FRACTION:.0%}); pass --eval-data for a file of its own"
        )
    train_rows, train_report = build_sft(train, tokenizer, seq_len, pack=pack)
    dev_rows, pairs, task, dev_report = eval_rows(dev, tokenizer, seq_len,
                                                  name or Path(data_file).stem)  # fmt: skip
    lines = [*train_report.lines(), "eval " + dev_report.counts.line(), *lines]
    if task.choices:
        shown = ", ".join(repr(c) for c in task.choices)
        lines.append(
            f"eval also scores choice_accuracy: the eval completions come from a set of "
            f"{len(task.choices)} ({shown}); a record counts as right when its own completion "
            "is the likeliest of the set given its prompt"
        )
    return LMData(task, train_rows, dev_rows, pairs, source, lines)


def eval_rows(records: Records, tokenizer, seq_len: int, name: str):
    """Eval records as ``(rows, pairs, task, report)``: the rows, never packed (each example
    is scored alone, as the user reads it), the (prompt, completion) pairs, the ``LMTask``
    (with ``choice_accuracy`` when the completions form a choice set) and the
    ``reports.SFTReport``."""
    rows, report = build_sft(records, tokenizer, seq_len, pack=False)
    pairs = eval_pairs(records)
    choices = choice_set([c for _, c in pairs]) if pairs else None
    metrics = ("choice_accuracy", "perplexity") if choices else ("perplexity",)
    task = LMTask(name=name, metrics=metrics, choices=choices, kind=records.kind)
    return rows, pairs, task, report


@dataclass(frozen=True, kw_only=True)
class RecordSource(DataSource):
    """A causal LM's record file (or a hub dataset's split) and its eval file, if any,
    tokenised with the model's tokenizer (``load_lm_data``)."""

    data_file: str | Path
    eval_file: str | Path | None = None
    seq_len: int
    fields: RecordFields = RecordFields()
    pack: bool = False
    seed: int = 42
    name: str | None = None
    objective: ClassVar[str] = "causal-lm"

    def load(self, tokenizer=None) -> LMData:
        if tokenizer is None:
            raise ValueError("records are tokenised as they are read: pass the model's tokenizer")
        return load_lm_data(self.data_file, self.eval_file, tokenizer, self.seq_len,
                            fields=self.fields, pack=self.pack, seed=self.seed,
                            name=self.name)  # fmt: skip
