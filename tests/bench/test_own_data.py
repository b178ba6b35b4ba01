"""bench/own_data.py: issue 30's own-data shape, written from GLUE SST-2 outside the repo."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_own_data", ROOT / "bench" / "own_data.py")
own = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(own)


def _glue(tmp_path: Path, n_train: int) -> Path:
    sst2 = tmp_path / "glue" / "sst2"
    sst2.mkdir(parents=True)
    rows = [f'row {i} "quoted"\t{i % 2}' for i in range(n_train)]
    (sst2 / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n", "utf-8")
    (sst2 / "dev.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t0\n", "utf-8")
    return sst2.parent


def test_writes_a_seeded_sample_with_string_labels(tmp_path, monkeypatch):
    monkeypatch.setenv("GLUE_DIR", str(_glue(tmp_path, 50)))
    assert own.main([str(tmp_path / "a"), "--rows", "20", "--seed", "3"]) == 0
    assert own.main([str(tmp_path / "b"), "--rows", "20", "--seed", "3"]) == 0
    train = [json.loads(x) for x in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    assert len(train) == 20 and len({r["text"] for r in train}) == 20
    assert {r["label"] for r in train} == {"negative", "positive"}
    # the label follows its own row (even rows 0 -> negative), quotes kept as text
    assert all((int(r["text"].split()[1]) % 2 == 1) == (r["label"] == "positive") for r in train)
    assert all(r["text"].endswith('"quoted"') for r in train)
    assert [r["text"] for r in train] != [f'row {i} "quoted"' for i in range(20)]  # shuffled
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (
        tmp_path / "b" / "train.jsonl"
    ).read_bytes()
    dev = [json.loads(x) for x in (tmp_path / "a" / "dev.jsonl").read_text().splitlines()]
    assert dev == [{"text": "good", "label": "positive"}, {"text": "bad", "label": "negative"}]


def test_without_glue_it_says_where_to_point(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GLUE_DIR", str(tmp_path / "none"))
    assert own.main([str(tmp_path / "out")]) == 2
    assert "set GLUE_DIR" in capsys.readouterr().err
