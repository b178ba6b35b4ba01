"""The GLUE source: GLUE's nine tasks, their files or the hub's, and a synthetic SST-2.

The GLUE tasks are presets of the table reader (``tables``), the one that reads a user's
``--data`` files: a preset fixes the files, their columns, the label set (in the hub's class
order) and the metrics. Rows come from GLUE's original TSV files
(``<data_dir>/<task>/train.tsv`` and the task's dev file) or, without a data directory,
from the hub dataset ``nyu-mll/glue`` through ``datasets``. TSVs are read with
``csv.QUOTE_NONE``: GLUE sentences contain bare double quotes that are text, not quoting.
Rows the table reader drops (empty text, no label) are counted in the run header.
``write_sst2_sample`` writes a learnable SST-2-format sample for offline demos.
``GlueSource`` is this source's ``source.DataSource``.

Owns: the task table, finding a task's files and the sample. Must not: read rows itself
(``tables`` does, with the task's ``Preset``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from zenflow.errors import DataError
from zenflow.train.data.hub import HubLoadError
from zenflow.train.data.source import DataSource
from zenflow.train.data.tables import load_table_task
from zenflow.train.data.task import GlueTask, TaskData

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


def _task_dir(task: GlueTask, data_dir: Path) -> tuple[Path | None, list[Path]]:
    candidates = [data_dir / task.name, data_dir / task.glue_dir_name]
    # A directory named after the task itself (e.g. --data-dir glue/SST-2) also works.
    if data_dir.name.lower().replace("-", "") == task.name:
        candidates.insert(0, data_dir)
    for d in candidates:
        if (d / "train.tsv").is_file() and (d / task.dev_file).is_file():
            return d, candidates
    return None, candidates


def task_files(task: str | GlueTask, data_dir: str | Path | None) -> tuple[Path, ...]:
    """The files ``load_task`` reads for ``task`` under ``data_dir`` (none: the hub, or
    nothing found there)."""
    if data_dir is None:
        return ()
    t = task if isinstance(task, GlueTask) else get_task(task)
    d, _ = _task_dir(t, Path(data_dir).expanduser())
    return () if d is None else (d / "train.tsv", d / t.dev_file)


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
        data, _ = load_table_task(d / "train.tsv", d / t.dev_file, preset=t.preset())
        if (d / SYNTHETIC_MARKER).is_file():
            data.source = f"synthetic SST-2-format sample written by zfctl, not GLUE ({d})"
        else:
            data.source = f"GLUE TSV files: {d / 'train.tsv'}, {d / t.dev_file}"
        return data
    return _load_from_hub(t)


def _load_from_hub(t: GlueTask) -> TaskData:
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


@dataclass(frozen=True, kw_only=True)
class GlueSource(DataSource):
    """A GLUE task: its TSV files under ``data_dir``, or without one the hub's
    ``nyu-mll/glue`` (``load_task``)."""

    task: str | GlueTask
    data_dir: str | Path | None = None
    objective: ClassVar[str] = "classification"

    def load(self, tokenizer=None) -> TaskData:
        return load_task(self.task, self.data_dir)
