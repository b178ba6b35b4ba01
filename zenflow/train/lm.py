"""Causal-LM fine-tuning (``objective="causal-lm"``): the task, its data, its loss and its
evaluation, on top of ``zenflow.train.sft`` (records -> rows with loss masks).

Contract:

- ``load_lm_data`` reads the ``--data`` record file (and ``--eval-data``, else a seeded
  10% of the records, ``tables.seeded_split``), tokenises both with the model's tokenizer
  and returns ``LMData``: ``train``/``dev`` (``sft.SFTData`` rows the trainer's batcher
  takes), the ``LMTask`` and header lines stating what was read, kept, dropped and
  truncated, and where the loss is.
- The loss of one rank's micro-batch is ``lm_loss``: the summed next-token cross-entropy of
  its rows divided by the loss tokens of the whole global micro-batch (every rank's rows),
  times the world size. The engines average gradients over ranks, so a step's gradient is
  that of the global micro-batch's token mean whatever the number of ranks: 2 ranks train
  what one process trains. With gradient accumulation each micro-batch is a token mean and
  the step takes the mean of those.
- ``evaluate_lm``: ``eval_loss`` (mean next-token loss per predicted token over the eval
  rows), ``perplexity`` (its exp), ``eval_tokens`` and ``eval_samples``. When the eval
  records are prompt/completion records whose completions come from a small set
  (``choice_set``: 2..16 distinct completions and at least 4 times as many records, so
  a classification dataset written as completions), it also reports
  ``choice_accuracy``: the share of records whose own completion is the likeliest of the
  set given the prompt (``sft.score_completions``, summed log-likelihood, no end token).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zenflow.errors import DataError
from zenflow.train.hub_data import shown_name
from zenflow.train.sft import (
    IGNORE,
    PROMPT_COMPLETION,
    TEXT,
    RecordFields,
    Records,
    SFTData,
    build_sft,
    read_records,
    score_completions,
    token_loss_sum,
)

OBJECTIVES = ("classification", "causal-lm")
EVAL_FRACTION = 0.1
MAX_CHOICES = 16


@dataclass(frozen=True)
class LMTask:
    """What the trainer, the header and the report need of a task, for a causal LM."""

    name: str
    metrics: tuple[str, ...]  # the first is the headline (shown on the dashboard)
    choices: tuple[str, ...] | None = None  # the completion set choice_accuracy scores
    kind: str = TEXT  # the records' kind (sft.TEXT / PROMPT_COMPLETION / CHAT)
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
    from zenflow.train.tables import seeded_split

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
    ``sft.SFTReport``."""
    rows, report = build_sft(records, tokenizer, seq_len, pack=False)
    pairs = eval_pairs(records)
    choices = choice_set([c for _, c in pairs]) if pairs else None
    metrics = ("choice_accuracy", "perplexity") if choices else ("perplexity",)
    task = LMTask(name=name, metrics=metrics, choices=choices, kind=records.kind)
    return rows, pairs, task, report


def lm_loss(logits, labels, global_tokens: int, world: int = 1):
    """This rank's share of the global micro-batch's token-mean next-token loss: the summed
    cross-entropy of its rows x world / ``global_tokens`` (see the module docstring)."""
    import torch.nn.functional as F

    # Every position, -100 ignored: no data-dependent indexing, which would make a CUDA
    # step wait for the device (nonzero() syncs) in the middle of the micro-batch.
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    total = F.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum")
    return total * (world / max(int(global_tokens), 1))


def loss_tokens(labels) -> int:
    """The predicted tokens of a batch (labels after the shift that are not -100)."""
    return int((labels[:, 1:] != IGNORE).sum())


def evaluate_lm(
    model,
    data: SFTData,
    task: LMTask,
    *,
    batch_size: int,
    limit: int | None = None,
    device=None,
    tokenizer=None,
    pairs: Sequence[tuple[str, str]] = (),
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    keep_scores: bool = False,
) -> tuple[dict, list]:
    """Metrics of ``model`` on the first ``limit`` rows of ``data`` (all when None), in
    eval mode (restored after): ``(metrics, per_record)``. With ``keep_scores``,
    ``per_record`` holds each eval row's loss and tokens or, when the task has choices, each
    scored record's prompt, completion, choice and every choice's log-likelihood.
    ``choice_accuracy`` scores the first ``limit`` eval records (``pairs``)."""
    import torch

    from zenflow.train.sft import lm_eval_metrics

    n = len(data) if limit is None else min(limit, len(data))
    was_training = model.training
    model.eval()
    total, tokens, per = 0.0, 0, []
    mask_dtype = next(model.parameters()).dtype
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                rows = range(start, min(start + batch_size, n))
                batch = data.take(rows, mask_dtype)
                labels = batch.pop("labels")
                if device is not None:
                    batch = {k: v.to(device) for k, v in batch.items()}
                with autocast():
                    logits = model(**batch).logits
                if keep_scores:
                    for r in range(logits.shape[0]):
                        one = labels[r : r + 1].to(logits.device)
                        s, t = token_loss_sum(logits[r : r + 1], one)
                        per.append({"row": start + r, "loss": s / max(t, 1), "tokens": t})
                s, t = token_loss_sum(logits, labels.to(logits.device))
                total += s
                tokens += t
        metrics = lm_eval_metrics(total, tokens)
        metrics["eval_tokens"] = tokens
        metrics["eval_samples"] = n
        if task.choices:
            if tokenizer is None:
                raise ValueError("choice_accuracy needs the tokenizer")
            scored = list(pairs)[: len(pairs) if limit is None else limit]
            chosen = _choose(model, tokenizer, scored, task.choices, batch_size, autocast)
            right = [ch == c for (ch, _), (_, c) in zip(chosen, scored, strict=True)]
            metrics["choice_accuracy"] = sum(right) / len(right)
            if keep_scores:  # one line per scored record instead
                per = [
                    {"prompt": p, "completion": c, "choice": ch, "scores": scores}
                    for (p, c), (ch, scores) in zip(scored, chosen, strict=True)
                ]
    finally:
        model.train(was_training)
    return metrics, per


def _choose(model, tokenizer, pairs, choices, batch_size, autocast):
    """Per (prompt, completion): the likeliest choice and every choice's log-likelihood."""
    prompts = [p for p, _ in pairs for _ in choices]
    options = [c for _ in pairs for c in choices]
    with autocast():
        scores = score_completions(model, tokenizer, prompts, options, batch_size=batch_size)
    out = []
    for i in range(len(pairs)):
        mine = scores[i * len(choices) : (i + 1) * len(choices)]
        best = max(range(len(choices)), key=lambda j: mine[j])
        out.append((choices[best], dict(zip(choices, mine, strict=True))))
    return out
