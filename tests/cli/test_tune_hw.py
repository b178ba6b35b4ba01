"""`zfctl tune-hw` end to end through Typer's CliRunner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zfctl.app import app

TEMPLATE = Path(__file__).parents[2] / "templates" / "zenflow.json"
TOY = ["--model", "builtin:gpt2-2x128", "--micro-batch", "2", "--seq-len", "16"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["tune-hw", *args])


def check_choices(choices: dict) -> None:
    assert 0 < choices["topk_ratio"] <= 1
    assert isinstance(choices["update_interval"], int) and 1 <= choices["update_interval"] <= 64
    assert 0 < choices["pt_reserved_cores_perc"] < 1
    assert isinstance(choices["overlap_step"], bool)
    assert choices["select_interval"] == "auto" and choices["select_strategy"] == "auto"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `tune-hw --quick` run (the default quick model), shared by the checks below."""
    out = tmp_path_factory.mktemp("hw") / "tmp" / "hw.json"
    result = invoke("--quick", "--output", str(out))
    return result, out


def test_quick_writes_hw_json(quick_run):
    result, out = quick_run
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    check_choices(data["choices"])
    assert set(data["reasons"]) >= {
        "topk_ratio",
        "update_interval",
        "select_interval",
        "overlap_step",
        "pt_reserved_cores_perc",
    }
    assert data["settings"] == {
        "model": "builtin:gpt2-4x512",
        "micro_batch": 4,
        "seq_len": 32,
        "quick": True,
    }
    assert data["versions"]["torch"] and data["date"]
    probes = data["probes"]
    assert probes["cpu"]["logical_cores"] >= 1 and probes["cpu"]["simd"]["avx2"] is True
    assert probes["memory"]["copy_gbs"] > 0
    assert probes["model"]["params_total"] == 38_867_456  # the ZENFLOW.md section 7 shape
    # Both options of ZENFLOW.md section 7 were measured, and the choice follows them.
    cores = probes["cpu"]["usable_cores"]
    if cores >= 2:
        ov = probes["overlap"][-1]
        assert ov["on_window_ms"] > 0 and ov["off_window_ms"] > 0
        w = data["windows"]
        assert data["choices"]["overlap_step"] == (w["on_ms"] < w["off_ms"])
        if w["measured"]:
            assert (w["on_ms"], w["off_ms"]) == (ov["on_window_ms"], ov["off_window_ms"])
    # A fallback to the reference Adam is always said.
    adam = next(iter(probes["cpu_adam"].values()))
    if adam["backend"] == "reference":
        assert any("reference" in note for note in data["notes"])
    if probes["accelerator"]["kind"] == "cpu":
        assert any("device is the CPU" in note for note in data["notes"])
    assert data["memory_check"]["ok"] is True
    # The engine cross-check ran both ways, or a note says why not.
    engine = probes["engine"]
    if cores >= 2 and not any("Engine cross-check skipped" in n for n in data["notes"]):
        assert [r["overlap_step"] for r in engine] == [True, False]
        assert "engine cross-check" in data["method"]


def test_quick_prints_table_and_note(quick_run):
    result, out = quick_run
    text = result.stdout
    for key in ("topk_ratio", "update_interval", "overlap_step", "pt_reserved_cores_perc"):
        assert key in text
    assert "host memory OK" in text
    assert f"wrote {out}" in text.replace("\n", "")
    data = json.loads(out.read_text())
    if data["probes"]["accelerator"]["kind"] == "cpu":
        assert "device is the CPU" in text.replace("\n", " ")


def test_config_write_updates_zenflow_block(tmp_path):
    from zenflow.config import load_config

    cfg = tmp_path / "ds.json"
    original = json.loads(TEMPLATE.read_text())
    original["zero_optimization"]["zenflow"]["update_interval"] = 99  # surely changed
    cfg.write_text(json.dumps(original))
    out = tmp_path / "hw.json"

    shown = invoke("--quick", *TOY, "--output", str(out), "--config", str(cfg))
    assert shown.exit_code == 0, shown.output
    assert json.loads(cfg.read_text()) == original  # a diff only, without --write
    assert "zero_optimization.zenflow.update_interval: 99 ->" in shown.stdout
    assert "add --write" in shown.stdout

    written = invoke("--quick", *TOY, "--output", str(out), "--config", str(cfg), "--write")
    assert written.exit_code == 0, written.output
    choices = json.loads(out.read_text())["choices"]
    check_choices(choices)
    after = json.loads(cfg.read_text())
    assert after["zero_optimization"]["zenflow"] == {
        **original["zero_optimization"]["zenflow"],
        **choices,
    }
    for key in original:  # every other key kept as it was
        if key != "zero_optimization":
            assert after[key] == original[key]
    assert after["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    zf = load_config(cfg).zenflow
    assert zf.update_interval == choices["update_interval"]
    assert zf.topk_ratio == choices["topk_ratio"]
    assert zf.overlap_step == choices["overlap_step"]


def test_json_prints_hw_json(tmp_path):
    out = tmp_path / "hw.json"
    result = invoke("--quick", *TOY, "--topk", "0.25", "--output", str(out), "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["choices"]["topk_ratio"] == 0.25
    assert printed["settings"]["model"] == "builtin:gpt2-2x128"


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--write"], "--write"),
        (["--topk", "0"], "--topk"),
        (["--topk", "1.5"], "--topk"),
        (["--micro-batch", "0"], "--micro-batch"),
    ],
)
def test_bad_flags_exit_2(args, flag, tmp_path):
    result = invoke("--quick", "--output", str(tmp_path / "hw.json"), *args)
    assert result.exit_code == 2
    assert flag in result.output
    assert not (tmp_path / "hw.json").exists()


def test_unreadable_config_is_a_user_error(tmp_path):
    from zenflow.errors import UserInputError

    out = tmp_path / "hw.json"
    result = invoke("--quick", "--output", str(out), "--config", str(tmp_path / "nope.json"))
    if isinstance(result.exception, UserInputError):  # a bare app without the error handler
        assert "cannot be read" in str(result.exception)
    else:  # zfctl's app: one red line, exit 2
        assert result.exit_code == 2 and "cannot be read" in result.output
    assert not out.exists()  # failed before measuring anything


def test_importing_the_command_imports_no_torch():
    code = "import sys, zfctl.tune_hw; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0


@pytest.mark.slow
def test_full_run_builds_native_adam(tmp_path):
    """Without --quick: the native CPU Adam is built and measured (about a minute or more)."""
    out = tmp_path / "hw.json"
    result = invoke("--model", "builtin:gpt2-4x512", "--output", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    check_choices(data["choices"])
    adam = next(iter(data["probes"]["cpu_adam"].values()))
    assert adam["backend"] == "native", adam["fallback_reason"]
