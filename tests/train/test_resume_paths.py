"""Resume and paths (issue 31, item 10 and the weak spots "resume and paths"): --resume auto
matches a run on what it trained on, never on its name; a run in use is named, not passed
over; a run started with relative paths resumes from any folder; a data file that moved
with the same sha256 is accepted and said; a run with no checkpoint says --overwrite; a
diverged run names its last good checkpoint and the command that goes on from it at a
lower lr, and that command works."""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import subprocess
import sys
import textwrap

import pytest
from trainhelp import losses, make_spec

from zenflow.config import load_config
from zenflow.errors import StorageError, UserInputError
from zenflow.train import runs
from zenflow.train.events import RunDiverged, RunStarted
from zenflow.train.run_match import data_run_name
from zenflow.train.spec import RunSpec, resolve_resume, resume_or_new
from zenflow.train.trainer import run_finetune

CSV = "text,label\n" + "".join(f"good movie {i},1\nbad film {i},0\n" for i in range(12))


def _fake_run(root, name: str, *, checkpoint: bool = True, data_digest=None, **run) -> object:
    """A run directory as zfctl leaves it (config.json with the mark and the run's spec, a
    checkpoint file), without training: what --resume auto chooses among."""
    d = root / name
    cfg = {runs.RUN_MARK: runs.RUN_FORMAT, "run": {"model": "gpt2", "task": "sst2", **run}}
    if data_digest is not None:
        cfg["data_files"] = {run["data_file"]: data_digest}
    runs.write_json_atomic(d / runs.CONFIG_FILE, cfg)
    if checkpoint:
        (d / runs.CHECKPOINT_DIR).mkdir()
        (d / runs.CHECKPOINT_DIR / "step-0000002.pt").write_bytes(b"")
    return d


def _auto(root, **kw) -> RunSpec:
    given = {"model": "gpt2", "task": "sst2", "runs_root": root, "resume": "auto", **kw}
    return RunSpec(config=load_config({}), **given)


# ---------------------------------------------------------------- --resume auto's choice


def test_resume_auto_matches_what_a_run_trained_on_not_its_name(tmp_path):
    """Old: --task sst2 --resume auto took a --data run the user had named sst2 and said
    "already finished" (exit 0)."""
    from zenflow.train.run_match import file_sha256

    table = tmp_path / "mine.csv"
    table.write_text(CSV)
    digest = file_sha256(table)
    _fake_run(tmp_path, "20250101-000000-gpt2-sst2", data_file=str(table), data_digest=digest)
    spec, note = resume_or_new(_auto(tmp_path))  # GLUE's sst2: no such run
    assert spec.resume is None
    assert note.startswith(f"no earlier run of gpt2 on sst2 under {tmp_path} to resume")
    # The same table, by path and moved (its sha256), finds the run; other rows do not.
    moved = tmp_path / "elsewhere.csv"
    moved.write_text(CSV)
    for data, name in ((table, "sst2"), (moved, data_run_name(moved))):
        spec = _auto(tmp_path, data_file=str(data), task=name)
        assert resume_or_new(spec) == (spec, None)
        assert resolve_resume(spec)[0].name == "20250101-000000-gpt2-sst2"
    other = tmp_path / "other.csv"
    other.write_text(CSV + "one more,1\n")
    assert resume_or_new(_auto(tmp_path, data_file=str(other), task="sst2"))[0].resume is None
    # A GLUE run of sst2 is found by --task sst2, newer or older than the --data run.
    _fake_run(tmp_path, "20240101-000000-gpt2-sst2")
    assert resolve_resume(_auto(tmp_path))[0].name == "20240101-000000-gpt2-sst2"


def test_resume_auto_names_the_newest_run_still_in_use(tmp_path):
    """Old: the newest run, training without a checkpoint yet, was passed over ("no
    earlier run") and a second run started beside it."""
    _fake_run(tmp_path, "20250101-000000-gpt2-sst2")  # an older run that could be resumed
    busy = _fake_run(tmp_path, "20250102-000000-gpt2-sst2", checkpoint=False)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from zenflow.train.runs import RunDirLock
            RunDirLock({str(busy)!r}).acquire()
            print("locked", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert runs.lock_holder(busy) == str(holder.pid)
        with pytest.raises(UserInputError) as exc:
            resume_or_new(_auto(tmp_path))
        msg = str(exc.value)
        assert f"the latest run of gpt2 on sst2, {busy}, is in use by PID {holder.pid}" in msg
        assert "omit --resume to start a second run" in msg
    finally:
        holder.communicate("", timeout=60)
    # Once it has ended, the run it left (no checkpoint) is passed over for the older one.
    assert runs.lock_holder(busy) is None
    assert resolve_resume(_auto(tmp_path))[0].name == "20250101-000000-gpt2-sst2"


def test_a_run_without_a_checkpoint_says_overwrite(tmp_path):
    """Old: "--resume DIR: no checkpoint ... Start a new run": the same --run-dir then
    needs --overwrite, which nothing said."""
    d = _fake_run(tmp_path, "r1", checkpoint=False)
    with pytest.raises(UserInputError) as exc:
        resolve_resume(dataclasses.replace(_auto(tmp_path), resume=str(d)))
    assert f"Start it again in that folder with --run-dir {d} --overwrite" in str(exc.value)


def test_disk_full_at_the_first_checkpoint_says_overwrite_and_it_works(
    tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch
):
    import errno

    import torch

    def full(obj, f, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=2,
                     run_dir=tmp_path / "r1", checkpoint_every=1)  # fmt: skip
    with pytest.raises(StorageError) as exc:
        run_finetune(spec)
    monkeypatch.undo()
    msg = " ".join(str(exc.value).split())
    assert (
        "No checkpoint was written yet; once that is fixed: Start it again in that folder "
        f"with --run-dir {tmp_path / 'r1'} --overwrite"
    ) in msg
    assert run_finetune(dataclasses.replace(spec, overwrite=True))["status"] == "finished"


# ---------------------------------------------------------------- paths


def test_a_run_with_relative_paths_resumes_from_another_folder(
    tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch
):
    """Old: config.json kept the model folder as typed ("../tiny-gpt2"), so a resume from
    another folder was refused as a change of model."""
    a, b = tmp_path / "a", tmp_path / "b" / "deeper"
    a.mkdir()
    b.mkdir(parents=True)
    monkeypatch.chdir(a)
    spec = make_spec(os.path.relpath(tiny_gpt2_dir), os.path.relpath(sample_dir), "runs",
                     engine_mode="device", max_steps=2, run_dir="r1")  # fmt: skip
    run_finetune(spec)
    monkeypatch.chdir(b)  # the same model, named as it is from here
    here = {"model": os.path.relpath(tiny_gpt2_dir), "resume": os.path.relpath(a / "r1")}
    resumed = dataclasses.replace(spec, data_dir=None, run_dir=None, max_steps=3, **here)
    assert run_finetune(resumed)["steps"] == 3
    saved = runs.run_config(a / "r1")["run"]  # kept absolute: the next resume works too
    assert saved["model"] == str(tiny_gpt2_dir) and saved["data_dir"] == str(sample_dir)
    absolute = {"model": str(tiny_gpt2_dir), "data_dir": str(sample_dir), "run_dir": b / "s"}
    straight = run_finetune(dataclasses.replace(spec, max_steps=3, **absolute))
    assert losses(a / "r1") == losses(straight["run_dir"])


def test_a_moved_data_file_with_the_same_sha256_resumes(tiny_gpt2_dir, tmp_path):
    """Old: refused as a change of "task" (the name a --data run takes from its file) and of
    data_file, though the rows were the same."""
    first, moved = tmp_path / "reviews.csv", tmp_path / "moved" / "reviews-2025.csv"
    first.write_text(CSV)
    spec = make_spec(
        tiny_gpt2_dir,
        None,
        tmp_path,
        engine_mode="device",
        max_steps=2,
        task=data_run_name(first),
        data_file=str(first),
        run_dir=tmp_path / "r1",
    )
    spec = dataclasses.replace(spec, data_dir=None)
    run_finetune(spec)
    moved.parent.mkdir()
    first.rename(moved)
    seen = []
    given = {"task": data_run_name(moved), "data_file": str(moved), "run_dir": None}
    resumed = dataclasses.replace(spec, resume=str(tmp_path / "r1"), max_steps=3, **given)
    assert run_finetune(resumed, seen.append)["steps"] == 3
    (header,) = [e.header for e in seen if isinstance(e, RunStarted)]
    assert (
        f"--data {first} moved to {moved} (the same sha256 the run saved); read there"
        in (header["notes"])
    )
    saved = runs.run_config(tmp_path / "r1")
    assert saved["run"]["task"] == "reviews" and saved["run"]["data_file"] == str(moved)
    # Moved back under another name and edited: refused, naming the file.
    edited = tmp_path / "edited.csv"
    edited.write_text(CSV + "one more,1\n")
    with pytest.raises(UserInputError, match="data_file: run has"):
        run_finetune(dataclasses.replace(resumed, data_file=str(edited), max_steps=4))
    # Not given, and gone from where the run read it: the message says how to pass it.
    moved.unlink()
    with pytest.raises(UserInputError) as exc:
        run_finetune(dataclasses.replace(resumed, data_file=None, task=None, max_steps=4))
    msg = str(exc.value)
    assert f"the run's --data file {moved} is not there any more" in msg
    assert "--data NEW_PATH" in msg


# ---------------------------------------------------------------- divergence


def test_divergence_names_the_checkpoint_and_a_command_that_goes_on(
    tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch, cli
):
    """Old: the message named no command, and a resume with a lower --lr was refused as a
    change of settings."""
    import zenflow.train.models

    real = zenflow.train.models.resolve_model
    forwards = {"n": 0}

    def nan_late(module, args, output):
        forwards["n"] += 1
        return output * math.nan if forwards["n"] >= 3 else None  # from step 3 on

    def hooked(*a, **kw):
        r = real(*a, **kw)
        r.model.score.register_forward_hook(nan_late)
        return r

    monkeypatch.setattr(zenflow.train.models, "resolve_model", hooked)
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=9,
                     checkpoint_every=1, run_dir=tmp_path / "r1")  # fmt: skip
    with pytest.raises(RunDiverged) as exc:
        run_finetune(spec)
    monkeypatch.undo()
    err = exc.value
    ckpt = tmp_path / "r1" / runs.CHECKPOINT_DIR / "step-0000002.pt"
    assert err.checkpoint == ckpt and err.resume_command is not None
    assert f"The last good checkpoint, {ckpt}, is kept" in str(err)
    assert f"Go on from that checkpoint at a tenth of the lr with: {err.resume_command}" in str(err)
    args = shlex.split(err.resume_command)
    assert args[:2] == ["zfctl", "finetune"] and args[args.index("--lr") + 1] == "0.0001"
    r = cli(*args[1:], "--json")
    assert r.exit_code == 0, r.output
    summary = runs.read_json(tmp_path / "r1" / runs.SUMMARY_FILE)
    assert summary["status"] == "finished" and summary["steps"] == 9
    assert runs.run_config(tmp_path / "r1")["run"]["lr"] == 0.0001
