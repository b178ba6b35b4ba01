"""Evaluating a classifier on an encoded split: the loop the trainer runs at every
evaluation and ``zfctl eval`` runs on a saved model, so both give the same figures.

``evaluate_classifier`` returns the task's metrics (``compute_metrics``), the mean eval loss
and, per example, the prediction (class id, or the value for a regression) and the logits.
``eval_batch_size`` is the trainer's evaluation batch (twice the micro-batch): ``zfctl eval``
of a run uses the run's, so the batches (and the floating-point sums) are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zenflow.train.data import Encoded, GlueTask, compute_metrics, eval_batches


def eval_batch_size(micro_batch: int) -> int:
    """The evaluation batch of a run with this micro-batch."""
    return 2 * int(micro_batch)


def evaluate_classifier(
    model,
    encoded: Encoded,
    task: GlueTask,
    *,
    batch_size: int,
    limit: int | None = None,
    device=None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    keep_logits: bool = False,
) -> tuple[dict, list, list]:
    """Metrics of ``model`` on the first ``limit`` rows of ``encoded`` (all when None), in
    eval mode (restored after); returns ``(metrics, predictions, logits)`` (``logits``
    empty unless ``keep_logits``). ``metrics`` holds the task's metrics, ``eval_loss`` (the
    mean over rows) and ``eval_samples``."""
    import torch

    was_training = model.training
    model.eval()
    preds, labels, logits_out, loss_sum, n = [], [], [], 0.0, 0
    try:
        with torch.no_grad():
            for batch in eval_batches(encoded, batch_size, limit):
                if device is not None:
                    batch = {k: v.to(device) for k, v in batch.items()}
                with autocast():
                    out = model(**batch)
                b = batch["labels"].shape[0]
                loss_sum += float(out.loss.float()) * b
                n += b
                logits = out.logits.float()
                if task.is_regression:
                    preds += logits[:, 0].tolist()
                else:
                    preds += logits.argmax(-1).tolist()
                if keep_logits:
                    logits_out += logits.cpu().tolist()
                labels += batch["labels"].tolist()
    finally:
        model.train(was_training)
    metrics = compute_metrics(task, preds, labels)
    metrics["eval_loss"] = loss_sum / n
    metrics["eval_samples"] = n
    return metrics, preds, logits_out


# ----------------------------------------------------------------- a saved model (zfctl eval)


@dataclass
class EvalSetup:
    """What ``zfctl eval`` evaluates: the model folder, the rows and how they are encoded."""

    model_dir: Path
    task: GlueTask
    rows: list  # data.Example
    seq_len: int
    batch_size: int
    limit: int | None
    source: str  # where the rows came from, in words
    run_dir: Path | None = None  # the run whose model this is, if any
    labels: object = None  # tables.LabelSet of a table's rows (None: a GLUE task's ids)


def setup_eval(
    target: str | Path,
    *,
    data_file: str | None = None,
    task: str | None = None,
    data_dir: str | None = None,
    text_fields: tuple[str, ...] | None = None,
    label_field: str | None = None,
    tsv_quoting: str | None = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    max_samples: int | None = None,
) -> EvalSetup:
    """Resolve ``target`` (a run directory: its ``model/``; or a Hugging Face model folder)
    and the rows to evaluate. A run without ``data_file``/``task`` is evaluated on its own
    evaluation rows (its GLUE dev file, its ``--eval-data`` or its seeded split) with its
    sequence length, batch and ``--max-eval-samples``: the figures of its final evaluation.
    Settings given here replace the run's."""
    from zenflow.errors import UserInputError
    from zenflow.train import runs
    from zenflow.train.data import get_task, load_task

    target = Path(target)
    rec: dict = {}
    run_dir = None
    if runs.holds_run(target):
        run_dir, rec = target, (runs.run_config(target) or {}).get("run") or {}
        model_dir = target / runs.MODEL_DIR
        if not (model_dir / "config.json").is_file():
            raise UserInputError(
                f"{target} holds no saved model yet ({model_dir} is missing: the run has not "
                f"finished). Resume it to the end (zfctl finetune {rec.get('model')} --resume "
                f"{target}), or pass a model folder."
            )
    elif (target / "config.json").is_file():
        model_dir = target
    else:
        raise UserInputError(
            f"{target} is neither a zfctl run directory nor a Hugging Face model folder (no "
            "config.json); pass runs/<run> or a folder saved with save_pretrained."
        )
    own = data_file is None and task is None
    if run_dir is None and own:
        raise UserInputError(
            f"{target} is a model folder, not a run: pass the rows to evaluate with --data FILE "
            "(a table) or --task GLUE_TASK."
        )
    seq_len = seq_len or rec.get("seq_len") or 128
    batch_size = batch_size or eval_batch_size(rec.get("micro_batch") or 8)
    limit = max_samples if max_samples is not None else (rec.get("max_eval_samples") if own
                                                         else None)  # fmt: skip
    saved_labels = (runs.run_config(run_dir) or {}).get("labels") if run_dir else None
    if own and rec.get("data_file"):  # the run's own table rows, as it split them
        from zenflow.train.spec import RunSpec, load_spec_table

        keep = ("data_file", "eval_file", "text_fields", "label_field", "tsv_quoting", "seed")
        spec = RunSpec(model=rec.get("model"), task=rec.get("task"), config=None,
                       **{k: tuple(v) if isinstance(v, list) else v
                          for k, v in rec.items() if k in keep})  # fmt: skip
        data, report = load_spec_table(spec)
        return EvalSetup(model_dir, data.task, data.dev, seq_len, batch_size, limit,
                         data.source, run_dir, report.labels)  # fmt: skip
    if own or task is not None:  # a GLUE task: the run's, or the one named
        t = get_task(task or rec.get("task"))
        data = load_task(t, data_dir if data_dir is not None else rec.get("data_dir"))
        return EvalSetup(model_dir, t, data.dev, seq_len, batch_size, limit, data.source,
                         run_dir)  # fmt: skip
    return _table_setup(model_dir, run_dir, rec, saved_labels, data_file, text_fields,
                        label_field, tsv_quoting, seq_len, batch_size, limit)  # fmt: skip


def _table_setup(model_dir, run_dir, rec, saved_labels, data_file, text_fields, label_field,
                 tsv_quoting, seq_len, batch_size, limit) -> EvalSetup:  # fmt: skip
    """Every row of a table, its labels mapped to the MODEL's class ids (its run's label
    set, else the model's config.id2label), never re-inferred from the file."""
    import json

    from zenflow.errors import DataError
    from zenflow.train.data import Example
    from zenflow.train.tables import LabelSet, infer_labels, metrics_for, read_rows

    fields = tuple(text_fields or rec.get("text_fields") or ("text",))
    label = label_field or rec.get("label_field") or "label"
    table = read_rows(data_file, fields, label,
                      tsv_quoting=tsv_quoting or rec.get("tsv_quoting") or "csv")  # fmt: skip
    found = infer_labels(r.label for r in table.rows)
    if saved_labels is not None:
        labels = LabelSet.from_json(saved_labels)
    else:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        labels = _labels_of_config(cfg, found)
    try:
        rows = [Example(r.texts, labels.target(r.label)) for r in table.rows]
    except DataError as exc:
        raise DataError(f"{data_file}: {exc} (the classes of the model in {model_dir}).") from None
    n = labels.num_labels
    task = GlueTask(name=table.counts.path.stem, text_columns=fields, label_column=label,
                    num_labels=n, metrics=metrics_for(n), hub_config="", hub_text_columns=fields,
                    label_names=labels.names)  # fmt: skip
    source = f"table file {table.counts.path} ({table.counts.line()})"
    return EvalSetup(model_dir, task, rows, seq_len, batch_size, limit, source, run_dir, labels)


def _labels_of_config(cfg: dict, found):
    """The label set of a Hugging Face model config: its id2label names, or, for HF's
    default names (LABEL_0, ...), the ids themselves ("0", "1", ...) for integer labels."""
    from zenflow.errors import DataError
    from zenflow.train.tables import LabelSet

    if cfg.get("problem_type") == "regression" or int(cfg.get("num_labels", 2)) == 1:
        return LabelSet("regression", None, "float")
    id2label = {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
    n = len(id2label) or int(cfg.get("num_labels", 2))
    names = tuple(id2label.get(i, f"LABEL_{i}") for i in range(n))
    if all(name == f"LABEL_{i}" for i, name in enumerate(names)):
        if found.value_type not in ("int", "bool"):
            raise DataError(
                f"the model names its classes LABEL_0..LABEL_{n - 1} (no id2label), so the "
                f"labels must be class ids 0..{n - 1}, but they are {found.value_type} "
                "values; write the class ids, or evaluate the run directory (it knows the "
                "names)."
            )
        names = tuple(str(i) for i in range(n))
    return LabelSet("classification", names, found.value_type)


def run_eval(setup: EvalSetup, *, device: str = "cpu") -> tuple[dict, list, list]:
    """Load the model and tokenizer of ``setup`` and evaluate: ``(metrics, predictions,
    logits)`` (``evaluate_classifier``)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from zenflow.train.data import Encoded

    tokenizer = AutoTokenizer.from_pretrained(setup.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(setup.model_dir).to(device)
    if tokenizer.pad_token is None:  # as the trainer set it (models._finish)
        tokenizer.pad_token = tokenizer.eos_token
    encoded = Encoded(setup.rows, tokenizer, setup.seq_len, setup.task.is_regression)
    return evaluate_classifier(model, encoded, setup.task, batch_size=setup.batch_size,
                               limit=setup.limit, device=device, keep_logits=True)  # fmt: skip
