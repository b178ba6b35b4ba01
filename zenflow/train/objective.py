"""What a run trains its model for: the objective's data and model, a micro-batch's loss, and
its evaluation.

The trainer picks one ``Objective`` at set-up (``objective_for(spec, world)``) and from then
on calls only its interface, so the step loop never asks which objective it runs. A third
objective is one more class here and an entry in ``OBJECTIVES``; the loop does not change.

- ``ClassificationObjective`` (``--objective classification``, the default): a GLUE task or
  a ``--data`` table, a sequence-classification head, the model's own loss (``out.loss``),
  the task's metrics (``zenflow.train.evaluate.evaluate_classifier``).
- ``CausalLMObjective`` (``--objective causal-lm``): text, prompt/completion or chat records
  tokenised with the model's tokenizer, the token mean of the next-token loss over the
  global micro-batch (``zenflow.train.data.lm_scoring``), packed rows' attention mask built
  on the device.

An objective holds what set-up gave it (the task, the tokenizer, the mask dtype) and nothing
of the run's progress: it must not touch the engine's state, the run directory, the metrics
file or the events; the trainer does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zenflow.errors import UserInputError
from zenflow.train.data import encode, truncation_line
from zenflow.train.data.lm_scoring import evaluate_lm, lm_loss, loss_tokens
from zenflow.train.data.packing import check_packing_support, packed_attention_mask
from zenflow.train.evaluate import evaluate_classifier
from zenflow.train.spec import load_data


@dataclass
class Loaded:
    """An objective's data and model as set-up reads them, before the model is placed."""

    resolved: Any  # models.ResolvedModel: the model (host, fp32), its tokenizer and sources
    task: Any  # data.GlueTask or data.LMTask: the name, the metrics (and num_labels)
    task_data: Any  # data.TaskData or data.LMData: the rows as read, and where from
    labels: Any = None  # the label set of a --data table (data.LabelSet), else None
    notes: list[str] = field(default_factory=list)  # what the run's header says of the data


class Objective(ABC):
    """The objective of a run, chosen once at set-up. Set-up calls ``load``, ``encode`` and
    ``placed`` in that order; every micro-batch ``batch_tokens`` then ``loss``; every
    evaluation ``evaluate``."""

    name: ClassVar[str]

    def __init__(self, world: int = 1):
        self.world = world  # data-parallel ranks (each computes its share of a step's loss)

    # -- set-up
    @abstractmethod
    def load(self, spec) -> Loaded:
        """Resolve the model and read the rows of ``spec`` (a ``RunSpec``)."""

    @abstractmethod
    def encode(self, loaded: Loaded, spec):
        """The rows the batcher takes (``.train``, ``.dev``); a note about them goes into
        ``loaded.notes``."""

    def placed(self, model, rows) -> None:  # noqa: B027 - a hook: most objectives need none
        """The model is on its device in its training dtype (``rows``: ``encode``'s)."""

    # -- one micro-batch
    @abstractmethod
    def batch_tokens(self, batch: dict) -> int | None:
        """What this micro-batch's loss is normalised by, counted over the global
        micro-batch (every rank's rows) before this rank takes its own; None: no count."""

    @abstractmethod
    def loss(self, forward: Callable, batch: dict, tokens: int | None, autocast: Callable):
        """This rank's micro-batch loss, a float32 scalar: ``forward`` (the training module)
        on ``batch`` (this rank's rows, on the device) under ``autocast``."""

    # -- evaluation
    @abstractmethod
    def evaluate(self, model, dev_rows, *, batch_size: int, limit: int | None, device,
                 autocast: Callable) -> dict:  # fmt: skip
        """The task's metrics of ``model`` on the first ``limit`` of ``dev_rows``, with
        ``eval_loss`` and ``eval_samples``."""


class ClassificationObjective(Objective):
    """A classification (or regression) head trained on a GLUE task or a ``--data`` table."""

    name = "classification"

    def load(self, spec) -> Loaded:
        from zenflow.train.models import resolve_model

        task_data = load_data(spec)  # a --data table, or a GLUE task (a preset of its reader)
        task, notes = task_data.task, task_data.header_lines()
        # a table's own class names go with the model; a GLUE task's are the task's
        labels = task_data.report.labels if spec.data_file is not None else None
        resolved = resolve_model(
            spec.model, task_num_labels=task.num_labels, init=spec.init, seed=spec.seed
        )
        if labels is not None and labels.kind == "classification":
            # the table's class names go with the model: config.json of the saved model
            resolved.model.config.id2label = dict(labels.id2label)
            resolved.model.config.label2id = dict(labels.label2id)
        self.task = task
        return Loaded(resolved, task, task_data, labels, notes)

    def encode(self, loaded: Loaded, spec):
        tokenizer = loaded.resolved.tokenizer
        loaded.notes.append(truncation_line(loaded.task_data, tokenizer, spec.seq_len,
                                            spec.seed))  # fmt: skip
        return encode(loaded.task_data, tokenizer, spec.seq_len)

    def batch_tokens(self, batch: dict) -> None:
        return None  # the model's loss is a mean over this rank's rows

    def loss(self, forward, batch, tokens, autocast):
        with autocast():
            out = forward(**batch)
        return out.loss.float()

    def evaluate(self, model, dev_rows, *, batch_size, limit, device, autocast) -> dict:
        metrics, _, _ = evaluate_classifier(
            model, dev_rows, self.task, batch_size=batch_size, limit=limit, device=device,
            autocast=autocast,
        )  # fmt: skip
        return metrics


class CausalLMObjective(Objective):
    """Next-token loss on records (``--objective causal-lm``), the token mean over the global
    micro-batch (``zenflow.train.data.lm_scoring.lm_loss``): the same loss on any number of
    ranks."""

    name = "causal-lm"

    def load(self, spec) -> Loaded:
        from zenflow.train.models import resolve_model

        if spec.data_file is None:
            raise UserInputError(
                "--objective causal-lm trains on records: pass --data FILE.jsonl (text, "
                "prompt/completion or chat messages records)."
            )
        # the records are tokenised with the model's tokenizer: model first
        resolved = resolve_model(spec.model, task_num_labels=0, init=spec.init,
                                 seed=spec.seed, head="causal-lm")  # fmt: skip
        task_data = load_data(spec, resolved.tokenizer)
        loaded = Loaded(resolved, task_data.task, task_data, notes=list(task_data.lines))
        if spec.pack:
            check_packing_support(resolved.model, spec.seq_len)
        self.task, self.tokenizer = loaded.task, resolved.tokenizer
        self.dev_pairs = task_data.dev_pairs
        return loaded

    def encode(self, loaded: Loaded, spec):
        # the LM rows as they are: tokenised when read; they say their truncation
        # themselves (data.LMData.lines)
        return loaded.task_data

    def placed(self, model, rows) -> None:
        # packed rows: segment ids cross to the device, the mask is built there
        self.mask_dtype = next(model.parameters()).dtype
        rows.train.segments_only = True
        rows.dev.mask_dtype = self.mask_dtype

    def batch_tokens(self, batch: dict) -> int:
        return loss_tokens(batch["labels"])  # every rank's rows: the token mean's denominator

    def loss(self, forward, batch, tokens, autocast):
        """This rank's share of the global micro-batch's token mean. Packed rows bring
        segment ids; their 4-D mask is built here, on the device, in the model's dtype."""
        labels = batch.pop("labels")
        segments = batch.pop("segment_ids", None)
        if segments is not None:
            batch["attention_mask"] = packed_attention_mask(segments, self.mask_dtype)
        with autocast():
            logits = forward(**batch).logits
        return lm_loss(logits, labels, tokens, self.world)

    def evaluate(self, model, dev_rows, *, batch_size, limit, device, autocast) -> dict:
        metrics, _ = evaluate_lm(
            model, dev_rows, self.task, batch_size=batch_size, limit=limit, device=device,
            tokenizer=self.tokenizer, pairs=self.dev_pairs, autocast=autocast,
        )  # fmt: skip
        return metrics


OBJECTIVES: dict[str, type[Objective]] = {
    ClassificationObjective.name: ClassificationObjective,
    CausalLMObjective.name: CausalLMObjective,
}


def objective_for(spec, world: int = 1) -> Objective:
    """The objective ``spec.objective`` names; any other value trains a classifier, as the
    trainer always has (the CLI admits only the names in ``OBJECTIVES``)."""
    return OBJECTIVES.get(spec.objective, ClassificationObjective)(world)
