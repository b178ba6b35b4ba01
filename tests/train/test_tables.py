"""zenflow.train.tables: a user's own table files -> rows, labels, splits and TaskData."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from zenflow.errors import DataError
from zenflow.train.data import (
    METRICS,
    LabelSet,
    compute_metrics,
    infer_labels,
    load_table_task,
    read_rows,
    seeded_split,
)
from zenflow.train.data.tables import FORMATS

# Quotes, commas and a non-ASCII letter: each format must give these texts back unchanged.
RECORDS = [
    {"text": "a great film", "label": "pos", "id": 1},
    {"text": 'he said "dull", twice', "label": "neg", "id": 2},
    {"text": "café society, charming", "label": "pos", "id": 3},
    {"text": "meh", "label": "neutral", "id": 4},
]


def write_table(path: Path, records: list[dict], columns: list[str] | None = None) -> Path:
    """``records`` in the format of ``path``'s suffix (CSV/TSV with standard quoting)."""
    columns = columns or list(dict.fromkeys(k for r in records for k in r))
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(records, indent=1), encoding="utf-8")
    elif path.suffix in (".csv", ".tsv"):
        with open(path, "w", encoding="utf-8", newline="") as f:
            delimiter = "\t" if path.suffix == ".tsv" else ","
            w = csv.DictWriter(f, columns, delimiter=delimiter)
            w.writeheader()
            w.writerows(records)
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    return path


def message(excinfo) -> str:
    return str(excinfo.value)


# ------------------------------------------------------------------------------ formats


@pytest.mark.parametrize("suffix", list(FORMATS))
def test_every_format_reads_the_same_rows(tmp_path, suffix):
    t = read_rows(write_table(tmp_path / f"d{suffix}", RECORDS), ["text"], "label")
    assert [(r.texts, r.label) for r in t.rows] == [((r["text"],), r["label"]) for r in RECORDS]
    assert t.counts.columns == ("text", "label", "id")
    assert (t.counts.read, t.counts.kept, t.counts.dropped) == (4, 4, {})
    assert t.counts.format == suffix[1:]
    assert t.rows[1].where == {
        ".json": "item 2",
        ".parquet": "row 2",
    }.get(suffix, "line 3" if suffix in (".csv", ".tsv") else "line 2")


def test_suffix_is_case_insensitive_and_unknown_suffix_lists_the_supported(tmp_path):
    t = read_rows(
        write_table(tmp_path / "d.csv", RECORDS).rename(tmp_path / "D.CSV"), ["text"], "label"
    )
    assert len(t.rows) == 4
    (tmp_path / "d.xlsx").write_bytes(b"PK")
    with pytest.raises(DataError) as e:
        read_rows(tmp_path / "d.xlsx", ["text"], "label")
    assert "'.xlsx'" in message(e) and ".jsonl, .json, .csv, .tsv, .parquet" in message(e)


def test_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbftext,label\nfine,1\nbad,0\n")
    t = read_rows(p, ["text"], "label")
    assert t.counts.columns == ("text", "label")
    assert [r.label for r in t.rows] == ["1", "0"]
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "x", "label": 1}\n')
    assert read_rows(p, ["text"], "label").rows[0].label == 1


def test_two_text_fields(tmp_path):
    recs = [{"premise": f"p{i}", "hypothesis": f"h{i}", "label": i % 2} for i in range(6)]
    p = write_table(tmp_path / "pairs.csv", recs)
    t = read_rows(p, ["premise", "hypothesis"], "label")
    assert [r.texts for r in t.rows] == [(f"p{i}", f"h{i}") for i in range(6)]
    data, _ = load_table_task(p, text_fields=("premise", "hypothesis"), eval_fraction=0.5)
    assert data.task.text_columns == ("premise", "hypothesis")
    assert all(len(ex.texts) == 2 for ex in data.train + data.dev)
    with pytest.raises(DataError, match="one or two text fields"):
        read_rows(p, ["premise", "hypothesis", "label"], "label")


def test_tsv_quoting_none_reads_bare_quotes_as_text(tmp_path):
    p = tmp_path / "glue.tsv"
    p.write_text('sentence\tlabel\n"quoted" start\t1\n"half\t0\nends with "\t1\n', "utf-8")
    t = read_rows(p, ["sentence"], "label", tsv_quoting="none")
    assert [r.texts[0] for r in t.rows] == ['"quoted" start', '"half', 'ends with "']
    # Standard quoting reads other texts: the quotes pair up across lines 3 and 4.
    t = read_rows(p, ["sentence"], "label")
    assert [r.texts[0] for r in t.rows] == ["quoted start", "half\t0\nends with "]
    p.write_text('sentence\tlabel\nok\t1\n"half\t0\nmore\t1\n', "utf-8")
    with pytest.raises(DataError) as e:  # "half runs to the end of the file: one field
        read_rows(p, ["sentence"], "label")
    assert "line 3: 1 field(s), but the header has 2" in message(e)
    assert "--tsv-quoting none" in message(e)


def test_label_not_required_keeps_rows_without_labels(tmp_path):
    p = write_table(tmp_path / "predict.jsonl", [{"text": "a"}, {"text": "b", "label": "x"}])
    t = read_rows(p, ["text"], "label", label_required=False)
    assert [r.label for r in t.rows] == [None, "x"]
    q = write_table(tmp_path / "predict.csv", [{"text": "a"}])
    assert read_rows(q, ["text"], "label", label_required=False).rows[0].label is None


# ------------------------------------------------------------------------------ dropping


def test_dropped_rows_are_counted_by_reason(tmp_path):
    recs = [
        {"text": "kept", "label": "a"},
        {"text": "", "label": "a"},
        {"text": "   ", "label": "b"},
        {"label": "b"},  # no text key
        {"text": None, "label": "b"},
        {"text": "no label"},
        {"text": "null label", "label": None},
        {"text": "blank label", "label": " "},
        {"text": "also kept", "label": "b"},
    ]
    t = read_rows(write_table(tmp_path / "d.jsonl", recs), ["text"], "label")
    assert [r.texts[0] for r in t.rows] == ["kept", "also kept"]
    assert t.counts.dropped == {"empty text": 2, "missing text value": 2, "missing label value": 3}
    assert (t.counts.read, t.counts.kept) == (9, 2)
    assert t.counts.line() == (
        "d.jsonl: 9 rows read, 2 kept, 7 dropped "
        "(2 empty text, 2 missing text value, 3 missing label value)"
    )
    csv_recs = [{"text": "x", "label": "1"}, {"text": "", "label": "0"}, {"text": "y", "label": ""}]
    c = read_rows(write_table(tmp_path / "d.csv", csv_recs), ["text"], "label")
    assert c.counts.dropped == {"empty text": 1, "missing label value": 1}


def test_parquet_nulls_are_dropped_and_counted(tmp_path):
    recs = [{"text": "a", "label": 1}, {"text": None, "label": 0}, {"text": "c", "label": None}]
    t = read_rows(write_table(tmp_path / "d.parquet", recs), ["text"], "label")
    assert [(r.texts, r.label) for r in t.rows] == [(("a",), 1)]
    assert t.counts.dropped == {"missing text value": 1, "missing label value": 1}


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("suffix", list(FORMATS))
def test_missing_field_names_the_flag_and_the_fields_there(tmp_path, suffix):
    p = write_table(tmp_path / f"d{suffix}", [{"sentence": "x", "y": "a"}])
    with pytest.raises(DataError) as e:
        read_rows(p, ["text"], "label")
    m = message(e)
    assert str(p) in m
    assert "'text' (asked for with --text-field)" in m
    assert "'label' (asked for with --label-field)" in m
    assert "the file's fields are 'sentence', 'y'" in m


def test_empty_files(tmp_path):
    for name in ("e.jsonl", "e.json", "e.csv", "e.tsv"):
        (tmp_path / name).write_text("\n  \n", encoding="utf-8")
        with pytest.raises(DataError, match="is empty"):
            read_rows(tmp_path / name, ["text"], "label")
    (tmp_path / "h.csv").write_text("text,label\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="has a header line but no rows; add rows"):
        read_rows(tmp_path / "h.csv", ["text"], "label")
    (tmp_path / "a.json").write_text("[]", encoding="utf-8")
    with pytest.raises(DataError, match="holds an empty array"):
        read_rows(tmp_path / "a.json", ["text"], "label")


def test_empty_parquet_with_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "z.parquet"
    pq.write_table(
        pa.table({"text": pa.array([], pa.string()), "label": pa.array([], pa.int64())}), p
    )
    with pytest.raises(DataError, match="has no rows"):
        read_rows(p, ["text"], "label")


def test_all_rows_dropped(tmp_path):
    p = write_table(tmp_path / "d.csv", [{"text": "", "label": "1"}, {"text": " ", "label": "0"}])
    with pytest.raises(DataError) as e:
        read_rows(p, ["text"], "label")
    assert "all 2 rows were dropped (2 empty text)" in message(e)
    assert "--text-field" in message(e) and "'text', 'label'" in message(e)


def test_missing_file(tmp_path):
    for name in ("nope.csv", "nope.parquet"):
        with pytest.raises(DataError) as e:
            read_rows(tmp_path / name, ["text"], "label")
        assert "Cannot read" in message(e) and name in message(e) and "check the path" in message(e)


def test_a_file_that_is_not_parquet(tmp_path):
    (tmp_path / "d.parquet").write_text("text,label\nx,1\n", encoding="utf-8")
    with pytest.raises(DataError, match="is not a readable Parquet file"):
        read_rows(tmp_path / "d.parquet", ["text"], "label")


def test_bad_json_lines_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a", "label": 1}\n\n{"text": "b", label: 0}\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        read_rows(p, ["text"], "label")
    assert f"{p}, line 3: not valid JSON" in message(e) and "fix or remove" in message(e)
    p.write_text('{"text": "a", "label": 1}\n["b", 0]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 2: an array, not a JSON object"):
        read_rows(p, ["text"], "label")
    j = tmp_path / "d.json"
    j.write_text('{"text": "a", "label": 1}', encoding="utf-8")
    with pytest.raises(DataError, match=r"holds an object; a \.json table is an array.*\.jsonl"):
        read_rows(j, ["text"], "label")
    j.write_text('[{"text": "a", "label": 1}, "b"]', encoding="utf-8")
    with pytest.raises(DataError, match="item 2 of the array: a string, not a JSON object"):
        read_rows(j, ["text"], "label")
    j.write_text('[{"text": "a",\n "label": 1},\n oops]', encoding="utf-8")
    with pytest.raises(DataError, match="line 3: not valid JSON"):
        read_rows(j, ["text"], "label")


def test_not_utf8_names_file_line_and_byte(tmp_path):
    p = tmp_path / "latin1.csv"
    data = "text,label\nok,1\ncafé,0\n".encode("latin-1")
    p.write_bytes(data)
    with pytest.raises(DataError) as e:
        read_rows(p, ["text"], "label")
    at = data.index(b"\xe9")
    assert f"{p}, line 3: not UTF-8 text (byte {at} = 0xe9" in message(e)
    assert "iconv -f latin1 -t utf-8" in message(e)
    p.write_bytes(b"\xef\xbb\xbf" + data)  # the BOM counts: offsets are of the file's bytes
    with pytest.raises(DataError, match=f"line 3: not UTF-8 text \\(byte {at + 3} = 0xe9"):
        read_rows(p, ["text"], "label")


def test_wrong_field_count_in_csv(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("text,label\nfine,1\nnot, quoted,0\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        read_rows(p, ["text"], "label")
    assert "line 3: 3 field(s), but the header has 2 ('text', 'label')" in message(e)
    assert "inside double quotes" in message(e)


def test_text_that_is_not_a_string(tmp_path):
    p = write_table(tmp_path / "d.jsonl", [{"text": "a", "label": 1}, {"text": 7, "label": 0}])
    with pytest.raises(DataError, match=r"line 2: text field 'text' holds a number \(7\)"):
        read_rows(p, ["text"], "label")


def test_label_that_is_not_a_scalar(tmp_path):
    p = write_table(tmp_path / "d.json", [{"text": "a", "label": [1, 2]}])
    with pytest.raises(DataError, match="item 1: label field 'label' holds an array"):
        read_rows(p, ["text"], "label")


def test_mixed_label_kinds(tmp_path):
    recs = [{"text": "a", "label": "pos"}, {"text": "b", "label": "pos"}, {"text": "c", "label": 1}]
    with pytest.raises(DataError) as e:
        read_rows(write_table(tmp_path / "d.jsonl", recs), ["text"], "label")
    assert "line 1 has the class name 'pos' and line 3 the number 1" in message(e)
    assert "all class names, or all numbers" in message(e)
    with pytest.raises(DataError) as e:  # in CSV every value is a string: by its look
        read_rows(write_table(tmp_path / "d.csv", recs), ["text"], "label")
    assert "line 2 has the class name 'pos' and line 4 the number '1'" in message(e)
    with pytest.raises(DataError, match=r"mix class names \('pos'\) and numbers \(1\)"):
        infer_labels(["pos", "neg", 1])  # e.g. train and eval files of different formats
    # JSON strings are class names, even those that look like numbers.
    assert infer_labels(["pos", "neg", "1"]).names == ("1", "neg", "pos")


def test_non_finite_labels(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a", "label": 0.5}\n{"text": "b", "label": NaN}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 2: label nan in field 'label' is not a finite"):
        read_rows(p, ["text"], "label")
    c = write_table(
        tmp_path / "d.csv", [{"text": "a", "label": "0.5"}, {"text": "b", "label": "inf"}]
    )
    with pytest.raises(DataError, match=r"line 3: label 'inf' in field 'label' is not a finite"):
        read_rows(c, ["text"], "label")
    with pytest.raises(DataError, match="finite"):
        infer_labels([0.5, float("inf")])
    # A JSON string is a class name, whatever it spells; as numbers they are checked later.
    j = write_table(
        tmp_path / "s.jsonl", [{"text": "a", "label": "Nan"}, {"text": "b", "label": "x"}]
    )
    assert infer_labels(r.label for r in read_rows(j, ["text"], "label").rows).names == ("Nan", "x")
    with pytest.raises(DataError, match="finite"):
        infer_labels(["0.5", "nan"])


# -------------------------------------------------------------------------------- labels


def test_string_labels_are_sorted_classes():
    labels = infer_labels(["pos", "neg", "neutral", "pos"])
    assert labels.kind == "classification" and labels.value_type == "str"
    assert labels.names == ("neg", "neutral", "pos")
    assert labels.id2label == {0: "neg", 1: "neutral", 2: "pos"}
    assert labels.label2id == {"neg": 0, "neutral": 1, "pos": 2}
    assert [labels.id_of(y) for y in ("pos", "neg", " neutral ")] == [2, 0, 1]
    assert labels.num_labels == 3
    with pytest.raises(DataError, match="'happy' is not one of the classes"):
        labels.id_of("happy")


def test_integer_labels_sort_by_value_and_keep_their_spelling():
    for raw in ([2, 0, 1, 10, 1], ["2", "0", "1", "10", "1"], [2.0, 0.0, 1.0, 10.0, 1.0]):
        labels = infer_labels(raw)
        assert labels.kind == "classification" and labels.value_type == "int"
        assert labels.names == ("0", "1", "2", "10")
        assert [labels.id_of(y) for y in raw] == [2, 0, 1, 3, 1]
    labels = infer_labels([-1, 1])
    assert labels.names == ("-1", "1") and labels.id_of("-1") == 0 and labels.id_of(1.0) == 1


def test_boolean_labels():
    labels = infer_labels([True, False, True])
    assert labels.names == ("false", "true") and labels.value_type == "bool"
    assert [labels.id_of(y) for y in (False, True, "true")] == [0, 1, 1]


def test_fractional_labels_make_a_regression():
    labels = infer_labels([0.0, 1.5, 5, 3.2])
    assert labels.kind == "regression" and labels.names is None and labels.num_labels == 1
    assert labels.id2label == {0: "LABEL_0"} and labels.label2id == {"LABEL_0": 0}
    assert labels.target("3.8") == 3.8 and labels.target(5) == 5.0
    assert infer_labels(["0.000", "4.250", "5"]).kind == "regression"  # STS-B style strings
    with pytest.raises(DataError, match="no class ids"):
        labels.id_of(1.5)


def test_no_or_missing_training_labels():
    with pytest.raises(DataError, match="no training labels"):
        infer_labels([])
    with pytest.raises(DataError, match="1 training row without a label"):
        infer_labels(["a", None, "b"])


def test_one_class_is_an_error():
    with pytest.raises(DataError) as e:
        infer_labels(["pos", "pos", "pos"])
    assert "one class only, 'pos' (3 rows)" in message(e) and "--label-field" in message(e)


def test_unseen_eval_labels_are_named_with_counts():
    with pytest.raises(DataError) as e:
        infer_labels(["neg", "pos"], ["pos", "maybe", "x", "maybe"])
    m = message(e)
    assert "'maybe' (2 rows), 'x' (1 row) do not occur in the training labels (neg, pos)" in m
    assert "Remove those rows from the eval file" in m
    infer_labels([0, 1, 2], ["2", 1, 0.0])  # same classes in other spellings: fine
    with pytest.raises(DataError, match="'3' \\(1 row\\)"):
        infer_labels([0, 1], [3])
    with pytest.raises(DataError, match="1 eval label is not a finite number, e.g. 'high'"):
        infer_labels([0.5, 1.5], [1.0, "high"])


@pytest.mark.parametrize(
    "raw", [["b", "a"], [1, 0, 2], [True, False], [0.5, 1.25]], ids=["str", "int", "bool", "reg"]
)
def test_label_set_json_round_trip(raw):
    labels = infer_labels(raw)
    back = LabelSet.from_json(json.loads(json.dumps(labels.to_json())))
    assert back == labels
    assert back.id2label == labels.id2label and back.label2id == labels.label2id
    assert [back.target(y) for y in raw] == [labels.target(y) for y in raw]


# --------------------------------------------------------------------------------- split


def test_seeded_split_is_deterministic_per_seed():
    rows = list(range(50))
    train, dev = seeded_split(rows, 0.1, seed=1)
    assert (train, dev) == seeded_split(rows, 0.1, seed=1)
    assert len(dev) == 5 and len(train) == 45
    assert sorted(train + dev) == rows and not set(train) & set(dev)
    assert train == sorted(train) and dev == sorted(dev)  # both keep the file's order
    others = {tuple(seeded_split(rows, 0.1, seed=s)[1]) for s in range(2, 6)}
    assert tuple(dev) not in others and len(others) > 1


def test_seeded_split_sizes():
    assert [len(p) for p in seeded_split([1, 2], 0.1, 0)] == [1, 1]  # at least 1 held out
    assert [len(p) for p in seeded_split([1, 2, 3], 0.9, 0)] == [1, 2]  # at least 1 left
    assert [len(p) for p in seeded_split(list(range(1000)), 0.25, 0)] == [750, 250]
    with pytest.raises(DataError, match="from 1 row; give at least 2 rows or an eval file"):
        seeded_split([1], 0.1, 0)
    with pytest.raises(DataError, match="between 0 and 1"):
        seeded_split([1, 2, 3], 1.0, 0)


# ---------------------------------------------------------------------------------- task


def test_load_table_task_with_an_eval_file(tmp_path):
    train = write_table(
        tmp_path / "train.jsonl",
        [{"text": f"t{i}", "label": ["neg", "pos"][i % 2]} for i in range(10)]
        + [{"text": "", "label": "pos"}],
    )
    dev = write_table(
        tmp_path / "dev.csv", [{"text": "d0", "label": "pos"}, {"text": "d1", "label": "neg"}]
    )
    data, report = load_table_task(train, dev, text_fields=["text"], name="reviews")
    t = data.task
    assert (t.name, t.text_columns, t.label_column, t.num_labels) == (
        "reviews",
        ("text",),
        "label",
        2,
    )
    assert t.metrics == ("accuracy", "f1", "matthews") and set(t.metrics) <= set(METRICS)
    assert t.label_names == ("neg", "pos") and t.hub_text_columns == ("text",)
    assert [ex.label for ex in data.train] == [i % 2 for i in range(10)]
    assert [(ex.texts, ex.label) for ex in data.dev] == [(("d0",), 1), (("d1",), 0)]
    assert data.source == f"table files: {train} (train), {dev} (eval)"
    assert report.lines() == [
        "train.jsonl: 11 rows read, 10 kept, 1 dropped (1 empty text)",
        "dev.csv: 2 rows read, 2 kept, none dropped",
        "labels: 2 classes (0 = neg, 1 = pos)",
        "train rows per class: neg: 5, pos: 5",
    ]
    preds = [ex.label for ex in data.dev]
    assert compute_metrics(t, preds, preds) == {"accuracy": 1.0, "f1": 1.0, "matthews": 1.0}


def test_load_table_task_with_a_seeded_split(tmp_path):
    recs = [{"q": f"q{i}", "label": str(i % 3)} for i in range(30)]
    p = write_table(tmp_path / "intents.tsv", recs)
    data, report = load_table_task(p, text_fields=["q"], seed=7, eval_fraction=0.2)
    assert data.task.name == "intents" and data.task.num_labels == 3
    assert data.task.metrics == ("accuracy",) and data.task.label_names == ("0", "1", "2")
    assert len(data.dev) == 6 and len(data.train) == 24
    assert sorted(ex.texts[0] for ex in data.train + data.dev) == sorted(r["q"] for r in recs)
    assert all(ex.label == int(ex.texts[0][1:]) % 3 for ex in data.train + data.dev)
    assert data.source == f"table file {p}; seeded split: 6 rows held out (seed 7)"
    assert report.split == (6, 7) and report.eval is None
    assert report.lines()[1] == (
        "eval: 6 of 30 rows of intents.tsv held out (seeded split, seed 7, not stratified)"
    )
    again, _ = load_table_task(p, text_fields=["q"], seed=7, eval_fraction=0.2)
    other, _ = load_table_task(p, text_fields=["q"], seed=8, eval_fraction=0.2)
    assert again.dev == data.dev and other.dev != data.dev


def test_load_table_task_regression(tmp_path):
    rng = random.Random(0)
    recs = [{"a": f"a{i}", "b": f"b{i}", "score": round(rng.uniform(0, 5), 2)} for i in range(20)]
    p = write_table(tmp_path / "sts.parquet", recs)
    data, report = load_table_task(p, text_fields=("a", "b"), label_field="score")
    assert data.task.is_regression and data.task.metrics == ("pearson", "spearman")
    assert data.task.label_names is None
    assert all(isinstance(ex.label, float) for ex in data.train + data.dev)
    ys = [ex.label for ex in data.dev]
    assert compute_metrics(data.task, ys, ys)["pearson"] == pytest.approx(1.0)
    assert "regression" in report.lines()[2]
