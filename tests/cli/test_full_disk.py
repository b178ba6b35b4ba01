"""A real full disk and a real read-only file system under `zfctl finetune` and `zfctl init`
(issue 10 item 5): exit 2 naming the path and the free space, no temp file left behind,
the last good checkpoint kept, and the run continues exactly once there is room.

The full disk is a tmpfs sized so that the first checkpoint fits and the second does not;
it needs a private mount namespace (fshelp.run_on_tmpfs), else the test is skipped with the
reason. The read-only case also runs through chmod where that stops writes (not as root)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from clihelp import assert_user_error
from fshelp import run_on_tmpfs

from zenflow.train import runs

DRIVER = textwrap.dedent(
    """
    import json, os, shutil, subprocess, sys
    mnt, out, mode, args = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])

    def zfctl(*a):
        r = subprocess.run([sys.executable, "-m", "zfctl", *a], capture_output=True, text=True)
        return {"rc": r.returncode, "err": r.stderr}

    res = {}
    if mode == "full":
        run_dir = os.path.join(mnt, "r1")
        res["first"] = zfctl(*args, "--run-dir", run_dir, "--checkpoint-every", "1")
        res["left"] = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
        subprocess.run(["mount", "-o", "remount,size=256m", mnt], check=True)  # room again
        res["resumed"] = zfctl(*args, "--resume", run_dir)
        shutil.copytree(run_dir, os.path.join(out, "r1"), ignore=shutil.ignore_patterns("*.pt"))
    else:
        os.mkdir(os.path.join(mnt, "runs"))
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        res["finetune"] = zfctl(*args, "--runs-root", os.path.join(mnt, "runs"))
        res["init"] = zfctl("init", "--output", os.path.join(mnt, "ds.json"))
        res["left"] = sorted(os.listdir(mnt))
    json.dump(res, open(os.path.join(out, "result.json"), "w"))
    """
)


@pytest.fixture
def small_run_args(tiny_gpt2_dir, tmp_path):
    from zenflow.train.data import write_sst2_sample

    data = write_sst2_sample(tmp_path / "data", n=40, n_dev=8)
    return [
        "finetune", str(tiny_gpt2_dir), "--task", "sst2", "--data-dir", str(data),
        "--max-steps", "4", "--micro-batch", "2", "--seq-len", "16", "--max-eval-samples", "4",
        "--engine", "device", "--json",
    ]  # fmt: skip


def _params(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from zenflow.train.models import count_params

    config = AutoConfig.from_pretrained(model_dir)
    return count_params(AutoModelForSequenceClassification.from_config(config))


def test_full_disk_keeps_the_last_checkpoint_and_resumes(
    cli, small_run_args, tiny_gpt2_dir, tmp_path
):
    # A device-mode checkpoint holds the fp32 weights and AdamW's two moments: 12 bytes per
    # parameter (19.7 MB for the tiny GPT-2). 18 bytes per parameter fit the first one and
    # run out during the second (both are kept until the newer one is complete).
    size = 18 * _params(tiny_gpt2_dir)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out = tmp_path / "out"
    out.mkdir()
    r = run_on_tmpfs(tmp_path / "mnt", f"size={size}", script, str(out), "full",
                     json.dumps(small_run_args))  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "result.json").read_text())

    first = res["first"]
    assert first["rc"] == 2, first["err"]
    err = " ".join(first["err"].split())
    mnt_run = tmp_path / "mnt" / "r1"
    assert "Traceback" not in err
    assert f"cannot write checkpoint {mnt_run}/checkpoints/step-0000002.pt: No space left" in err
    assert f"free on {tmp_path / 'mnt'}" in err
    assert f"The last good checkpoint, {mnt_run}/checkpoints/step-0000001.pt, is kept" in err
    assert res["left"] == ["step-0000001.pt"]  # no temp file, the good one kept

    assert res["resumed"]["rc"] == 0, res["resumed"]["err"]
    straight = cli(*small_run_args, "--run-dir", tmp_path / "straight")
    assert straight.exit_code == 0, straight.output
    got, ref = runs.read_run(out / "r1"), runs.read_run(tmp_path / "straight")
    assert got["summary"]["steps"] == 4
    assert [m["loss"] for m in got["metrics"]] == [m["loss"] for m in ref["metrics"]]
    assert got["evals"] == ref["evals"]


def test_read_only_file_system(small_run_args, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out = tmp_path / "out"
    out.mkdir()
    r = run_on_tmpfs(tmp_path / "mnt", "size=1m", script, str(out), "readonly",
                     json.dumps(small_run_args))  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "result.json").read_text())
    mnt = tmp_path / "mnt"
    fin, init = res["finetune"], res["init"]
    assert fin["rc"] == 2 and "Traceback" not in fin["err"], fin["err"]
    err = " ".join(fin["err"].split())
    assert f"cannot create a run directory under {mnt / 'runs'}" in err
    assert "Read-only file system" in err and f"free on {mnt}" in err
    assert init["rc"] == 2 and "Traceback" not in init["err"], init["err"]
    err = " ".join(init["err"].split())
    assert f"--output: cannot write {mnt / 'ds.json'}: Read-only file system" in err
    assert res["left"] == ["runs"]


def test_read_only_directory_by_permissions(cli, small_run_args, tmp_path):
    if os.geteuid() == 0:
        pytest.skip(
            "running as root: chmod does not stop root's writes, so a read-only directory "
            "cannot be made this way (test_read_only_file_system covers it with a tmpfs)"
        )
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = cli(*small_run_args, "--runs-root", ro / "runs")
        assert_user_error(r, f"cannot create a run directory under {ro / 'runs'}",
                          "Permission denied")  # fmt: skip
        r = cli("init", "--output", ro / "ds.json")
        assert_user_error(r, f"--output: cannot write {ro / 'ds.json'}", "Permission denied")
    finally:
        ro.chmod(0o755)
