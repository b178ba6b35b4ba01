"""`zfctl eval RUN_OR_MODEL`: a saved model's figures on a file, or a run's own.

Parse, call ``zenflow.train.evaluate`` (the loop the trainer evaluates with), render: a
table, or one JSON document with ``--json``; ``--predictions FILE`` writes one JSON line
per row: a classifier's texts, label, prediction and logits; a causal LM's per-row loss
and tokens, or, where the completions form a choice set, each record's prompt,
completion, choice and the choices' log-likelihoods.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zenflow import jsonout
from zfctl.errors import user_error


def eval_(
    target: Annotated[
        Path,
        typer.Argument(
            help="A run directory (its model/; default rows: the run's own evaluation set, "
            "as at its final evaluation) or a Hugging Face model folder.",
            metavar="RUN_OR_MODEL",
        ),
    ],
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Table to evaluate on (.jsonl, .json, .csv, .tsv, .parquet); for a causal "
            "LM, records (.jsonl, .json: text, prompt/completion or messages).",
        ),
    ] = None,
    task: Annotated[
        str | None, typer.Option("--task", help="Evaluate on a GLUE task's dev rows instead.")
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="GLUE folder for --task (default: the run's, else GLUE_DIR)."),
    ] = None,
    text_field: Annotated[
        list[str] | None,
        typer.Option("--text-field", help="Text column(s) of --data (default: the run's, text)."),
    ] = None,
    label_field: Annotated[
        str | None,
        typer.Option("--label-field", help="Label column of --data (default: the run's, label)."),
    ] = None,
    tsv_quoting: Annotated[
        str | None, typer.Option(help='A .tsv --data file: "csv" (default) or "none".')
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option(min=1, help="Tokens per row (default: the run's, else 128).")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="Rows per batch (default: the run's eval batch).")
    ] = None,
    max_samples: Annotated[
        int | None, typer.Option(min=1, help="Evaluate the first N rows only.")
    ] = None,
    predictions: Annotated[
        Path | None,
        typer.Option("--predictions", help="Write one JSON line per row to this file."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Overwrite an existing --predictions file (never one this command reads, "
            "nor a run's own files).",
        ),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON document instead of a table.")
    ] = False,
) -> None:
    """Evaluate a fine-tuned model: a classifier's accuracy, F1 and MCC (or Pearson/Spearman
    for a regression) and eval loss; a causal LM's eval loss and perplexity per predicted
    token (and choice accuracy when the completions come from a small set)."""
    from zenflow.train.eval_inputs import check_predictions
    from zenflow.train.evaluate import run_eval, setup_eval

    if tsv_quoting is not None and tsv_quoting not in ("csv", "none"):
        raise user_error(f"--tsv-quoting {tsv_quoting!r} is not allowed; choose csv or none.")
    if data is not None and task is not None:
        raise user_error("--data and --task both name rows to evaluate; pass one of them.")
    if text_field is not None and not 1 <= len(text_field) <= 2:
        raise user_error(f"--text-field was given {len(text_field)} times; give one or two.")
    if predictions is not None:  # before the slow work; again once every input is known
        check_predictions(predictions, [data] if data else [], target, force)
    if task is not None and data_dir is None and os.environ.get("GLUE_DIR"):
        data_dir = Path(os.environ["GLUE_DIR"])
    setup = setup_eval(
        target, data_file=None if data is None else str(data), task=task,
        data_dir=None if data_dir is None else str(data_dir),
        text_fields=tuple(text_field) if text_field else None, label_field=label_field,
        tsv_quoting=tsv_quoting, seq_len=seq_len, batch_size=batch_size, max_samples=max_samples,
    )  # fmt: skip
    if predictions is not None:
        check_predictions(predictions, setup.inputs, setup.model_dir, force)
    from zfctl.progress import quiet_hugging_face

    quiet_hugging_face(errors_only=json_output)
    metrics, preds, logits = run_eval(setup)
    if predictions is not None:
        _write_predictions(predictions, setup, preds, logits)
    doc = {
        "model_dir": str(setup.model_dir),
        "run_dir": None if setup.run_dir is None else str(setup.run_dir),
        "task": setup.task.name,
        "objective": setup.objective,
        "source": setup.source,
        "seq_len": setup.seq_len,
        "batch_size": setup.batch_size,
        "metrics": metrics,
        "predictions": None if predictions is None else str(predictions),
        "notes": list(setup.notes),
    }
    if json_output:
        typer.echo(jsonout.dumps(doc, indent=2))
        return
    _print_table(doc)


def _print_table(doc: dict) -> None:
    """The evaluation as a table, with its rows' source, notes and predictions file."""
    console = Console(highlight=False, emoji=False)
    t = Table(title=f"eval of {escape(doc['model_dir'])}", title_justify="left")
    t.add_column("", style="bold")
    t.add_column("", justify="right")
    for key, value in doc["metrics"].items():
        shown = f"{value:.4f}" if isinstance(value, float) else "-" if value is None else value
        t.add_row(key, str(shown))
    console.print(f"rows: {escape(doc['source'])}")
    for note in doc["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}")
    console.print(t)
    if doc["predictions"] is not None:
        console.print(f"predictions: {escape(doc['predictions'])}")


def _write_predictions(path: Path, setup, preds: list, logits: list) -> None:
    from zenflow.outputs import write_file

    if setup.objective == "causal-lm":  # run_eval's per-record dicts, as they are

        def lm_lines(f):
            for i, rec in enumerate(preds):
                f.write(jsonout.dumps({"index": i, **rec}) + "\n")

        write_file(path, lm_lines, what="--predictions: cannot write")
        return
    names = setup.task.label_names

    def lines(f):
        for i, (row, pred, lg) in enumerate(zip(setup.rows, preds, logits, strict=False)):
            rec = {"index": i, "texts": list(row.texts), "label": row.label, "prediction": pred,
                   "logits": lg}  # fmt: skip
            if names:
                rec["label_name"], rec["prediction_name"] = names[row.label], names[pred]
            f.write(jsonout.dumps(rec) + "\n")

    write_file(path, lines, what="--predictions: cannot write")
