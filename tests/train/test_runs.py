"""zenflow.train.runs: the atomic JSON writer; what is a run, and what --overwrite removes."""

from __future__ import annotations

import json
import os
import stat

import pytest

from zenflow.errors import UserInputError
from zenflow.train import runs


def test_write_json_atomic_keeps_mode_and_leaves_no_temp(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text("{}")
    os.chmod(path, 0o640)
    runs.write_json_atomic(path, {"a": 1, "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": 1, "b": [1, 2]}
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["cfg.json"]
    runs.write_json_atomic(tmp_path / "new" / "hw.json", {"x": 1})
    assert json.loads((tmp_path / "new" / "hw.json").read_text()) == {"x": 1}


# ------------------------------------------------- what is a run (issue 19): config.json


def test_a_run_is_known_by_its_config_json_not_by_file_names(tmp_path, model_folder):
    """The old ``holds_run`` took any folder with a config.json (or metrics.jsonl...) for a
    run, so a model folder "already held a run" and --overwrite deleted its config.json."""
    model = tmp_path / "runs" / "20240101-000000-my-model"
    model.parent.mkdir()
    model_folder.path.rename(model)
    assert not runs.holds_run(model) and runs.run_config(model) is None
    assert runs.not_a_run_reason(model) == "its config.json was not written by zfctl"
    marked = tmp_path / "runs" / "20240102-000000-gpt2-sst2"
    runs.write_json_atomic(marked / "config.json", {runs.RUN_MARK: runs.RUN_FORMAT})
    legacy = tmp_path / "runs" / "20240103-000000-gpt2-sst2"  # before the mark existed
    runs.write_json_atomic(legacy / "config.json", {"run": {"model": "gpt2", "task": "sst2"}})
    broken = tmp_path / "runs" / "20240104-000000-gpt2-sst2"
    broken.mkdir()
    (broken / "config.json").write_text('{"zfctl_run": 1,')  # not JSON: not recognised
    assert runs.holds_run(marked) and runs.holds_run(legacy) and not runs.holds_run(broken)
    assert runs.list_runs(tmp_path / "runs") == [marked, legacy]
    assert runs.latest_run(tmp_path / "runs", "gpt2", "sst2") == legacy
    (model / "checkpoints").mkdir()  # even with a checkpoint --resume auto never picks it
    (model / "checkpoints" / "step-0000001.pt").write_bytes(b"")
    assert runs.latest_run(tmp_path / "runs", with_checkpoint=True) is None
    for cfg in ({runs.RUN_MARK: True}, {runs.RUN_MARK: 0}, {"run": "x"}, {"run": {}}, [1]):
        assert not runs.is_run_config(cfg), cfg


def test_clear_run_removes_only_zfctl_files_of_a_run(tmp_path):
    run = tmp_path / "r1"
    runs.write_json_atomic(run / "config.json", {runs.RUN_MARK: runs.RUN_FORMAT})
    for name in ("metrics.jsonl", "summary.json", "hw.json", "notes.txt", ".zfctl.lock"):
        (run / name).write_text("x")
    for folder in ("checkpoints", "model", "csv_monitor/r1", "tensorboard/r1", "my-plots"):
        (run / folder).mkdir(parents=True)
    (run / "csv_monitor" / "r1" / "Train_Steps_loss.csv").write_text("step,loss\n1,2.0\n")
    removed = runs.clear_run(run)
    assert removed[-1] == "config.json"  # last: a run cleared halfway is still a run
    assert sorted(os.listdir(run)) == [".zfctl.lock", "my-plots", "notes.txt"]


def test_clear_run_refuses_a_folder_that_is_not_a_run(model_folder):
    model = model_folder.path
    with pytest.raises(UserInputError) as exc:
        runs.clear_run(model)
    msg = str(exc.value)
    assert f"{model} is not a zfctl run (its config.json was not written by zfctl)" in msg
    assert "nothing in it was removed" in msg
    assert model_folder.unchanged()
