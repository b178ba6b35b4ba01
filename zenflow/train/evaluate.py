"""Evaluating a classifier on an encoded split: the loop the trainer runs at every
evaluation and ``zfctl eval`` runs on a saved model, so both give the same figures.

``evaluate_classifier`` returns the task's metrics (``compute_metrics``), the mean eval loss
and, per example, the prediction (class id, or the value for a regression) and the logits.
``eval_batch_size`` is the trainer's evaluation batch (twice the micro-batch): ``zfctl eval``
of a run uses the run's, so the batches (and the floating-point sums) are the same.

``setup_eval`` / ``run_eval`` are ``zfctl eval``'s: the rows (a run's own, only from the data
files it trained on: ``eval_inputs.check_run_data``), the files read (``EvalSetup.inputs``,
which ``--predictions`` never writes over) and the model folder loaded exactly as saved
(``models.load_saved``: no layer made new, the tokenizer by finetune's rule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
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
    # A causal LM (objective "causal-lm"): the records to score, tokenised by run_eval with
    # the model's tokenizer: (data_file, eval_file, split) where split means "the run's
    # seeded split of data_file", plus the record fields and the run's seed.
    lm_files: tuple | None = None
    lm_fields: object = None  # sft.RecordFields
    seed: int = 42
    seq_len_default: bool = False  # no --seq-len and no run: 128, or the model's positions
    inputs: tuple = ()  # the data files this evaluation reads (--predictions never goes there)
    notes: list = field(default_factory=list)  # what the user should know (a stand-in tokenizer)

    @property
    def objective(self) -> str:
        return "classification" if self.lm_files is None else "causal-lm"


def setup_eval(*args, seq_len: int | None = None, **kwargs) -> EvalSetup:
    """``_setup_eval``, noting whether the sequence length was chosen (given, or the run's)
    or is the default, which ``run_eval`` shortens to a model with fewer positions."""
    setup = _setup_eval(*args, seq_len=seq_len, **kwargs)
    setup.seq_len_default = seq_len is None and setup.run_dir is None
    if not setup.inputs:
        setup.inputs = _inputs(setup, kwargs)
    return setup


def _inputs(setup: EvalSetup, kwargs: dict) -> tuple[str, ...]:
    """The data files ``setup`` reads: the table or records given, the run's files (its own
    rows), or a GLUE task's files."""
    from zenflow.train.data import task_files

    if kwargs.get("data_file") is not None:
        return (str(kwargs["data_file"]),)
    if setup.lm_files is not None:
        return tuple(str(f) for f in setup.lm_files[:2] if f is not None)
    rec = runs_record(setup.run_dir) if setup.run_dir is not None else {}
    if kwargs.get("task") is None and rec.get("data_file"):
        return tuple(str(rec[k]) for k in ("data_file", "eval_file") if rec.get(k))
    task = kwargs.get("task") or rec.get("task")
    data_dir = kwargs.get("data_dir")
    data_dir = rec.get("data_dir") if data_dir is None else data_dir
    return tuple(str(f) for f in task_files(task, data_dir)) if task else ()


def runs_record(run_dir: Path) -> dict:
    """The spec record of the run in ``run_dir`` (config.json's "run")."""
    from zenflow.train import runs

    return (runs.run_config(run_dir) or {}).get("run") or {}


def _setup_eval(
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
    from zenflow.train.data import GlueSource, get_task
    from zenflow.train.eval_inputs import check_run_data, unfinished_run_error

    target = Path(target)
    rec: dict = {}
    run_dir = None
    if runs.holds_run(target):
        run_dir, rec = target, (runs.run_config(target) or {}).get("run") or {}
        model_dir = target / runs.MODEL_DIR
        if not (model_dir / "config.json").is_file():
            raise unfinished_run_error(target, rec)
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
    if own and rec.get("data_file"):  # the run's own rows: only from the files it trained on
        check_run_data(run_dir)
    if rec.get("objective") == "causal-lm" or (run_dir is None and _is_causal_lm(model_dir)):
        return _lm_setup(model_dir, run_dir, rec, own, data_file, text_fields, seq_len,
                         batch_size, limit, task, label_field)  # fmt: skip
    if own and rec.get("data_file"):  # the run's own table rows, as it split them
        from zenflow.train.spec import RunSpec, load_data

        keep = ("data_file", "eval_file", "text_fields", "label_field", "tsv_quoting", "seed")
        spec = RunSpec(model=rec.get("model"), task=rec.get("task"), config=None,
                       **{k: tuple(v) if isinstance(v, list) else v
                          for k, v in rec.items() if k in keep})  # fmt: skip
        data = load_data(spec)
        return EvalSetup(model_dir, data.task, data.dev, seq_len, batch_size, limit,
                         data.source, run_dir, data.report.labels)  # fmt: skip
    if own or task is not None:  # a GLUE task: the run's, or the one named
        t = get_task(task or rec.get("task"))
        data = GlueSource(task=t, data_dir=data_dir if data_dir is not None
                          else rec.get("data_dir")).load()  # fmt: skip
        return EvalSetup(model_dir, t, data.dev, seq_len, batch_size, limit, data.source,
                         run_dir)  # fmt: skip
    return _table_setup(model_dir, run_dir, rec, saved_labels, data_file, text_fields,
                        label_field, tsv_quoting, seq_len, batch_size, limit)  # fmt: skip


def _model_config(model_dir: Path) -> dict:
    """The model folder's config.json; ModelSourceError naming it when it is not JSON."""
    import json

    from zenflow.errors import ModelSourceError

    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(
            f"{path} is not a JSON model config ({exc}): it is truncated or damaged. Save the "
            "model into the folder again (model.save_pretrained)."
        ) from None
    if not isinstance(cfg, dict):
        raise ModelSourceError(f"{path} holds no JSON object; it is not a model config.")
    return cfg


def _is_causal_lm(model_dir: Path) -> bool:
    """A model folder whose config names a causal-LM class (``*ForCausalLM``, GPT-2's
    ``*LMHeadModel``)."""
    cfg = _model_config(model_dir)
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in cfg.get("architectures") or ())


def _lm_setup(model_dir, run_dir, rec, own, data_file, text_fields, seq_len, batch_size, limit,
              task, label_field) -> EvalSetup:  # fmt: skip
    """A causal LM: the run's own eval records (its --eval-data or its seeded split), or
    every record of ``data_file``."""
    from zenflow.errors import UserInputError
    from zenflow.train.spec import RunSpec, record_fields

    if task is not None or label_field is not None:
        what = "--task" if task is not None else "--label-field"
        raise UserInputError(
            f"{model_dir} is a causal LM: {what} describes classification rows. Pass --data "
            "FILE.jsonl with text, prompt/completion or messages records."
        )
    fields = {k: rec.get(k) for k in ("prompt_field", "completion_field", "messages_field")}
    texts = tuple(text_fields or rec.get("text_fields") or ()) or None
    spec = RunSpec(model=str(model_dir), task="", config=None, text_fields=texts, **fields)
    if own:
        files = (rec["data_file"], rec.get("eval_file"), rec.get("eval_file") is None)
        source = f"the run's eval records ({'a seeded split of ' if files[2] else ''}" + (
            f"{files[1] or files[0]})"
        )  # fmt: skip
    else:
        files = (data_file, None, False)
        source = f"records: {data_file}"
    return EvalSetup(model_dir, None, [], seq_len, batch_size, limit, source, run_dir,
                     lm_files=files, lm_fields=record_fields(spec),
                     seed=rec.get("seed", 42))  # fmt: skip


def _table_setup(model_dir, run_dir, rec, saved_labels, data_file, text_fields, label_field,
                 tsv_quoting, seq_len, batch_size, limit) -> EvalSetup:  # fmt: skip
    """Every row of a table, its labels mapped to the MODEL's class ids (its run's label
    set, else the model's config.id2label), never re-inferred from the file."""

    from zenflow.errors import DataError
    from zenflow.train.data import Example, LabelSet, infer_labels, metrics_for, read_rows

    fields = tuple(text_fields or rec.get("text_fields") or ("text",))
    label = label_field or rec.get("label_field") or "label"
    table = read_rows(data_file, fields, label,
                      tsv_quoting=tsv_quoting or rec.get("tsv_quoting") or "csv")  # fmt: skip
    found = infer_labels(r.label for r in table.rows)
    if saved_labels is not None:
        labels = LabelSet.from_json(saved_labels)
    else:
        labels = _labels_of_config(_model_config(model_dir), found)
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
    from zenflow.train.data import LabelSet

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
    logits)`` (``evaluate_classifier``); a causal LM: ``(metrics, per_record, [])``
    (``lm.evaluate_lm``)."""
    from zenflow.train.data import Encoded
    from zenflow.train.models import load_saved

    # the model exactly as saved (no new layer), the tokenizer by finetune's rule
    model, tokenizer, notes = load_saved(setup.model_dir, causal_lm=setup.lm_files is not None)
    setup.notes += notes
    model = model.to(device)
    _fit_positions(setup, model)
    if setup.lm_files is not None:
        return _run_lm_eval(setup, model, tokenizer, device)
    encoded = Encoded(setup.rows, tokenizer, setup.seq_len, setup.task.is_regression)
    return evaluate_classifier(model, encoded, setup.task, batch_size=setup.batch_size,
                               limit=setup.limit, device=device, keep_logits=True)  # fmt: skip


def _run_lm_eval(setup: EvalSetup, model, tokenizer, device: str) -> tuple[dict, list, list]:
    """A causal LM's eval: the records as the run tokenised them (never packed)."""
    from zenflow.train.data import RecordSource, eval_rows, evaluate_lm, read_records

    data_file, eval_file, split = setup.lm_files
    if split or eval_file is not None:  # the run's own eval records
        lm = RecordSource(data_file=data_file, eval_file=eval_file, seq_len=setup.seq_len,
                          fields=setup.lm_fields, seed=setup.seed).load(tokenizer)  # fmt: skip
        rows, pairs, task = lm.dev, lm.dev_pairs, lm.task
    else:
        records = read_records(data_file, setup.lm_fields)
        rows, pairs, task, report = eval_rows(records, tokenizer, setup.seq_len,
                                              records.path.stem)  # fmt: skip
        setup.source += f" ({report.counts.line()})"
    setup.task = task
    metrics, per = evaluate_lm(model, rows, task, batch_size=setup.batch_size,
                               limit=setup.limit, device=device, tokenizer=tokenizer,
                               pairs=pairs, keep_scores=True)  # fmt: skip
    return metrics, per, []


def _fit_positions(setup: EvalSetup, model) -> None:
    """The default sequence length shortened to the model's positions; a chosen one longer
    than them is refused (an IndexError deep in the model otherwise)."""
    from zenflow.errors import UserInputError
    from zenflow.train.models import max_positions

    limit = max_positions(model)
    if limit is None or setup.seq_len <= limit:
        return
    if setup.seq_len_default:
        setup.seq_len = limit
        setup.source += f"; rows of {limit} tokens, the model's positions"
        return
    raise UserInputError(
        f"--seq-len {setup.seq_len} is longer than the {limit} positions of the model in "
        f"{setup.model_dir}; pass --seq-len {limit} or less."
    )
