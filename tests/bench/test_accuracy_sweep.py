"""bench/accuracy.py: arms x seeds of real `zfctl finetune` runs, resumable, and its table."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
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
    # a LoRA arm: its adapters' keys, and its own peak lr instead of the sweep's
    assert acc.parse_arm("lo=lora:lr=5e-4,rank=16,alpha=32") == (
        "lo",
        {"engine": "lora", "set": ["zfctl.lora.rank=16", "zfctl.lora.alpha=32"], "lr": 5e-4},
    )
    for bad in ("lo=lora:lr=fast", "lo=lora:lr=-1", "lo=lora:lr=0"):
        with pytest.raises(acc.SweepError, match="not a positive number"):
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
    arms = ["--arm", "adamw=device", "--arm", "zs=zenflow:interval=2,window_lr=sum",
            "--arm", "lo=lora:lr=1e-3,rank=4"]  # fmt: skip
    r = _sweep(tmp_path, tiny_gpt2_dir, *arms, "--keep-files", "--json", "t.json")
    assert r.returncode == 0, r.stdout + r.stderr
    root = tmp_path / "sweep"
    for arm in ("adamw", "zs", "lo"):
        assert acc.run_state(root / arm / "s1") == "finished"
    cfg = runs.run_config(root / "zs" / "s1")
    assert cfg["zfctl"]["window_lr"] == "sum"
    assert cfg["zero_optimization"]["zenflow"]["update_interval"] == 2
    lora_cfg = runs.run_config(root / "lo" / "s1")  # the LoRA arm, at its own lr
    assert lora_cfg["run"]["engine_mode"] == "lora" and lora_cfg["run"]["lr"] == 1e-3
    assert lora_cfg["zfctl"]["lora"]["rank"] == 4
    assert runs.run_config(root / "adamw" / "s1")["run"]["lr"] == 5e-5  # the sweep's
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["reference"] == "adamw" and doc["steps"] == [2, 4]
    rows = {row["arm"]: row for row in doc["rows"]}
    # the three-way table: accuracy (above), device bytes per parameter from each run's
    # summary (its device peak over the base's parameters) and time per step, side by side
    for arm in ("adamw", "zs", "lo"):
        summary = runs.read_run(root / arm / "s1")["summary"]
        assert rows[arm]["device_bytes_per_param"]["mean"] == summary[
            "device_peak_bytes_per_param"]  # fmt: skip
        wall = rows[arm]["wall_ms"]["mean"]
        assert wall == summary["timing_ms_mean"]["wall_ms"]
        assert rows[arm]["wall_vs_reference"] == pytest.approx(
            wall / rows["adamw"]["wall_ms"]["mean"])  # fmt: skip
    assert rows["adamw"]["device_bytes_per_param"]["mean"] == pytest.approx(16.0, abs=0.01)
    assert 4.0 < rows["lo"]["device_bytes_per_param"]["mean"] < 5.0  # the frozen fp32 base
    assert "| lo | lora zfctl.lora.rank=4 lr=0.001 |" in r.stdout
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


# ------------------------------------------------------------------ issue 31's weak spots


def _run_cli(tmp_path, *args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, env=_ENV, cwd=tmp_path, timeout=600)  # fmt: skip


def test_ctrl_c_stops_each_run_at_a_checkpoint_and_says_how_to_resume(tiny_gpt2_dir, tmp_path):
    """Ctrl-C to the sweep: no KeyboardInterrupt traceback; the running zfctl finetune gets
    the signal once (it runs in a session of its own, as a terminal's Ctrl-C would not
    reach it twice), writes its checkpoint and stops before the sweep exits 130 with the
    command that resumes it. Before the fix: a traceback, and the run went on orphaned."""
    root = tmp_path / "sweep"
    argv = [sys.executable, str(SCRIPT), "run", str(root), "--model", str(tiny_gpt2_dir),
            "--seeds", "1", "--steps", "2000", "--eval-every", "1000", "--micro-batch", "2",
            "--seq-len", "8", "--arm", "adamw=device", "--", "--sample-data",
            "--max-eval-samples", "4"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_ENV, cwd=tmp_path)  # fmt: skip
    log = root / "adamw" / "s1.log"
    try:
        # the run is training (its first progress line is in its log): the stop comes mid-run
        while not (log.is_file() and "step 1/2000" in log.read_text()):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted" in err
    assert f"resume the sweep with: .venv/bin/python bench/accuracy.py run {root}" in err
    # the run itself stopped at a step boundary with its checkpoint, before the sweep ended
    text = log.read_text()
    assert "interrupted after step" in text and "resume with:" in text, text
    assert acc.run_state(root / "adamw" / "s1") == "resume"
    assert "adamw seed 1: stopped (checkpoint step-" in out, out


def test_a_folder_of_other_files_or_a_file_is_not_a_sweep(tmp_path):
    """A non-empty folder without sweep.json is someone else's: refused (exit 2), nothing
    written there. A file as ROOT: exit 2 with a sentence, not an internal error."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine\n")
    r = _run_cli(tmp_path, "run", theirs, "--arm", "adamw=device")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is not empty (notes.txt)" in r.stderr and "new or empty folder" in r.stderr
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]
    a_file = tmp_path / "results.txt"
    a_file.write_text("x\n")
    for cmd in ("run", "table"):
        r = _run_cli(tmp_path, cmd, a_file, *(["--arm", "adamw=device"] if cmd == "run" else []))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"{a_file} is a file, not a sweep folder" in r.stderr
    assert a_file.read_text() == "x\n"
    r = _run_cli(tmp_path, "table", tmp_path / "nowhere")
    assert r.returncode == 2 and "no such sweep folder" in r.stderr
    (theirs / acc.SWEEP_FILE).write_text("{not json")
    r = _run_cli(tmp_path, "table", theirs)
    assert r.returncode == 2 and "cannot be read" in r.stderr and "Traceback" not in r.stderr


def test_a_table_without_a_device_arm_says_so(tmp_path):
    """No device arm, no --reference: the title says there is nothing to take gaps to (it
    used to print "gap = arm - None")."""
    root = tmp_path / "sweep"
    root.mkdir()
    sweep = {"common": {**acc.DEFAULTS}, "arms": {"zf": {"engine": "zenflow", "set": []}},
             "seeds": [1]}  # fmt: skip
    (root / acc.SWEEP_FILE).write_text(json.dumps(sweep))
    r = _run_cli(tmp_path, "table", root)
    assert r.returncode == 0, r.stderr
    assert "None" not in r.stdout
    assert "no gaps: this sweep has no device arm to compare with" in r.stdout
    r = _run_cli(tmp_path, "table", root, "--at", "1x")
    assert r.returncode == 2 and "--at '1x'" in r.stderr
