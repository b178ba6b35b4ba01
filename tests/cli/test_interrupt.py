"""A real Ctrl-C (SIGINT) or SIGTERM to a running `zfctl finetune` process: checkpoint, resume
command on stderr, exit 130 or 143; running the printed command finishes the run."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zenflow.train import runs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


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


def test_sigterm_checkpoints_exits_143_and_resumes_bit_exactly(cli, tiny_gpt2_dir, tmp_path):
    """A real SIGTERM (what Slurm or Kubernetes send before a kill) to `zfctl finetune`:
    checkpoint at the step boundary, the resume command, exit 143; running that command
    gives the same losses and weights as a run that was never stopped."""
    from zenflow.train.data import write_sst2_sample

    # 40 steps: SIGTERM goes out when step 2 is reported, long before the end.
    data = write_sst2_sample(tmp_path / "data", n=100, n_dev=8)
    common = [
        str(tiny_gpt2_dir), "--task", "sst2", "--data-dir", str(data), "--max-steps", "40",
        "--micro-batch", "2", "--seq-len", "16", "--max-eval-samples", "8",
    ]  # fmt: skip
    straight = cli("finetune", *common, "--run-dir", tmp_path / "straight", "--json")
    assert straight.exit_code == 0, straight.output

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run_dir = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, "-m", "zfctl", "finetune", *common, "--run-dir", str(run_dir), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        for line in proc.stdout:
            event = json.loads(line)
            if event.get("event") == "StepEvent" and event["step"] >= 2:
                proc.send_signal(signal.SIGTERM)
                break
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "stopped by SIGTERM after step" in err
    done_steps = len(runs.read_run(run_dir)["metrics"])
    assert 2 <= done_steps < 40
    ckpt = runs.latest_checkpoint(run_dir)
    assert ckpt.name == f"step-{done_steps:07d}.pt" and f"checkpoint: {ckpt}" in err
    (resume,) = [ln for ln in err.splitlines() if ln.startswith("resume with: ")]
    cmd = shlex.split(resume[len("resume with: ") :])
    assert cmd[:2] == ["zfctl", "finetune"] and cmd[cmd.index("--resume") + 1] == str(run_dir)

    r = cli(*cmd[1:], "--json")
    assert r.exit_code == 0, r.output
    got, ref = runs.read_run(run_dir), runs.read_run(tmp_path / "straight")
    assert [m["loss"] for m in got["metrics"]] == [m["loss"] for m in ref["metrics"]]
    assert got["evals"] == ref["evals"] and got["summary"]["steps"] == 40

    import torch

    a = torch.load(runs.latest_checkpoint(run_dir), weights_only=True)["model"]
    b = torch.load(runs.latest_checkpoint(tmp_path / "straight"), weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "storm",
    [(signal.SIGINT, 0.02, signal.SIGINT), (signal.SIGTERM, 0.0, signal.SIGTERM)],
    ids=["two-ctrl-c-20ms", "two-sigterm-at-once"],
)
def test_signals_while_a_checkpoint_is_saved(cli, tiny_gpt2_dir, tmp_path, storm):
    """Two Ctrl-C 20 ms apart, or two SIGTERM at the same moment, sent to a real `zfctl
    finetune` while it saves checkpoint 4 (its capture waits for the host step in flight,
    slowed to 1 s): the process says "already stopping" for the second, finishes that
    checkpoint, exits 130/143 naming it, and the resumed run is bit-exact against an
    uninterrupted one: losses, evaluations and the final model file's sha256. Before, two
    SIGTERMs killed it with no message and no checkpoint, and two Ctrl-C saved a host
    master copy taken in the middle of a host update."""
    from zenflow.train.data import write_sst2_sample

    data = write_sst2_sample(tmp_path / "data", n=100, n_dev=8)
    common = [
        str(tiny_gpt2_dir), "--task", "sst2", "--data-dir", str(data), "--max-steps", "8",
        "--micro-batch", "2", "--seq-len", "16", "--max-eval-samples", "8",
        "--eval-every", "3", "--checkpoint-every", "4",
    ]  # fmt: skip
    straight = cli("finetune", *common, "--run-dir", tmp_path / "straight", "--json")
    assert straight.exit_code == 0, straight.output

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT), "ZFCTL_TEST_SLOW_HOST_S": "1.0"}  # fmt: skip
    run_dir = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "slow_host_zfctl.py"), "finetune", *common,
         "--run-dir", str(run_dir), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        for line in proc.stdout:  # step 4 reported: its checkpoint is being saved now
            event = json.loads(line)
            if event.get("event") == "StepEvent" and event["step"] == 4:
                for item in storm:
                    if isinstance(item, float):
                        time.sleep(item)
                    else:
                        proc.send_signal(item)
                break
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    code = 143 if signal.SIGTERM in storm else 130
    assert proc.returncode == code, err
    assert "Traceback" not in err and "internal error" not in err
    if storm[1]:  # two signals sent at the same moment may reach the process as one
        assert "already stopping: finishing checkpoint 4 (kill -9 to abort)" in err
    ckpt = runs.latest_checkpoint(run_dir)
    assert ckpt.name == "step-0000004.pt" and f"checkpoint: {ckpt}" in err
    (resume,) = [ln for ln in err.splitlines() if ln.startswith("resume with: ")]
    r = cli(*shlex.split(resume[len("resume with: ") :])[1:], "--json")
    assert r.exit_code == 0, r.output
    got, ref = runs.read_run(run_dir), runs.read_run(tmp_path / "straight")
    assert [m["loss"] for m in got["metrics"]] == [m["loss"] for m in ref["metrics"]]
    assert got["evals"] == ref["evals"] and [e["step"] for e in got["evals"]] == [3, 6, 8]
    assert _model_sha256(run_dir) == _model_sha256(tmp_path / "straight")


def _model_sha256(run_dir) -> dict:
    model = run_dir / runs.MODEL_DIR
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model.iterdir())
        if p.suffix == ".safetensors"
    }
