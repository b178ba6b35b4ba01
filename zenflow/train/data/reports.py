"""What a source tells the run header: per file, the rows (or records) read, kept and
dropped by reason, and what the run trains on.

``FileCounts`` and ``TableReport`` describe a table (a user's, or a GLUE task's files:
the same reader); ``SFTCounts`` and ``SFTReport`` a record file tokenised into rows. Every
row not kept is counted under its reason, never dropped silently; ``lines()`` are the
sentences of the run header.

Owns: the counts and their wording. Must not: read or drop rows (``tables``,
``record_encoding`` count what they do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from zenflow.train.data.hub import shown_name
from zenflow.train.data.labels import LabelSet
from zenflow.train.data.readers import EVAL_IS_TRAIN, plural, same_file
from zenflow.train.data.records import CHAT, PROMPT_COMPLETION, TEXT


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
        head = f"{shown_name(self.path)}: {plural(self.read, 'row')} read, {self.kept} kept"
        if not self.dropped:
            return f"{head}, none dropped"
        why = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items())
        return f"{head}, {sum(self.dropped.values())} dropped ({why})"


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
            if same_file(self.train.path, self.eval.path):
                out.append(EVAL_IS_TRAIN)
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


@dataclass(frozen=True)
class SFTCounts:
    """What happened to one file's records: read = kept + sum(dropped.values())."""

    path: Path
    kind: str
    seq_len: int
    read: int
    kept: int
    truncated: int  # of the kept and the dropped: examples longer than seq_len
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> records

    def line(self) -> str:
        """ "train.jsonl: 500 prompt/completion records read, 498 kept, 2 dropped (2 with no
        completion tokens left after truncation at 128), 17 truncated at 128 tokens"."""
        name = shown_name(self.path)
        head = f"{name}: {plural(self.read, self.kind + ' record')} read, {self.kept} kept"
        if self.dropped:
            why = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items())
            head += f", {sum(self.dropped.values())} dropped ({why})"
        else:
            head += ", none dropped"
        if self.truncated:
            return head + f", {self.truncated} truncated at {self.seq_len} tokens (end cut off)"
        return head + f", none longer than {self.seq_len} tokens"


@dataclass
class SFTReport:
    counts: SFTCounts
    rows: int
    examples: int
    packed: bool
    real_tokens: int
    loss_tokens: int
    add_eos: bool = True

    def lines(self) -> list[str]:
        """Sentences for the run header."""
        c = self.counts
        share = 100 * self.real_tokens / (self.rows * c.seq_len)
        if self.packed:
            rows = (
                f"rows: {plural(self.examples, 'example')} packed into "
                f"{plural(self.rows, 'row')} of {c.seq_len} tokens ({share:.1f}% of positions "
                "hold tokens; each token attends only within its own example, positions "
                "restart per example)"
            )
        else:
            rows = (
                f"rows: {plural(self.rows, 'row')} of {c.seq_len} tokens, one example each, "
                f"right-padded ({share:.1f}% of positions hold tokens)"
            )
        eos = " and the end-of-sequence token" if self.add_eos else ""
        on = {
            TEXT: f"every token but the first of each example (nothing precedes it){eos}",
            PROMPT_COMPLETION: f"the completion tokens{eos}, not the prompt",
            CHAT: "the assistant turns (content and the template's end-of-turn markup), not "
            "the system, user or tool turns",
        }[c.kind]
        return [c.line(), rows, f"loss on: {on}; {self.loss_tokens:,} tokens in all"]
