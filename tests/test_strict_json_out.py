"""Every JSON zfctl writes parses with a strict parser, NaN and inf written as null
(zenflow.jsonout; issue 19). Before, metrics.jsonl, summary.json, config.json, hw.json and
several ``--json`` outputs held bare ``NaN`` tokens, which strict parsers reject."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from zenflow import jsonout
from zenflow.train.runs import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]


def test_plain_turns_non_finite_numbers_into_null():
    value = {
        "nan": math.nan, "inf": [math.inf, -math.inf], "np": np.float32("nan"),
        "ok": (1, 2.5, np.int64(3), True), "path": Path("/x"), 7: {"deep": [math.nan]},
    }  # fmt: skip
    assert jsonout.plain(value) == {
        "nan": None, "inf": [None, None], "np": None, "ok": [1, 2.5, 3, True], "path": "/x",
        "7": {"deep": [None]},
    }  # fmt: skip
    assert jsonout.loads_strict(jsonout.dumps(value))["inf"] == [None, None]


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_loads_strict_refuses_what_strict_parsers_refuse(token):
    assert not math.isfinite(json.loads(f'{{"x": {token}}}')["x"])  # Python's default reads it
    with pytest.raises(ValueError, match="not JSON"):
        jsonout.loads_strict(f'{{"x": {token}}}')


def test_run_files_are_strict(tmp_path):
    """summary.json, config.json, hw.json and tune-hw's output go through write_json_atomic."""
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"final_loss": math.nan, "timing": {"wall_ms": math.inf}})
    assert jsonout.loads_strict(path.read_text()) == {
        "final_loss": None,
        "timing": {"wall_ms": None},
    }


def test_no_writer_bypasses_the_strict_encoder():
    """A JSON file or stream written with json.dump(s) directly would write NaN again: only
    zenflow/jsonout.py may call json.dump, and no output goes through json.dumps."""
    offenders = []
    for path in sorted([*ROOT.glob("zenflow/**/*.py"), *ROOT.glob("zfctl/**/*.py")]):
        if path.name == "jsonout.py":
            continue
        text = path.read_text(encoding="utf-8")
        if re.search(r"\bjson\.dump\(|(echo|write|print)\(json\.dumps\(", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_command_outputs_are_strict(cli, tmp_path):
    r = cli("estimate", "gpt2", "--device-mem", "24GiB", "--host-mem", "64GiB", "--json")
    assert r.exit_code == 0, r.output
    assert jsonout.loads_strict(r.stdout)["params"] > 0
    r = cli("env", "--json")
    assert r.exit_code == 0, r.output
    jsonout.loads_strict(r.stdout)
    out = tmp_path / "ds.json"
    r = cli("init", "--output", out)
    assert r.exit_code == 0, r.output
    jsonout.loads_strict(out.read_text())
