"""GLUE task table, TSV loading, synthetic sample, batching and metrics."""

from __future__ import annotations

import math

import pytest
import torch

from zenflow.errors import DataError
from zenflow.train import data
from zenflow.train.data import Example, encoding, get_task, glue, load_task
from zenflow.train.models import packaged_gpt2_tokenizer


@pytest.fixture(scope="module")
def gpt2_tok():
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    return tok


# ------------------------------------------------------------------------ task table


def test_task_table_glue_layout():
    assert list(data.GLUE_TASKS)[0] == "sst2"
    assert set(data.GLUE_TASKS) == {
        "sst2", "cola", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli",
    }  # fmt: skip
    mrpc = get_task("mrpc")
    assert mrpc.text_columns == ("#1 String", "#2 String") and mrpc.label_column == "Quality"
    assert mrpc.metrics == ("f1", "accuracy")
    stsb = get_task("STS-B")
    assert stsb.num_labels == 1 and stsb.is_regression and stsb.metrics == ("pearson", "spearman")
    mnli = get_task("mnli")
    assert mnli.dev_file == "dev_matched.tsv" and mnli.label_column == "gold_label"
    assert mnli.num_labels == 3
    assert get_task("cola").headerless_columns == ("source", "label", "original_label", "sentence")
    assert get_task("qqp").label_column == "is_duplicate"
    assert get_task("SST-2") is get_task("sst2")


def test_unknown_task_lists_known_tasks():
    with pytest.raises(DataError) as e:
        get_task("sst3")
    msg = str(e.value)
    assert "'sst3'" in msg
    for name in ("sst2", "cola", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"):
        assert name in msg


# ----------------------------------------------------------------------------- loading


def test_sst2_counts_from_glue_dir(glue_dir):
    td = load_task("sst2", glue_dir)
    assert len(td.train) == 67349
    assert len(td.dev) == 872
    # GLUE SST-2's class balance (independent of the copy's row order).
    assert sum(e.label for e in td.train) == 37569
    assert sum(e.label for e in td.dev) == 444
    assert all(len(e.texts) == 1 and e.texts[0] for e in td.train)
    assert "GLUE TSV files" in td.source and str(glue_dir) in td.source


def test_bare_quotes_are_text(tmp_path):
    d = tmp_path / "sst2"
    d.mkdir()
    # A leading quote would open a quoted field under csv's default dialect and swallow
    # the following lines; GLUE's quotes are plain characters.
    (d / "train.tsv").write_text(
        'sentence\tlabel\n"so bad it hurts\t0\nit is " fine "\t1\nok\t1\n', encoding="utf-8"
    )
    (d / "dev.tsv").write_text('sentence\tlabel\n"quoted" start\t1\n', encoding="utf-8")
    td = load_task("sst2", tmp_path)
    assert [e.texts[0] for e in td.train] == ['"so bad it hurts', 'it is " fine "', "ok"]
    assert [e.label for e in td.train] == [0, 1, 1]
    assert td.dev == [Example(('"quoted" start',), 1)]


def test_task_directory_itself_and_glue_names(tmp_path):
    d = tmp_path / "SST-2"
    d.mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (d / name).write_text("sentence\tlabel\na\t1\nb\t0\n", encoding="utf-8")
    assert len(load_task("sst2", tmp_path).train) == 2  # <root>/SST-2
    assert len(load_task("sst2", d).dev) == 2  # the task directory itself


def _task_files(root, task: str, train: str, dev: str | None = None, dev_name="dev.tsv"):
    """Write ``<root>/<task>/train.tsv`` and its dev file (the same rows unless given)."""
    d = root / task
    d.mkdir(exist_ok=True)
    (d / "train.tsv").write_text(train, encoding="utf-8")
    (d / dev_name).write_text(train if dev is None else dev, encoding="utf-8")
    return d


def test_pair_task_and_string_labels(tmp_path):
    body = "index\tsentence1\tsentence2\tlabel\n0\ta b\tc\tentailment\n1\td\te\tnot_entailment\n"
    _task_files(tmp_path, "rte", body)
    td = load_task("rte", tmp_path)
    assert td.train == [Example(("a b", "c"), 0), Example(("d", "e"), 1)]


def test_cola_headerless(tmp_path):
    d = tmp_path / "cola"
    d.mkdir()
    body = (
        "gj04\t1\t\tThe sailors rode the breeze clear of the rocks.\n"
        "gj04\t0\t*\tWe yelled hoarse.\n"
    )
    (d / "train.tsv").write_text(body, encoding="utf-8")
    (d / "dev.tsv").write_text(body, encoding="utf-8")
    td = load_task("cola", tmp_path)
    assert td.train[1] == Example(("We yelled hoarse.",), 0)
    assert len(td.train) == 2  # the first row is data, not a header


def test_missing_data_message(tmp_path):
    with pytest.raises(DataError) as e:
        load_task("sst2", tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "sst2") in msg and "train.tsv" in msg
    assert "--data-dir" in msg and "GLUE_DIR" in msg and "--sample-data" in msg


def test_hub_offline_message():
    with pytest.raises(DataError) as e:
        load_task("sst2")  # no data_dir: the hub, offline here
    msg = str(e.value)
    assert "nyu-mll/glue" in msg and "--data-dir" in msg and "GLUE_DIR" in msg


def test_bad_label_and_short_row_name_file_and_line(tmp_path):
    d = tmp_path / "sst2"
    d.mkdir()
    (d / "dev.tsv").write_text("sentence\tlabel\na\t1\n", encoding="utf-8")
    (d / "train.tsv").write_text("sentence\tlabel\na\t1\nb\tpositive\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"train\.tsv, line 3: label 'positive' .* not one of "
                       r"the task's classes \(0, 1\)"):  # fmt: skip
        load_task("sst2", tmp_path)
    (d / "train.tsv").write_text("sentence\tlabel\na\t1\nb\t2\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"train\.tsv, line 3: label '2'"):
        load_task("sst2", tmp_path)
    (d / "train.tsv").write_text("sentence\tlabel\na\t1\nno label here\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"train\.tsv, line 3: 1 field\(s\), but the header has 2"):
        load_task("sst2", tmp_path)
    (d / "train.tsv").write_text("text\tlabel\na\t1\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_task("sst2", tmp_path)
    msg = str(e.value)
    assert "train.tsv: no field 'sentence'; the file's fields are 'text', 'label'" in msg
    assert "GLUE's sst2 files have the fields 'sentence', 'label'" in msg
    assert "--text-field" not in msg  # a preset's fields are not the user's to name


def test_preset_labels_are_fixed_not_inferred(tmp_path):
    """MNLI's classes keep the hub's order (not sorted), whichever the file holds; STS-B is a
    regression even when every score is a whole number; a label outside the set names its
    line."""
    body = "index\tsentence1\tsentence2\tgold_label\n0\ta\tb\tneutral\n1\tc\td\tcontradiction\n"
    d = _task_files(tmp_path, "mnli", body, dev_name="dev_matched.tsv")
    td = load_task("mnli", tmp_path)
    assert [e.label for e in td.train] == [1, 2]  # entailment, neutral, contradiction
    assert td.report.labels.names == ("entailment", "neutral", "contradiction")
    (d / "train.tsv").write_text(body + "2\te\tf\tmaybe\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"train\.tsv, line 4: label 'maybe' .*entailment, "
                       "neutral, contradiction"):  # fmt: skip
        load_task("mnli", tmp_path)

    body = "index\tsentence1\tsentence2\tscore\n0\ta\tb\t4\n1\tc\td\t0\n"
    d = _task_files(tmp_path, "stsb", body)
    td = load_task("stsb", tmp_path)
    assert [e.label for e in td.train] == [4.0, 0.0]
    assert all(isinstance(e.label, float) for e in td.train + td.dev)
    (d / "dev.tsv").write_text(body + "2\te\tf\thigh\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"dev\.tsv, line 4: label 'high' .*not a finite number"):
        load_task("stsb", tmp_path)


def test_preset_counts_dropped_rows_in_the_report(tmp_path):
    """The table reader's rule: a row with empty text or no label is dropped and counted,
    never silently; the header lines say so."""
    _task_files(tmp_path, "sst2", "sentence\tlabel\na\t1\n \t0\nb\t\nc\t0\n",
                "sentence\tlabel\na\t1\n")  # fmt: skip
    td = load_task("sst2", tmp_path)
    assert [e.texts for e in td.train] == [("a",), ("c",)]
    lines = td.report.lines()
    assert lines[0] == (
        "train.tsv: 4 rows read, 2 kept, 2 dropped (1 empty text, 1 missing label value)"
    )
    assert lines[1] == "dev.tsv: 1 row read, 1 kept, none dropped"
    assert lines[2] == "labels: 2 classes (0, 1)"  # GLUE's ids, not "0 = 0, 1 = 1"
    assert lines[3] == "train rows per class: 0: 1, 1: 1"


def test_sst2_preset_reads_the_dev_file_as_a_plain_tab_split(glue_dir):
    """Reference: the dev file split on tabs by hand (SST-2 has no quoting and no empty
    text) equals the preset's rows, texts and labels, in order."""
    lines = (glue_dir / "sst2" / "dev.tsv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "sentence\tlabel"
    plain = [Example((t,), int(y)) for t, y in (line.split("\t") for line in lines[1:])]
    td = load_task("sst2", glue_dir)
    assert td.dev == plain
    assert td.report.train.read == td.report.train.kept == 67349


def test_glue_hub_preset_reads_the_hub_rows(monkeypatch):
    """Without --data-dir the preset reads nyu-mll/glue's splits through the same table
    reader: hub columns, class ids as labels. ``datasets.load_dataset`` is replaced by an
    in-memory dataset (no hub here); the real hub/cache path is the datasets library's."""
    import datasets

    from zenflow.train.data import hub

    rows = {
        "train": {"premise": ["p1", "p2"], "hypothesis": ["h1", "h2"], "label": [2, 0]},
        "validation_matched": {"premise": ["p3"], "hypothesis": ["h3"], "label": [1]},
    }  # fmt: skip
    asked = []

    def load_dataset(name, config=None, split=None, **kw):
        asked.append((name, config, split))
        return datasets.Dataset.from_dict(rows[split])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    hub._load.cache_clear()
    try:
        td = load_task("mnli")
    finally:
        hub._load.cache_clear()
    assert asked == [
        ("nyu-mll/glue", "mnli", "train"),
        ("nyu-mll/glue", "mnli", "validation_matched"),
    ]
    assert td.train == [Example(("p1", "h1"), 2), Example(("p2", "h2"), 0)]
    assert td.dev == [Example(("p3", "h3"), 1)]
    assert td.source == "Hugging Face datasets: nyu-mll/glue mnli"


def test_sst2_sample_writer(tmp_path):
    root = data.write_sst2_sample(tmp_path / "a", n=100, n_dev=20)
    again = data.write_sst2_sample(tmp_path / "b", n=100, n_dev=20)
    a = (root / "sst2" / "train.tsv").read_bytes()
    assert a == (again / "sst2" / "train.tsv").read_bytes()  # deterministic
    td = load_task("sst2", root)
    assert len(td.train) == 100 and len(td.dev) == 20
    assert sum(e.label for e in td.train) == 50  # balanced
    assert td.source.startswith("synthetic SST-2-format sample written by zfctl, not GLUE")
    pos = {w for e in td.train if e.label == 1 for w in e.texts[0].split()}
    neg = {w for e in td.train if e.label == 0 for w in e.texts[0].split()}
    # Learnable: the sentiment words of the two classes do not overlap.
    assert set(glue._POS_ADJ) <= pos and not set(glue._POS_ADJ) & neg


# ------------------------------------------------------------------- encode and batch


def _toy_task(n: int) -> data.TaskData:
    rows = [Example((f"sentence number {i}",), i % 2) for i in range(n)]
    return data.TaskData(get_task("sst2"), rows, rows[:5], "test rows")


def test_encode_fixed_length_truncation(gpt2_tok):
    rows = [Example(("Hello world",), 1), Example((" ".join(["word"] * 50),), 0)]
    td = data.TaskData(get_task("sst2"), rows, rows, "t")
    t = data.encode(td, gpt2_tok, seq_len=8).train.tensors()
    assert t["input_ids"].shape == (2, 8) and t["input_ids"].dtype == torch.long
    assert t["input_ids"][0].tolist() == [15496, 995] + [50256] * 6  # right-padded with eos
    assert t["attention_mask"][0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert t["attention_mask"][1].tolist() == [1] * 8  # truncated, not padded
    assert t["labels"].tolist() == [1, 0]


def test_encode_pairs_and_regression(gpt2_tok):
    rows = [Example(("Hello", " world"), 2.5)]
    td = data.TaskData(get_task("stsb"), rows, rows, "t")
    t = data.encode(td, gpt2_tok, seq_len=4).train.tensors()
    assert t["input_ids"][0].tolist() == [15496, 995, 50256, 50256]
    assert t["labels"].dtype == torch.float32 and t["labels"].tolist() == [2.5]


def test_is_truncated_matches_encoding_with_and_without_truncation(gpt2_tok, glue_dir):
    """Reference: a row is cut when ``Encoded``'s truncating encoding differs from the
    whole one; for single texts and for pairs (the pair's total counts)."""
    rows = load_task("sst2", glue_dir).dev[:200]
    pairs = [Example((a.texts[0], b.texts[0]), 0) for a, b in zip(rows, rows[1:], strict=False)]
    for group, seq_len in ((rows, 24), (pairs, 40)):
        got = data.is_truncated(group, gpt2_tok, seq_len)
        want = []
        for r in group:
            whole = gpt2_tok(*r.texts)["input_ids"]
            cut = gpt2_tok(*r.texts, truncation=True, max_length=seq_len)["input_ids"]
            want.append(whole != cut)
        assert got == want
        assert 0 < sum(got) < len(group)  # both kinds occur


def test_truncation_line_counts_eval_whole_and_samples_a_large_train(gpt2_tok, monkeypatch):
    short, long_ = Example(("a fine film",), 1), Example(("word " * 40,), 0)
    td = data.TaskData(get_task("sst2"), [short] * 6 + [long_] * 4, [long_, short], "t")
    line = data.truncation_line(td, gpt2_tok, 16, seed=0)
    assert line.startswith("truncated to --seq-len 16 tokens (the end cut off): ")
    assert "train 4 of 10 (40.0%), eval 1 of 2 (50.0%); raise --seq-len" in line
    assert data.truncation_line(td, gpt2_tok, 64, seed=0) == (
        "none truncated at --seq-len 64 tokens: train 0 of 10 (0.0%), eval 0 of 2 (0.0%)"
    )
    monkeypatch.setattr(encoding, "TRUNCATION_SAMPLE", 5)
    sampled = data.truncation_line(td, gpt2_tok, 16, seed=0)
    assert "train " in sampled and " of a 5-row sample of 10 (" in sampled
    assert sampled == data.truncation_line(td, gpt2_tok, 16, seed=0)  # seeded


def test_batches_deterministic_and_resumable(gpt2_tok):
    enc = data.encode(_toy_task(23), gpt2_tok, seq_len=6).train
    full = [(i, b["input_ids"]) for i, b in data.batches(enc, 4, seed=1, epoch=0)]
    assert [i for i, _ in full] == [4, 8, 12, 16, 20]  # 23 // 4 full batches; rest dropped
    again = list(data.batches(enc, 4, seed=1, epoch=0))
    assert all(torch.equal(a[1], b[1]["input_ids"]) for a, b in zip(full, again, strict=True))
    resumed = list(data.batches(enc, 4, seed=1, epoch=0, start_index=12))
    assert [i for i, _ in resumed] == [16, 20]
    assert torch.equal(resumed[0][1]["input_ids"], full[3][1])
    # The order depends on the epoch and the seed, and every example appears once an epoch.
    p0 = data.epoch_permutation(23, seed=1, epoch=0)
    assert not torch.equal(p0, data.epoch_permutation(23, seed=1, epoch=1))
    assert not torch.equal(p0, data.epoch_permutation(23, seed=2, epoch=0))
    assert sorted(p0.tolist()) == list(range(23))
    # A batch holds exactly the permuted examples.
    first = torch.cat([enc.take(p0[:4].tolist())["input_ids"]])
    assert torch.equal(first, full[0][1])
    with pytest.raises(ValueError):
        next(data.batches(enc, 4, seed=1, epoch=0, start_index=3))


def test_steps_per_epoch_and_eval_batches(gpt2_tok):
    assert data.steps_per_epoch(67349, 8) == 8418
    assert data.steps_per_epoch(67349, 8, grad_accum=4) == 2104
    with pytest.raises(DataError, match="fewer than one optimizer step"):
        data.steps_per_epoch(5, 4, 2)
    enc = data.encode(_toy_task(11), gpt2_tok, seq_len=6).train
    sizes = [len(b["labels"]) for b in data.eval_batches(enc, 4)]
    assert sizes == [4, 4, 3]
    assert [len(b["labels"]) for b in data.eval_batches(enc, 4, limit=5)] == [4, 1]


# ----------------------------------------------------------------------------- metrics


def test_metrics_known_values():
    preds = [1, 0, 1, 1, 0, 0]
    labels = [1, 0, 0, 1, 1, 0]
    assert data.accuracy(preds, labels) == pytest.approx(4 / 6)
    # tp=2 fp=1 fn=1 tn=2: f1 = 4/6; mcc = (4-1)/sqrt(3*3*3*3) = 1/3
    assert data.f1(preds, labels) == pytest.approx(2 / 3)
    assert data.matthews(preds, labels) == pytest.approx(1 / 3)
    assert data.matthews([1, 1, 1], [1, 0, 1]) == 0.0  # undefined -> 0
    assert data.matthews([1, 0], [0, 1]) == pytest.approx(-1.0)
    assert data.f1([0, 0], [0, 0]) == 0.0
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert data.pearson(x, [2 * v + 1 for v in x]) == pytest.approx(1.0)
    assert data.pearson([1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == pytest.approx(0.5)
    # Spearman with ties: ranks [1, 2.5, 2.5, 4] vs [1, 2, 3, 4] -> 0.9486832980505138
    assert data.spearman([1, 2, 2, 3], [10, 20, 30, 40]) == pytest.approx(
        3 / math.sqrt(10), rel=1e-12
    )
    assert data.spearman([1, 2, 3], [3, 1, 9]) == pytest.approx(0.5)
    assert data.compute_metrics(get_task("mrpc"), preds, labels) == pytest.approx(
        {"f1": 2 / 3, "accuracy": 4 / 6}
    )
    with pytest.raises(ValueError):
        data.accuracy([1], [1, 0])
