"""zenflow.train.data.source: every source implements one interface (``DataSource.load`` ->
``SourceData``) and gives what its own loader gives; a new source is one class."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from zenflow.train.data import (
    OBJECTIVES,
    DataSource,
    Example,
    GlueSource,
    RecordSource,
    TableSource,
    TaskData,
    batches,
    encode,
    get_task,
    load_lm_data,
    load_table_task,
    load_task,
)
from zenflow.train.models import packaged_gpt2_tokenizer


@pytest.fixture(scope="module")
def tok():
    t = packaged_gpt2_tokenizer()
    t.pad_token = t.eos_token
    return t


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _assert_source_data(data) -> None:
    """The shape the run and ``zfctl eval`` read (``source.SourceData``)."""
    assert data.task.name and data.task.metrics and isinstance(data.task.num_labels, int)
    assert isinstance(data.task.is_regression, bool)
    assert len(data.train) > 0 and len(data.dev) > 0
    assert isinstance(data.source, str) and data.source
    assert data.header_lines() and all(isinstance(s, str) for s in data.header_lines())


def test_each_source_is_a_data_source_of_one_objective():
    for cls in (GlueSource, TableSource, RecordSource):
        assert issubclass(cls, DataSource) and cls.objective in OBJECTIVES
    with pytest.raises(TypeError):
        DataSource()  # the interface alone loads nothing


def test_glue_source_gives_what_load_task_gives(sample_dir):
    data = GlueSource(task="sst2", data_dir=sample_dir).load()
    want = load_task("sst2", sample_dir)
    assert (data.task, data.train, data.dev, data.source) == (
        want.task, want.train, want.dev, want.source,
    )  # fmt: skip
    assert data.header_lines() == want.report.lines()
    _assert_source_data(data)


def test_table_source_gives_what_load_table_task_gives(tmp_path):
    rows = [{"review": f"review number {i}", "stars": "good" if i % 3 else "bad"}
            for i in range(30)]  # fmt: skip
    path = _jsonl(tmp_path / "reviews.jsonl", rows)
    source = TableSource(train_path=path, text_fields=("review",), label_field="stars", seed=3)
    data = source.load()
    want, report = load_table_task(path, text_fields=("review",), label_field="stars", seed=3)
    assert (data.task, data.train, data.dev, data.source) == (
        want.task, want.train, want.dev, want.source,
    )  # fmt: skip
    assert data.header_lines() == report.lines()
    _assert_source_data(data)


def test_record_source_tokenises_with_the_models_tokenizer(tmp_path, tok):
    records = [{"prompt": f"Item {i}:", "completion": " yes" if i % 2 else " no"}
               for i in range(40)]  # fmt: skip
    path = _jsonl(tmp_path / "qa.jsonl", records)
    source = RecordSource(data_file=path, seq_len=16, seed=5)
    with pytest.raises(ValueError, match="pass the model's tokenizer"):
        source.load()
    data = source.load(tok)
    want = load_lm_data(path, None, tok, 16, seed=5)
    assert data.task == want.task and data.dev_pairs == want.dev_pairs
    assert torch.equal(data.train.input_ids, want.train.input_ids)
    assert data.header_lines() == want.lines
    _assert_source_data(data)


def test_a_new_source_is_one_class_the_run_can_batch(tok):
    """What a source adds is its ``load``; encoding and batching are the shared pieces."""

    @dataclass(frozen=True, kw_only=True)
    class InMemorySource(DataSource):
        texts: tuple[str, ...]
        objective: ClassVar[str] = "classification"

        def load(self, tokenizer=None) -> TaskData:
            rows = [Example((t,), i % 2) for i, t in enumerate(self.texts)]
            return TaskData(get_task("sst2"), rows, rows[:2], "in memory")

    data = InMemorySource(texts=tuple(f"text {i}" for i in range(8))).load()
    assert data.header_lines() == []  # no reader, no counts
    encoded = encode(data, tok, seq_len=6)
    (_, batch), *_ = batches(encoded.train, 4, seed=0, epoch=0)
    assert batch["input_ids"].shape == (4, 6) and batch["labels"].dtype == torch.long


def test_the_run_and_zfctl_eval_take_their_rows_from_the_specs_source(tmp_path, sample_dir):
    """``spec.data_source``: records for a causal LM, a ``--data`` table, else a GLUE task;
    ``spec.load_data`` is its ``load`` (the objective, the CLI's preflight and ``zfctl
    eval`` call nothing else). The objectives the trainer knows are the sources' ones."""
    from zenflow.train import objective
    from zenflow.train.spec import RunSpec, data_source, load_data

    table = _jsonl(tmp_path / "t.jsonl", [{"text": f"row {i}", "label": i % 2} for i in range(20)])
    glue = RunSpec(model="m", task="sst2", config=None, data_dir=str(sample_dir))
    tab = RunSpec(model="m", task=None, config=None, data_file=str(table), seed=7)
    lm = RunSpec(model="m", task=None, config=None, data_file=str(table), seq_len=16,
                 objective="causal-lm")  # fmt: skip
    assert isinstance(data_source(glue), GlueSource)
    assert data_source(tab) == TableSource(train_path=str(table), seed=7)
    assert isinstance(data_source(lm), RecordSource) and data_source(lm).seq_len == 16
    assert load_data(glue).train == load_task("sst2", sample_dir).train
    assert load_data(tab).train == load_table_task(table, text_fields=("text",), seed=7)[0].train
    assert set(objective.OBJECTIVES) == set(OBJECTIVES)
