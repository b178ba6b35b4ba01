"""`zfctl finetune MODEL --data FILE`: the user's own table instead of a GLUE task."""

from __future__ import annotations

import csv
import json
import re

import pytest
from clihelp import assert_user_error
from transformers import AutoTokenizer

from zenflow.train import models, runs

NAMES = ("negative", "positive")


def _sst2_rows(path, limit=None):
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    return rows[:limit] if limit else rows


def _write_jsonl(path, rows):
    """SST-2 rows with renamed columns and string labels."""
    with open(path, "w", encoding="utf-8") as f:
        for sentence, label in rows:
            f.write(json.dumps({"review": sentence, "sentiment": NAMES[int(label)]}) + "\n")
    return path


def _evals(run_dir):
    return [{k: e[k] for k in ("step", "accuracy", "eval_loss")}
            for e in runs.read_run(run_dir)["evals"]]  # fmt: skip


def test_a_jsonl_with_string_labels_learns_as_the_glue_preset(cli, tmp_path, glue_dir,
                                                               monkeypatch):  # fmt: skip
    """Issue 16's acceptance test: the same SST-2 rows as a JSONL file with other column
    names and string labels fine-tune MiniLM exactly as `--task sst2` does (same seed,
    steps and order: the sorted class names give GLUE's ids, so the runs are identical)."""
    monkeypatch.setenv(models.MODEL_DIR_ENV, str(tmp_path / "models"))
    train = _write_jsonl(tmp_path / "train.jsonl", _sst2_rows(glue_dir / "sst2" / "train.tsv"))
    dev = _write_jsonl(tmp_path / "dev.jsonl", _sst2_rows(glue_dir / "sst2" / "dev.tsv"))
    common = ("--max-steps", "12", "--micro-batch", "8", "--seq-len", "32", "--lr", "5e-5",
              "--eval-every", "6", "--max-eval-samples", "200", "--engine", "device")  # fmt: skip
    glue = cli("finetune", "minilm", "--task", "sst2", "--data-dir", glue_dir,
               "--run-dir", tmp_path / "glue", *common)  # fmt: skip
    assert glue.exit_code == 0, glue.output
    # the preset is read by the same table reader, and its header counts the rows alike
    assert "train.tsv: 67349 rows read, 67349 kept, none dropped" in glue.stdout
    assert "dev.tsv: 872 rows read, 872 kept, none dropped" in glue.stdout
    mine = cli("finetune", "minilm", "--data", train, "--eval-data", dev, "--text-field",
               "review", "--label-field", "sentiment", "--run-dir", tmp_path / "mine",
               *common)  # fmt: skip
    assert mine.exit_code == 0, mine.output
    assert "train.jsonl: 67349 rows read, 67349 kept, none dropped" in mine.stdout
    assert "labels: 2 classes (0 = negative, 1 = positive)" in mine.stdout
    assert _evals(tmp_path / "mine") == _evals(tmp_path / "glue")
    assert [e["step"] for e in _evals(tmp_path / "mine")] == [6, 12]
    cfg = runs.run_config(tmp_path / "mine")
    assert cfg["labels"]["names"] == list(NAMES) and cfg["run"]["task"] == "train"
    saved = json.loads((tmp_path / "mine" / runs.MODEL_DIR / "config.json").read_text())
    assert saved["id2label"] == {"0": "negative", "1": "positive"}


@pytest.fixture
def table(tmp_path, glue_dir):
    return _write_jsonl(tmp_path / "t.jsonl", _sst2_rows(glue_dir / "sst2" / "train.tsv", 120))


TINY = ("--text-field", "review", "--label-field", "sentiment", "--micro-batch", "4",
        "--seq-len", "16", "--max-eval-samples", "8")  # fmt: skip


def test_resume_is_exact_and_refuses_a_changed_file(cli, tmp_path, tiny_gpt2_dir, table):
    straight = cli("finetune", tiny_gpt2_dir, "--data", table, *TINY, "--max-steps", "6",
                   "--eval-every", "3", "--run-dir", tmp_path / "straight")  # fmt: skip
    assert straight.exit_code == 0, straight.output
    # the header counts the rows --seq-len cuts: reference, each row encoded with and
    # without truncation by the run's tokenizer
    tok = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    texts = [json.loads(line)["review"] for line in table.read_text().splitlines()]
    cut = sum(tok(t, truncation=True, max_length=16)["input_ids"] != tok(t)["input_ids"]
              for t in texts)  # fmt: skip
    found = re.search(r"truncated to --seq-len 16 tokens \(the end cut off\): train (\d+) of "
                      r"108 \([\d.]+%\), eval (\d+) of 12 ", straight.stdout)  # fmt: skip
    assert found, straight.stdout
    assert int(found[1]) + int(found[2]) == cut > 0
    first = cli("finetune", tiny_gpt2_dir, "--data", table, *TINY, "--max-steps", "3",
                "--eval-every", "3", "--run-dir", tmp_path / "split")  # fmt: skip
    assert first.exit_code == 0, first.output
    resumed = cli("finetune", tiny_gpt2_dir, "--resume", tmp_path / "split", "--max-steps", "6")
    assert resumed.exit_code == 0, resumed.output
    # the final evaluation (step 3's of the first half followed its final flush: not compared)
    assert _evals(tmp_path / "split")[-1] == _evals(tmp_path / "straight")[-1]
    assert _evals(tmp_path / "split")[-1]["step"] == 6
    losses = [[m["loss"] for m in runs.read_run(tmp_path / d)["metrics"]]
              for d in ("split", "straight")]  # fmt: skip
    assert losses[0] == losses[1] and len(losses[0]) == 6
    with open(table, "a", encoding="utf-8") as f:
        f.write(json.dumps({"review": "one more row", "sentiment": "positive"}) + "\n")
    r = cli("finetune", tiny_gpt2_dir, "--resume", tmp_path / "split", "--max-steps", "9")
    assert_user_error(r, f"{table} changed since the run", "sha256", "Restore the file")


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--text-field", "sentence"], ["no field 'sentence'", "--text-field",
                                        "'review', 'sentiment'"]),
        (["--text-field", "review"], ["no field 'label'", "--label-field"]),
        (["--text-field", "a", "--text-field", "b", "--text-field", "c"],
         ["--text-field was given 3 times"]),
        (["--tsv-quoting", "maybe", "--text-field", "review", "--label-field", "sentiment"],
         ["--tsv-quoting 'maybe'"]),
        (["--sample-data"], ["--sample-data", "--data"]),
    ],
)  # fmt: skip
def test_bad_data_flags_exit_2_before_a_run_exists(cli, tmp_path, tiny_gpt2_dir, table, args,
                                                   fragments):  # fmt: skip
    r = cli("finetune", tiny_gpt2_dir, "--data", table, "--runs-root", tmp_path / "runs", *args)
    assert_user_error(r, *fragments)
    assert not (tmp_path / "runs").exists()


def test_table_flags_need_data_and_a_task_or_data_is_needed(cli, tmp_path, tiny_gpt2_dir):
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--text-field", "x")
    assert_user_error(r, "--text-field", "pass --data FILE")
    assert_user_error(cli("finetune", tiny_gpt2_dir), "--task GLUE_TASK", "--data FILE")


def test_mixed_label_kinds_and_an_empty_file(cli, tmp_path, tiny_gpt2_dir):
    mixed = tmp_path / "m.jsonl"
    mixed.write_text('{"text": "good", "label": "pos"}\n{"text": "bad", "label": 0}\n')
    assert_user_error(cli("finetune", tiny_gpt2_dir, "--data", mixed), "mixes label kinds",
                      "line 1", "line 2")  # fmt: skip
    empty = tmp_path / "e.csv"
    empty.write_text("")
    assert_user_error(cli("finetune", tiny_gpt2_dir, "--data", empty), "is empty")


def test_the_table_is_read_once_per_process_until_it_changes(table, monkeypatch):
    """The CLI's preflight and the trainer both need the table: one read, not two; a file
    that changed (size or mtime) is read again."""
    import os

    from zenflow.train import spec as spec_mod
    from zenflow.train.data import tables

    calls = []
    real = tables.load_table_task
    monkeypatch.setattr(tables, "load_table_task", lambda *a, **k: calls.append(a) or real(*a, **k))
    tables._load_once.cache_clear()
    spec = spec_mod.RunSpec(model="m", task="t", config=None, data_file=str(table),
                            text_fields=("review",), label_field="sentiment")  # fmt: skip
    first = spec_mod.load_data(spec)
    assert spec_mod.load_data(spec) is first and len(calls) == 1
    with open(table, "a", encoding="utf-8") as f:
        f.write(json.dumps({"review": "one more", "sentiment": "positive"}) + "\n")
    os.utime(table, ns=(1, 1))
    again = spec_mod.load_data(spec)
    assert len(calls) == 2 and len(again.train) + len(again.dev) == 121


# ----------------------------------------------------------- a hub dataset as --data


@pytest.fixture
def fake_hub(monkeypatch):
    """``datasets.load_dataset`` answering for one dataset, "someorg/reviews", as the hub or
    its cache would: the calls are recorded; any other name fails as an offline miss does.
    (What is tested is zfctl's side: the id's parsing, the rows as records, the resume
    fingerprint; loading from the real hub is the datasets library's job.)"""
    import datasets

    from zenflow.train.data import hub

    rows = [("a joy to watch", "pos"), ("nothing works here", "neg")] * 12
    splits = {
        "train": {"body": [f"{t} ({i})" for i, (t, _) in enumerate(rows)],
                  "verdict": [y for _, y in rows]},
        "validation": {"body": ["so good", "so bad", "a joy", "a mess"],
                       "verdict": ["pos", "neg", "pos", "neg"]},
    }  # fmt: skip
    calls = []

    def load_dataset(name, config=None, split=None, **kw):
        calls.append((name, config, split))
        if name != "someorg/reviews" or split not in splits:
            raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")
        return datasets.Dataset.from_dict(splits[split])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    hub._load.cache_clear()
    yield calls
    hub._load.cache_clear()


def test_a_hub_dataset_trains_like_a_file(cli, tmp_path, tiny_gpt2_dir, fake_hub):
    r = cli("finetune", tiny_gpt2_dir, "--data", "someorg/reviews", "--eval-data",
            "someorg/reviews@validation", "--text-field", "body", "--label-field", "verdict",
            "--max-steps", "2", "--micro-batch", "4", "--seq-len", "16", "--runs-root",
            tmp_path, "--no-dashboard")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert ("someorg/reviews", None, "train") in fake_hub
    assert ("someorg/reviews", None, "validation") in fake_hub
    run_dir = runs.latest_run(tmp_path)
    assert run_dir.name.endswith("someorg-reviews")
    cfg = runs.run_config(run_dir)
    assert cfg["run"]["data_file"] == "someorg/reviews"  # as given, not made a path
    assert cfg["labels"]["names"] == ["neg", "pos"]
    assert cfg["data_files"]["someorg/reviews"].startswith("datasets fingerprint")
    assert runs.read_run(run_dir)["evals"][-1]["eval_samples"] == 4


def test_hub_records_train_a_causal_lm_and_a_miss_is_one_message(cli, tmp_path, fake_hub):
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel

    from zenflow.train.models import packaged_gpt2_tokenizer

    lm = tmp_path / "lm"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32,
                               vocab_size=50257)).save_pretrained(lm)  # fmt: skip
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(lm)
    records = {"prompt": [f"Item {i}:" for i in range(30)], "completion": [" yes", " no"] * 15}
    real = datasets.load_dataset

    def with_records(name, config=None, split=None, **kw):
        if name == "someorg/instruct":
            return datasets.Dataset.from_dict(records)
        return real(name, config, split=split, **kw)

    datasets.load_dataset = with_records  # restored by fake_hub's monkeypatch
    r = cli("finetune", lm, "--objective", "causal-lm", "--data", "someorg/instruct",
            "--max-steps", "2", "--micro-batch", "4", "--seq-len", "16", "--runs-root",
            tmp_path / "runs", "--no-dashboard")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "someorg/instruct: 27 prompt/completion records read" in r.output  # 3 held out
    miss = cli("finetune", lm, "--objective", "causal-lm", "--data", "otherorg/missing:cfg",
               "--runs-root", tmp_path / "runs2")  # fmt: skip
    assert_user_error(miss, "Could not load the dataset 'otherorg/missing:cfg'",
                      "config 'cfg'", "OfflineModeIsEnabled", "pass a local file")  # fmt: skip
    assert not (tmp_path / "runs2").exists()
    # a missing file with a file's suffix is a missing file, never a dataset id
    gone = cli("finetune", lm, "--objective", "causal-lm", "--data", tmp_path / "no.jsonl",
               "--runs-root", tmp_path / "runs3")  # fmt: skip
    assert gone.exit_code == 2 and "Could not load the dataset" not in gone.output
