"""`zfctl finetune` and its run directory through the CLI (issue 10 items 1-3 and 8, issue 19):
an existing run needs --resume or --overwrite (which keeps files zfctl did not write), a
folder that is not a zfctl run (a model folder) is refused and left as it was, two
processes never share a run dir, resuming a finished run says so and exits 0, a config
without a zenflow block is announced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from clihelp import assert_user_error

from zenflow.train import runs

SHORT = ["--micro-batch", "2", "--seq-len", "16", "--max-eval-samples", "4"]


@pytest.fixture
def args(tiny_gpt2_dir, tmp_path):
    from zenflow.train.data import write_sst2_sample

    data = write_sst2_sample(tmp_path / "data", n=40, n_dev=8)
    return ["finetune", str(tiny_gpt2_dir), "--task", "sst2", "--data-dir", str(data), *SHORT]


def test_existing_run_needs_resume_or_overwrite(cli, args, tmp_path):
    run_dir = tmp_path / "r1"
    assert cli(*args, "--max-steps", "2", "--run-dir", run_dir).exit_code == 0
    before = (run_dir / runs.METRICS_FILE).read_bytes()
    r = cli(*args, "--max-steps", "3", "--run-dir", run_dir)
    assert_user_error(r, f"--run-dir {run_dir} already holds a run", f"--resume {run_dir}",
                      "--overwrite")  # fmt: skip
    assert (run_dir / runs.METRICS_FILE).read_bytes() == before
    (run_dir / "notes.txt").write_text("mine", encoding="utf-8")
    r = cli(*args, "--max-steps", "3", "--run-dir", run_dir, "--overwrite")
    assert r.exit_code == 0, r.output
    run = runs.read_run(run_dir)
    assert [m["step"] for m in run["metrics"]] == [1, 2, 3] and run["summary"]["steps"] == 3
    assert [p.name for p in runs.checkpoints(run_dir)] == ["step-0000003.pt"]
    assert run["config"][runs.RUN_MARK] == runs.RUN_FORMAT  # what makes it a run
    assert (run_dir / "notes.txt").read_text(encoding="utf-8") == "mine"  # not ours: kept


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_a_model_folder_as_run_dir_exits_2_untouched(cli, args, model_folder, overwrite):
    """Issue 19: the old code said the model folder "already holds a run", and with
    --overwrite deleted its config.json and wrote a run there."""
    r = cli(*args, "--max-steps", "1", "--run-dir", model_folder.path, *overwrite)
    assert_user_error(r, f"--run-dir {model_folder.path} is not a zfctl run",
                      "Choose an empty or new folder for --run-dir")  # fmt: skip
    assert "already holds a run" not in r.output
    assert model_folder.unchanged()


def test_second_process_on_the_same_run_dir_exits_2(cli, args, tmp_path):
    run_dir = tmp_path / "r1"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "zfctl", *args, "--max-steps", "400", "--run-dir", str(run_dir),
         "--checkpoint-every", "1", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        for line in first.stdout:  # the first process is training and has a checkpoint
            if json.loads(line).get("event") == "CheckpointSaved":
                break
        r = cli(*args, "--max-steps", "400", "--run-dir", run_dir)
        assert_user_error(r, f"run dir {run_dir} in use by PID {first.pid}")
        r = cli(*args, "--resume", run_dir)
        assert_user_error(r, f"in use by PID {first.pid}")
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 130, err
    steps = [m["step"] for m in runs.read_run(run_dir)["metrics"]]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaved rows


def test_resume_auto_of_a_finished_run_exits_0(cli, args, tmp_path):
    root = tmp_path / "runs"
    assert cli(*args, "--max-steps", "2", "--runs-root", root).exit_code == 0
    run_dir = runs.latest_run(root)
    before = (run_dir / runs.METRICS_FILE).read_bytes()
    r = cli(*args, "--resume", "auto", "--runs-root", root)
    assert r.exit_code == 0, r.output
    assert f"run {run_dir} already finished (2 steps); nothing to do." in " ".join(r.stdout.split())
    r = cli(*args, "--resume", "auto", "--runs-root", root, "--json")
    assert r.exit_code == 0, r.output
    (event,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert event["event"] == "RunAlreadyFinished" and event["summary"]["steps"] == 2
    assert (run_dir / runs.METRICS_FILE).read_bytes() == before


def test_config_without_zenflow_block_is_announced(cli, args, tmp_path):
    from zfctl.init_cmd import template_path

    offload = template_path("offload")  # no zenflow block
    r = cli(*args, "--max-steps", "1", "--config", offload, "--runs-root", tmp_path / "runs")
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert (
        f"note: no zenflow block in {offload}: ZenFlow runs with defaults (topk_ratio 0.1, "
        "update_interval"
    ) in text
    assert "zenflow: topk_ratio=0.1" in text  # the defaults are shown, not hidden
    r = cli(*args, "--max-steps", "1", "--config", offload, "--engine", "offload",
            "--runs-root", tmp_path / "runs")  # fmt: skip
    assert r.exit_code == 0 and "no zenflow block" not in r.stdout


def test_resume_auto_never_takes_a_data_run_named_like_the_task(cli, args, tmp_path):
    """Issue 31 item 10: a --data run the user had named sst2 was found by --task sst2
    --resume auto, which said "already finished" and exited 0 without training."""
    root = tmp_path / "runs"
    table = tmp_path / "mine.csv"
    table.write_text("text,label\n" + "".join(f"good {i},1\nbad {i},0\n" for i in range(12)))
    data_run = [*args[:2], "--data", table, "--task", "sst2", *SHORT, "--runs-root", root]
    assert cli(*data_run, "--max-steps", "1").exit_code == 0
    r = cli(*args, "--max-steps", "1", "--runs-root", root, "--resume", "auto")
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "already finished" not in text
    assert f"note: no earlier run of {args[1]} on sst2 under {root} to resume" in text
    assert len(runs.list_runs(root)) == 2  # a new run beside the --data one
    # The --data run itself is found by its file, with its name or without (--task).
    for named in (["--task", "sst2"], []):
        r = cli(*args[:2], "--data", table, *named, *SHORT, "--runs-root", root, "--resume",
                "auto")  # fmt: skip
        assert r.exit_code == 0, r.output
        assert "already finished (1 steps)" in " ".join(r.stdout.split())


READ_ONLY_DRIVER = """
import json, os, subprocess, sys
mnt, out, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
run_dir = os.path.join(mnt, "r1")

def zfctl(*a):
    r = subprocess.run([sys.executable, "-m", "zfctl", *a], capture_output=True, text=True)
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr}

res = {"first": zfctl(*args, "--run-dir", run_dir)}
subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
res["finished"] = zfctl(*args, "--resume", run_dir)
res["longer"] = zfctl(*args[:-2], "--max-steps", "3", "--resume", run_dir)
json.dump(res, open(os.path.join(out, "result.json"), "w"))
"""


def test_resume_of_a_finished_run_on_a_read_only_file_system(args, tmp_path):
    """Issue 31: the resume failed on creating the lock file instead of saying the run had
    finished. A resume with work left still exits 2 naming the read-only file system."""
    from fshelp import run_on_tmpfs

    script = tmp_path / "driver.py"
    script.write_text(READ_ONLY_DRIVER)
    out = tmp_path / "out"
    out.mkdir()
    mnt = tmp_path / "mnt"
    run_args = [*args, "--engine", "device", "--max-steps", "2"]
    r = run_on_tmpfs(mnt, "size=128m", script, str(out), json.dumps([str(a) for a in run_args]))
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "result.json").read_text())
    assert res["first"]["rc"] == 0, res["first"]["err"]
    done = res["finished"]
    assert done["rc"] == 0, done["err"]
    assert f"run {mnt / 'r1'} already finished (2 steps); nothing to do." in " ".join(
        done["out"].split()
    )
    longer = res["longer"]
    assert longer["rc"] == 2 and "Traceback" not in longer["err"], longer["err"]
    err = " ".join(longer["err"].split())
    assert f"cannot create the run lock {mnt / 'r1' / runs.LOCK_FILE}" in err
    assert "Read-only file system" in err
