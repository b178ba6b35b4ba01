"""GLUE tasks: the task table, loading, tokenised fixed-length batches, metrics.

The GLUE tasks are presets of the table reader (``zenflow.train.tables``), the one that
reads a user's ``--data`` files: a preset fixes the files, their columns, the label set (in
the hub's class order) and the metrics. Rows come from GLUE's original TSV files
(``<data_dir>/<task>/train.tsv`` and the task's dev file) or, without a data directory,
from the hub dataset ``nyu-mll/glue`` through ``datasets``. TSVs are read with
``csv.QUOTE_NONE``: GLUE sentences contain bare double quotes that are text, not quoting.
Rows the table reader drops (empty text, no label) are counted in the run header.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from zenflow.errors import DataError

if TYPE_CHECKING:
    from zenflow.train.tables import Preset, TableReport


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
        from zenflow.train.tables import LabelSet, Preset  # tables builds on this module

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


GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask(
            "sst2", ("sentence",), "label", 2, ("accuracy",), "sst2", ("sentence",),
            glue_dir_name="SST-2",
        ),
        GlueTask(
            "cola", ("sentence",), "label", 2, ("matthews", "accuracy"), "cola", ("sentence",),
            glue_dir_name="CoLA",
            headerless_columns=("source", "label", "original_label", "sentence"),
        ),
        GlueTask(
            "mrpc", ("#1 String", "#2 String"), "Quality", 2, ("f1", "accuracy"), "mrpc",
            ("sentence1", "sentence2"), glue_dir_name="MRPC",
        ),
        GlueTask(
            "qqp", ("question1", "question2"), "is_duplicate", 2, ("accuracy", "f1"), "qqp",
            ("question1", "question2"), glue_dir_name="QQP",
        ),
        GlueTask(
            "stsb", ("sentence1", "sentence2"), "score", 1, ("pearson", "spearman"), "stsb",
            ("sentence1", "sentence2"), glue_dir_name="STS-B",
        ),
        GlueTask(
            "mnli", ("sentence1", "sentence2"), "gold_label", 3, ("accuracy",), "mnli",
            ("premise", "hypothesis"), dev_file="dev_matched.tsv",
            hub_dev_split="validation_matched", glue_dir_name="MNLI",
            label_names=("entailment", "neutral", "contradiction"),
        ),
        GlueTask(
            "qnli", ("question", "sentence"), "label", 2, ("accuracy",), "qnli",
            ("question", "sentence"), glue_dir_name="QNLI",
            label_names=("entailment", "not_entailment"),
        ),
        GlueTask(
            "rte", ("sentence1", "sentence2"), "label", 2, ("accuracy",), "rte",
            ("sentence1", "sentence2"), glue_dir_name="RTE",
            label_names=("entailment", "not_entailment"),
        ),
        GlueTask(
            "wnli", ("sentence1", "sentence2"), "label", 2, ("accuracy",), "wnli",
            ("sentence1", "sentence2"), glue_dir_name="WNLI",
        ),
    )
}  # fmt: skip

SYNTHETIC_MARKER = "SYNTHETIC_SAMPLE.txt"


def get_task(name: str) -> GlueTask:
    """The task named ``name`` (case-insensitive, "SST-2" works); DataError otherwise."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in GLUE_TASKS:
        raise DataError(
            f"Unknown task {name!r}. Known tasks: {', '.join(GLUE_TASKS)}. "
            "Pass one of them with --task."
        )
    return GLUE_TASKS[key]


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


# ---------------------------------------------------------------------------- loading


def _task_dir(task: GlueTask, data_dir: Path) -> tuple[Path | None, list[Path]]:
    candidates = [data_dir / task.name, data_dir / task.glue_dir_name]
    # A directory named after the task itself (e.g. --data-dir glue/SST-2) also works.
    if data_dir.name.lower().replace("-", "") == task.name:
        candidates.insert(0, data_dir)
    for d in candidates:
        if (d / "train.tsv").is_file() and (d / task.dev_file).is_file():
            return d, candidates
    return None, candidates


def load_task(task: str | GlueTask, data_dir: str | Path | None = None) -> TaskData:
    """Load a GLUE task's train and dev rows.

    With ``data_dir``: ``<data_dir>/<task>/train.tsv`` and the task's dev file (the GLUE
    download's directory names, e.g. ``SST-2``, work too). Without: the hub through
    ``datasets.load_dataset("nyu-mll/glue", <config>)`` (only its cache when offline).
    """
    t = task if isinstance(task, GlueTask) else get_task(task)
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        d, looked = _task_dir(t, root)
        if d is None:
            for folder in dict.fromkeys(looked):  # one of the two files there: name the other
                have = [f for f in ("train.tsv", t.dev_file) if (folder / f).is_file()]
                if have:
                    (lacking,) = {"train.tsv", t.dev_file} - set(have)
                    raise DataError(
                        f"{folder / lacking} is missing: {folder} holds {have[0]} but not "
                        f"{lacking} (task {t.name} needs both). Fix: copy {lacking} from the "
                        f"GLUE download into {folder}."
                    )
            where = ", ".join(str(p) for p in dict.fromkeys(looked))
            raise DataError(
                f"No {t.name} data under {root}: looked for train.tsv and {t.dev_file} in "
                f"{where}. Fix: pass --data-dir pointing at a GLUE directory (holding "
                f"{t.name}/train.tsv), set GLUE_DIR, or use --sample-data for a synthetic "
                "SST-2 sample."
            )
        from zenflow.train.tables import load_table_task  # tables builds on this module

        data, _ = load_table_task(d / "train.tsv", d / t.dev_file, preset=t.preset())
        if (d / SYNTHETIC_MARKER).is_file():
            data.source = f"synthetic SST-2-format sample written by zfctl, not GLUE ({d})"
        else:
            data.source = f"GLUE TSV files: {d / 'train.tsv'}, {d / t.dev_file}"
        return data
    return _load_from_hub(t)


def _load_from_hub(t: GlueTask) -> TaskData:
    from zenflow.train.hub_data import HubLoadError
    from zenflow.train.tables import load_table_task

    base = f"nyu-mll/glue:{t.hub_config}"
    try:
        data, _ = load_table_task(f"{base}@train", f"{base}@{t.hub_dev_split}",
                                  preset=t.preset(hub=True))  # fmt: skip
    except HubLoadError as exc:  # not loaded (a loaded split with wrong rows says so itself)
        cause = exc.__cause__
        raise DataError(
            f"Could not load GLUE {t.name} from the Hugging Face hub or its datasets cache "
            f"(nyu-mll/glue, config {t.hub_config!r}): {type(cause).__name__}: {cause}. "
            f"Fix: pass --data-dir DIR with {t.name}/train.tsv and {t.name}/{t.dev_file}, "
            "set GLUE_DIR, or use --sample-data for a synthetic SST-2 sample."
        ) from cause
    data.source = f"Hugging Face datasets: nyu-mll/glue {t.hub_config}"
    return data


# --------------------------------------------------------------------- synthetic sample

_POS_ADJ = ("wonderful", "delightful", "brilliant", "moving", "charming", "superb", "witty")
_NEG_ADJ = ("dreadful", "boring", "clumsy", "tedious", "awful", "lifeless", "dull")
_NOUNS = ("film", "movie", "story", "script", "cast", "ending", "soundtrack", "picture")
_FRAMES = (
    "the {n} is {a} .",
    "a {a} {n} from start to finish .",
    "what a {a} {n} .",
    "i found the {n} {a} and {a2} .",
    "this {n} feels {a} , honestly .",
)


def write_sst2_sample(
    data_dir: str | Path, n: int = 2000, *, n_dev: int | None = None, seed: int = 0
) -> Path:
    """Write a synthetic SST-2-format sample to ``<data_dir>/sst2/{train,dev}.tsv``.

    ``n`` training rows and ``n_dev`` dev rows (default: n // 10, at least 20).
    For offline demos without GLUE data. Deterministic for a given seed; sentences come from
    simple positive/negative templates (label 1 / 0), so a model can learn them. A marker
    file makes ``load_task`` report the source as synthetic. Returns ``data_dir`` (pass it
    to ``load_task(..., data_dir)``).
    """
    root = Path(data_dir)
    d = root / "sst2"
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    def rows(n: int) -> list[str]:
        out = []
        for i in range(n):
            label = i % 2  # balanced
            adjs = _POS_ADJ if label else _NEG_ADJ
            a, a2 = rng.sample(adjs, 2)
            frame = rng.choice(_FRAMES)
            out.append(f"{frame.format(n=rng.choice(_NOUNS), a=a, a2=a2)}\t{label}\n")
        rng.shuffle(out)
        return out

    n_dev = max(20, n // 10) if n_dev is None else n_dev
    for name, count in (("train.tsv", n), ("dev.tsv", n_dev)):
        (d / name).write_text("sentence\tlabel\n" + "".join(rows(count)), encoding="utf-8")
    (d / SYNTHETIC_MARKER).write_text(
        "Synthetic SST-2-format sample written by zfctl (zenflow.train.data.write_sst2_sample), "
        "not GLUE. Template sentences; label 1 = positive, 0 = negative.\n",
        encoding="utf-8",
    )
    return root


# ------------------------------------------------------------------ tokenise and batch


class Encoded:
    """One split, tokenised to exactly ``seq_len`` tokens (truncated, right-padded).

    Tokenisation is lazy and per example (``take``): a batch costs the same whatever the
    split's size, and a run of 40 steps over MNLI's 393k rows does not tokenise them all
    first. With fixed padding, an example's tensors do not depend on its batch-mates, so
    ``take`` and ``tensors`` agree exactly.
    """

    def __init__(self, rows: Sequence[Example], tokenizer, seq_len: int, regression: bool):
        if not rows:
            raise DataError("No rows to encode.")
        self.rows = rows
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.regression = regression

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, indices) -> dict:
        """Tensors of the given examples: input_ids/attention_mask [B, seq_len], labels [B]."""
        import torch

        rows = [self.rows[int(i)] for i in indices]
        firsts = [r.texts[0] for r in rows]
        seconds = [r.texts[1] for r in rows] if len(rows[0].texts) > 1 else None
        enc = self.tokenizer(
            firsts,
            seconds,
            truncation=True,
            max_length=self.seq_len,
            padding="max_length",
            return_tensors="pt",
        )
        dtype = torch.float32 if self.regression else torch.long
        return {
            "input_ids": enc["input_ids"].long(),
            "attention_mask": enc["attention_mask"].long(),
            "labels": torch.tensor([r.label for r in rows], dtype=dtype),
        }

    def tensors(self) -> dict:
        """The whole split at once (tokenises every row)."""
        return self.take(range(len(self.rows)))


TRUNCATION_SAMPLE = 5000  # training rows tokenised up front to count the truncated ones


def is_truncated(rows: Sequence[Example], tokenizer, seq_len: int) -> list[bool]:
    """Per row: is it longer than ``seq_len`` tokens (special tokens included, both texts of
    a pair together), so that ``Encoded`` cuts it?"""
    firsts = [r.texts[0] for r in rows]
    seconds = [r.texts[1] for r in rows] if rows and len(rows[0].texts) > 1 else None
    ids = tokenizer(firsts, seconds, truncation=False, verbose=False)["input_ids"]
    return [len(x) > seq_len for x in ids]


def truncation_line(data: TaskData, tokenizer, seq_len: int, seed: int) -> str:
    """One header sentence: how many rows ``--seq-len`` truncates. Every eval row is
    counted; the training rows too when there are at most ``TRUNCATION_SAMPLE`` of them,
    else a seeded sample of that many (tokenising MNLI's 393k rows would take a minute)."""
    train = data.train
    if len(train) > TRUNCATION_SAMPLE:
        train = random.Random(seed).sample(list(train), TRUNCATION_SAMPLE)

    counts = [(name, sum(is_truncated(rows, tokenizer, seq_len)), len(rows), total)
              for name, rows, total in (("train", train, len(data.train)),
                                        ("eval", data.dev, len(data.dev)))]  # fmt: skip
    parts = ", ".join(
        f"{name} {n} of " + (f"a {k}-row sample of {total}" if k < total else f"{k}")
        + f" ({100 * n / k:.1f}%)" for name, n, k, total in counts
    )  # fmt: skip
    if not any(n for _, n, _, _ in counts):
        return f"none truncated at --seq-len {seq_len} tokens: {parts}"
    return (
        f"truncated to --seq-len {seq_len} tokens (the end cut off): {parts}; raise --seq-len "
        "to keep more of them"
    )


@dataclass
class EncodedTask:
    train: Encoded
    dev: Encoded


def encode(task_data: TaskData, tokenizer, seq_len: int) -> EncodedTask:
    """Both splits of ``task_data``, tokenised (lazily) to fixed length ``seq_len``."""
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}.")
    reg = task_data.task.is_regression
    return EncodedTask(
        train=Encoded(task_data.train, tokenizer, seq_len, reg),
        dev=Encoded(task_data.dev, tokenizer, seq_len, reg),
    )


def steps_per_epoch(n_examples: int, micro_batch: int, grad_accum: int = 1) -> int:
    """Optimizer steps in one epoch: the last incomplete step's examples are dropped."""
    per_step = micro_batch * grad_accum
    if n_examples < per_step:
        raise DataError(
            f"The training split has {n_examples} examples, fewer than one optimizer step "
            f"needs ({micro_batch} micro-batch x {grad_accum} accumulation = {per_step}). "
            "Lower --micro-batch or gradient_accumulation_steps, or use more data."
        )
    return n_examples // per_step


def epoch_permutation(n: int, seed: int, epoch: int):
    """The example order of one epoch: a function of (seed, epoch) only."""
    import torch

    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + epoch) % (2**63))
    return torch.randperm(n, generator=g)


def batches(
    encoded: Encoded, micro_batch: int, seed: int, epoch: int, start_index: int = 0
) -> Iterator[tuple[int, dict]]:
    """Shuffled micro-batches of one epoch, resumable.

    Yields ``(next_index, batch)`` where ``next_index`` is the position in the epoch's order
    after this batch (pass it back as ``start_index`` to continue). The incomplete last
    micro-batch is dropped so every batch has the same shape.
    """
    if start_index % micro_batch:
        raise ValueError(f"start_index {start_index} is not a multiple of {micro_batch}")
    order = epoch_permutation(len(encoded), seed, epoch)
    n_full = len(encoded) // micro_batch * micro_batch
    for i in range(start_index, n_full, micro_batch):
        yield i + micro_batch, encoded.take(order[i : i + micro_batch].tolist())


def eval_batches(encoded: Encoded, batch_size: int, limit: int | None = None) -> Iterator[dict]:
    """In-order batches of the first ``limit`` examples (all when None); last may be short."""
    n = len(encoded) if limit is None else min(limit, len(encoded))
    for i in range(0, n, batch_size):
        yield encoded.take(range(i, min(i + batch_size, n)))


# ------------------------------------------------------------------------- metrics


def accuracy(preds: Sequence[int], labels: Sequence[int]) -> float:
    _same_length(preds, labels)
    return sum(int(p) == int(y) for p, y in zip(preds, labels, strict=True)) / len(labels)


def _confusion(preds, labels) -> tuple[int, int, int, int]:
    tp = fp = fn = tn = 0
    for p, y in zip(preds, labels, strict=True):
        p, y = int(p), int(y)
        if p == 1 and y == 1:
            tp += 1
        elif p == 1:
            fp += 1
        elif y == 1:
            fn += 1
        else:
            tn += 1
    return tp, fp, fn, tn


def f1(preds: Sequence[int], labels: Sequence[int]) -> float:
    """Binary F1 of the positive class (1); 0.0 when there are no true or predicted positives."""
    _same_length(preds, labels)
    tp, fp, fn, _ = _confusion(preds, labels)
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews(preds: Sequence[int], labels: Sequence[int]) -> float:
    """Matthews correlation coefficient (binary); 0.0 when undefined (a constant margin)."""
    _same_length(preds, labels)
    tp, fp, fn, tn = _confusion(preds, labels)
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denom == 0 else (tp * tn - fp * fn) / denom


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson correlation; 0.0 when either side is constant."""
    _same_length(xs, ys)
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    vx = sum((x - mx) ** 2 for x in xs)
    vy = sum((y - my) ** 2 for y in ys)
    return 0.0 if vx == 0 or vy == 0 else cov / math.sqrt(vx * vy)


def _ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ties get the average of their positions."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson of average ranks)."""
    _same_length(xs, ys)
    return pearson(_ranks(xs), _ranks(ys))


def _same_length(a, b) -> None:
    if len(a) != len(b) or len(a) == 0:
        raise ValueError(f"metric inputs must be non-empty and equal length ({len(a)}, {len(b)})")


METRICS = {
    "accuracy": accuracy,
    "f1": f1,
    "matthews": matthews,
    "pearson": pearson,
    "spearman": spearman,
}


def compute_metrics(task: GlueTask, preds: Sequence, labels: Sequence) -> dict[str, float]:
    """The task's metrics, keyed by name, in the table's order."""
    return {name: float(METRICS[name](preds, labels)) for name in task.metrics}
