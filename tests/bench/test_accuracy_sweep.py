"""bench/accuracy.py: arms x seeds of real `zfctl finetune` runs, resumable, and its table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zenflow.train import runs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "accuracy.py"
_spec = importlib.util.spec_from_file_location("bench_accuracy", SCRIPT)
acc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(acc)


def test_arms_and_seeds_parse():
    name, arm = acc.parse_arm("zf=zenflow:topk=0.2,window_lr=sum,zfctl.stream_grads=false,"
                              "schedule=doubling")  # fmt: skip
    assert name == "zf" and arm == {"engine": "zenflow", "set": [
        "zero_optimization.zenflow.topk_ratio=0.2", "zfctl.window_lr=sum",
        "zfctl.stream_grads=false", "zfctl.select_schedule=doubling"]}  # fmt: skip
    assert acc.parse_arm("adamw=device") == ("adamw", {"engine": "device", "set": []})
    for bad, words in [("zf", "NAME=ENGINE"), ("zf=gpu", "not one of"),
                       ("zf=zenflow:topk", "not key=value"), ("zf=zenflow:speed=2", "unknown key"),
                       ("../x=device", "NAME=ENGINE")]:  # fmt: skip
        with pytest.raises(acc.SweepError, match=words):
            acc.parse_arm(bad)
    assert acc.parse_seeds("1-3,7,2") == [1, 2, 3, 7]
    with pytest.raises(acc.SweepError):
        acc.parse_seeds("one")


def test_a_sweep_grows_but_never_changes():
    common = {"model": "minilm", "steps": 300}
    sweep = acc.merge_sweep(None, common, {"a": {"engine": "device", "set": []}}, [1, 2])
    grown = acc.merge_sweep(sweep, common, {"b": {"engine": "zenflow", "set": []}}, [3])
    assert list(grown["arms"]) == ["a", "b"] and grown["seeds"] == [1, 2, 3]
    with pytest.raises(acc.SweepError, match="steps=300"):
        acc.merge_sweep(sweep, {**common, "steps": 1000}, {}, [1])
    with pytest.raises(acc.SweepError, match="another name"):
        acc.merge_sweep(sweep, common, {"a": {"engine": "zenflow", "set": []}}, [1])


_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _sweep(tmp_path, model_dir, *args):
    argv = [sys.executable, str(SCRIPT), "run", str(tmp_path / "sweep"), "--model",
            str(model_dir), "--seeds", "1", "--steps", "4", "--eval-every", "2",
            "--micro-batch", "4", "--seq-len", "16", *args, "--", "--sample-data",
            "--max-eval-samples", "16"]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env=_ENV, cwd=tmp_path,
                          timeout=600)  # fmt: skip


def test_sweep_runs_resumes_and_tabulates(tiny_gpt2_dir, tmp_path):
    arms = ["--arm", "adamw=device", "--arm", "zs=zenflow:interval=2,window_lr=sum"]
    r = _sweep(tmp_path, tiny_gpt2_dir, *arms, "--keep-files", "--json", "t.json")
    assert r.returncode == 0, r.stdout + r.stderr
    root = tmp_path / "sweep"
    for arm in ("adamw", "zs"):
        assert acc.run_state(root / arm / "s1") == "finished"
    cfg = runs.run_config(root / "zs" / "s1")
    assert cfg["zfctl"]["window_lr"] == "sum"
    assert cfg["zero_optimization"]["zenflow"]["update_interval"] == 2
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["reference"] == "adamw" and doc["steps"] == [2, 4]
    rows = {row["arm"]: row for row in doc["rows"]}
    evals = runs.read_run(root / "zs" / "s1")["evals"]
    want = {e["step"]: e["accuracy"] for e in evals}
    ref = {e["step"]: e["accuracy"] for e in runs.read_run(root / "adamw" / "s1")["evals"]}
    for step in (2, 4):
        cell = rows["zs"]["at"][str(step)]
        assert cell["stats"]["mean"] == want[step]
        assert cell["gap"]["mean"] == pytest.approx(want[step] - ref[step])
        assert rows["adamw"]["at"][str(step)]["gap"] is None
    assert "| zs | zenflow update_interval=2 zfctl.window_lr=sum |" in r.stdout

    # A run stopped midway (no summary, a checkpoint left) is resumed, not redone; a
    # finished run is skipped; the table comes out the same. `run ROOT` alone resumes with
    # the sweep's own settings, seeds and finetune arguments.
    (root / "zs" / "s1" / runs.SUMMARY_FILE).unlink()
    assert acc.run_state(root / "zs" / "s1") == "resume"
    again = subprocess.run([sys.executable, str(SCRIPT), "run", str(root)], capture_output=True,
                           text=True, env=_ENV, cwd=tmp_path, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 runs to do" in again.stdout and "start zs seed 1 (resume)" in again.stdout
    commands = [ln for ln in (root / "zs" / "s1.log").read_text().splitlines() if ln[:2] == "$ "]
    assert len(commands) == 2 and "--resume" in commands[1] and "--resume" not in commands[0]
    assert acc.run_state(root / "zs" / "s1") == "finished"
    assert not (root / "zs" / "s1" / runs.CHECKPOINT_DIR).exists()  # finished: files dropped
    assert r.stdout.split("\n\n", 1)[1] == again.stdout.split("\n\n", 1)[1]

    # Another common setting in the same folder is refused, and so is another config: the
    # sweep's arms start from the config frozen when it was made (base_config.json), not
    # from the template as it is when a run starts.
    bad = _sweep(tmp_path, tiny_gpt2_dir, "--lr", "1e-3")
    assert bad.returncode == 2 and "use another folder" in bad.stderr
    template = json.loads(acc.TEMPLATE.read_text())
    assert json.loads((root / acc.BASE_CONFIG).read_text()) == template
    assert str(root / acc.BASE_CONFIG) in commands[0]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**template, "gradient_clipping": 0.5}))
    bad = _sweep(tmp_path, tiny_gpt2_dir, "--config", other)
    assert bad.returncode == 2 and "another config" in bad.stderr


def test_a_refused_input_stops_the_sweep(tiny_gpt2_dir, tmp_path):
    """zfctl's exit 2 (its input refused: here no GLUE data) would repeat in every run: the
    sweep starts no more runs and says why, instead of failing each one in turn."""
    argv = [sys.executable, str(SCRIPT), "run", str(tmp_path / "sweep"), "--model",
            str(tiny_gpt2_dir), "--seeds", "1-3", "--steps", "2", "--micro-batch", "4",
            "--seq-len", "16", "--arm", "adamw=device", "--arm", "zf=zenflow"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "GLUE_DIR"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode != 0
    assert r.stdout.count("  start ") == 1, r.stdout
    assert "stopping: exit 2" in r.stdout and "5 runs not started" in r.stdout
