"""`zfctl finetune --json` as a program sees it (issue 19): stdout holds strict JSON lines
only, stderr holds no Hugging Face progress bars, and a run whose loss stays non-finite
exits 3 (EXIT_DIVERGED) with one message naming the causes.

Before the fix stderr held "Loading weights: 100%|...|" and "Writing model shards: ..."
bars, and `--lr 1e30` exited 0 with a model of broken weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from zenflow import jsonout
from zenflow.train import runs
from zfctl.errors import EXIT_DIVERGED

# What a tqdm bar leaves on stderr, whatever its description.
BAR_MARKS = ("Loading weights", "Writing model shards", "it/s]", "%|")


def zfctl_json(tiny_gpt2_dir, root: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "zfctl", "finetune", str(tiny_gpt2_dir), "--task", "sst2",
        "--sample-data", "--runs-root", str(root), "--micro-batch", "4", "--seq-len", "16",
        "--max-eval-samples", "8", "--json", *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=root.parent,
                          timeout=300)  # fmt: skip


def strict_events(stdout: str) -> list[dict]:
    return [jsonout.loads_strict(line) for line in stdout.splitlines()]


def test_json_run_writes_no_progress_bars(tiny_gpt2_dir, tmp_path):
    r = zfctl_json(tiny_gpt2_dir, tmp_path / "runs", "--max-steps", "2")
    assert r.returncode == 0, r.stderr
    for mark in BAR_MARKS:
        assert mark not in r.stderr, r.stderr
    events = strict_events(r.stdout)
    assert events[0]["event"] == "RunStarted" and events[-1]["event"] == "RunFinished"
    run_dir = runs.latest_run(tmp_path / "runs")
    assert (run_dir / runs.MODEL_DIR).is_dir()  # the model was written (its bar was not)


def test_huge_lr_exits_3_with_a_diverged_summary(tiny_gpt2_dir, tmp_path):
    r = zfctl_json(tiny_gpt2_dir, tmp_path / "runs", "--max-steps", "12", "--lr", "1e30")
    assert r.returncode == EXIT_DIVERGED == 3, r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    (message,) = r.stderr.strip().splitlines()  # one line, no progress bars around it
    assert message.startswith("error: training diverged at step")
    assert "learning rate too high" in message and "No checkpoint was written" in message
    events = strict_events(r.stdout)
    last = events[-1]
    assert last["event"] == "RunDiverged" and last["skipped_steps"] >= 5
    run_dir = runs.latest_run(tmp_path / "runs")
    summary = jsonout.loads_strict((run_dir / runs.SUMMARY_FILE).read_text())
    assert summary["status"] == "diverged" and summary["steps"] == last["step"] < 12
    assert runs.checkpoints(run_dir) == [] and not (run_dir / runs.MODEL_DIR).exists()
    jsonout.loads_strict((run_dir / runs.CONFIG_FILE).read_text())  # every file: strict
    for line in (run_dir / runs.METRICS_FILE).read_text().splitlines():
        jsonout.loads_strict(line)
