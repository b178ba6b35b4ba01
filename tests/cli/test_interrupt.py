"""A real Ctrl-C (SIGINT) to a running `zfctl finetune` process: checkpoint, resume command on
stderr, exit 130; running the printed command finishes the run."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys

from zenflow.train import runs


def test_sigint_saves_and_prints_resume_command(tiny_gpt2_dir, glue_dir, tmp_path):
    root = tmp_path / "runs"
    argv = [
        sys.executable, "-m", "zfctl", "finetune", str(tiny_gpt2_dir), "--task", "sst2",
        "--data-dir", str(glue_dir), "--runs-root", str(root), "--max-steps", "400",
        "--micro-batch", "2", "--seq-len", "16", "--max-eval-samples", "8", "--json",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        for line in proc.stdout:  # wait for the second step, then press Ctrl-C
            if json.loads(line).get("event") == "StepEvent" and json.loads(line)["step"] >= 2:
                proc.send_signal(signal.SIGINT)
                break
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    resume = [ln for ln in err.splitlines() if ln.startswith("resume with: ")]
    assert len(resume) == 1, err
    cmd = shlex.split(resume[0][len("resume with: ") :])
    run_dir = runs.latest_run(root)
    ckpt = runs.latest_checkpoint(run_dir)
    assert ckpt is not None and f"checkpoint: {ckpt}" in err
    done_steps = len(runs.read_run(run_dir)["metrics"])
    assert 2 <= done_steps < 400 and ckpt.name == f"step-{done_steps:07d}.pt"
    assert cmd[:2] == ["zfctl", "finetune"] and "--resume" in cmd

    # The printed command continues the same run (ask for a short extent to keep it quick).
    extent = ["--max-steps", str(done_steps + 2), "--json"]
    r = subprocess.run(
        [sys.executable, "-m", "zfctl", *cmd[1:], *extent, "--runs-root", str(root)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = runs.read_run(run_dir)["summary"]
    assert summary["steps"] == done_steps + 2 and summary["status"] == "finished"
