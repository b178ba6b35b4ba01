"""zenflow.train.runs: the atomic JSON writer."""

from __future__ import annotations

import json
import os
import stat

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
