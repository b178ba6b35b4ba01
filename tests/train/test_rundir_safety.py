"""Run directories are never silently reused or shared (issue 10 items 1-3): a directory that
holds a run needs --resume or --overwrite; a folder that is not a zfctl run is never written
into unless empty, nor cleared (issue 19); one process at a time (an flock, which a dead
process does not keep); resuming a finished run does nothing, and a run stopped during its
final save is completed."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import pytest
from trainhelp import assert_same_params, final_model, losses, make_spec

from zenflow.errors import UserInputError
from zenflow.train import runs
from zenflow.train.events import RunAlreadyFinished, RunFinished, RunStarted
from zenflow.train.trainer import _Run, run_finetune


def _files(run_dir) -> dict:
    """Every file under run_dir (lock excluded) -> its bytes."""
    out = {}
    for root, _, names in os.walk(run_dir):
        for n in names:
            if n != runs.LOCK_FILE:
                p = os.path.join(root, n)
                out[os.path.relpath(p, run_dir)] = open(p, "rb").read()
    return out


# ------------------------------------------------------------ item 1: --run-dir, --overwrite


def test_run_dir_holding_a_run_is_refused_and_kept(tiny_gpt2_dir, sample_dir, tmp_path):
    run_dir = tmp_path / "r1"
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=3,
                     run_dir=run_dir)  # fmt: skip
    run_finetune(spec)
    before = _files(run_dir)
    with pytest.raises(UserInputError) as exc:
        run_finetune(dataclasses.replace(spec, max_steps=2, seed=7))
    msg = str(exc.value)
    assert f"--run-dir {run_dir} already holds a run" in msg
    assert f"--resume {run_dir}" in msg and "--overwrite" in msg
    assert _files(run_dir) == before  # nothing touched: metrics, config, checkpoints, model


def test_overwrite_starts_clean_and_removes_only_run_files(tiny_gpt2_dir, sample_dir, tmp_path):
    run_dir = tmp_path / "r1"
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=4,
                     run_dir=run_dir, checkpoint_every=1)  # fmt: skip
    run_finetune(spec)
    (run_dir / "my-notes.txt").write_text("keep me", encoding="utf-8")
    (run_dir / runs.HW_FILE).write_text('{"old": true}', encoding="utf-8")
    new = dataclasses.replace(spec, max_steps=2, seed=7, checkpoint_every=None, overwrite=True)
    s = run_finetune(new)
    run = runs.read_run(run_dir)
    assert s["steps"] == 2 and [m["step"] for m in run["metrics"]] == [1, 2]
    assert run["summary"]["steps"] == 2 and run["config"]["run"]["seed"] == 7
    assert [p.name for p in runs.checkpoints(run_dir)] == ["step-0000002.pt"]
    assert run["hw"] is None  # the old run's hw.json went with it
    assert (run_dir / "my-notes.txt").read_text(encoding="utf-8") == "keep me"
    # The new run alone: its losses are those of a fresh run with seed 7.
    fresh = run_finetune(dataclasses.replace(new, run_dir=tmp_path / "fresh", overwrite=False))
    assert losses(run_dir) == losses(fresh["run_dir"])


# The user's own files inside a run's model/ and checkpoints/ (issue 31 item 2).
USERS_FILES = {
    "model/my_adapter.bin": b"adapter",
    "checkpoints/my-best.pt": b"best",
    "checkpoints/step-0000099.pt.bak": b"backup",
}


def test_overwrite_keeps_the_users_files_in_model_and_checkpoints(
    tiny_gpt2_dir, sample_dir, tmp_path
):
    """Issue 31 item 2: --overwrite removed model/ and checkpoints/ whole, the user's files
    in them too, though the help said "your other files stay"."""
    run_dir = tmp_path / "r1"
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=2,
                     run_dir=run_dir)  # fmt: skip
    run_finetune(spec)
    for name, data in USERS_FILES.items():
        (run_dir / name).write_bytes(data)
    seen = []
    s = run_finetune(dataclasses.replace(spec, max_steps=1, seed=7, overwrite=True), seen.append)
    assert s["steps"] == 1
    for name, data in USERS_FILES.items():
        assert (run_dir / name).read_bytes() == data, name
    assert [p.name for p in runs.checkpoints(run_dir)] == ["step-0000001.pt"]  # step 2 gone
    (header,) = [e.header for e in seen if isinstance(e, RunStarted)]
    (note,) = [n for n in header["notes"] if n.startswith("--overwrite")]
    assert note == (
        "--overwrite removed the old run's files and kept 3 that zfctl did not write: "
        "checkpoints/my-best.pt, checkpoints/step-0000099.pt.bak, model/my_adapter.bin"
    )


def test_clear_run_removes_only_the_files_zfctl_wrote_inside_model_and_checkpoints(
    tiny_gpt2_dir, tmp_path
):
    """What save_model writes (the model and its tokenizer) and every checkpoint file
    (shards and a killed write's temp file) goes; everything else stays, with its folder."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from zenflow.train.models import save_model

    run_dir = tmp_path / "r1"
    runs.write_json_atomic(run_dir / runs.CONFIG_FILE, {runs.RUN_MARK: runs.RUN_FORMAT})
    model = AutoModelForSequenceClassification.from_pretrained(tiny_gpt2_dir)
    save_model(model, AutoTokenizer.from_pretrained(tiny_gpt2_dir), run_dir / runs.MODEL_DIR)
    saved = sorted(os.listdir(run_dir / runs.MODEL_DIR))
    assert "model.safetensors" in saved and "tokenizer_config.json" in saved
    assert all(runs.is_our_model_file(n) for n in saved), saved  # every name save_model writes
    ckpt = run_dir / runs.CHECKPOINT_DIR
    ckpt.mkdir()
    ours = ["step-0000004.pt", "step-0000004.rank-1.pt", ".step-0000006.pt.tmp"]
    for name in ours:
        (ckpt / name).write_bytes(b"x")
    for name, data in USERS_FILES.items():
        (run_dir / name).write_bytes(data)
    (ckpt / "best").mkdir()  # a folder of the user's, whatever its name
    (ckpt / "best" / "step-0000001.pt").write_bytes(b"mine")
    kept: list[str] = []
    removed = runs.clear_run(run_dir, kept)
    assert kept == ["checkpoints/best", "checkpoints/my-best.pt",
                    "checkpoints/step-0000099.pt.bak", "model/my_adapter.bin"]  # fmt: skip
    assert sorted(os.listdir(run_dir / runs.MODEL_DIR)) == ["my_adapter.bin"]
    assert sorted(os.listdir(ckpt)) == ["best", "my-best.pt", "step-0000099.pt.bak"]
    assert (ckpt / "best" / "step-0000001.pt").read_bytes() == b"mine"
    assert removed == [runs.CONFIG_FILE]  # the folders stay: they hold the user's files
    # Without the user's files, the folders go too.
    for name in USERS_FILES:
        (run_dir / name).unlink()
    (ckpt / "best" / "step-0000001.pt").unlink()
    (ckpt / "best").rmdir()
    runs.write_json_atomic(run_dir / runs.CONFIG_FILE, {runs.RUN_MARK: runs.RUN_FORMAT})
    assert runs.clear_run(run_dir) == [runs.CHECKPOINT_DIR, runs.MODEL_DIR, runs.CONFIG_FILE]
    assert sorted(os.listdir(run_dir)) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_model_folder_as_run_dir_is_refused_and_untouched(
    overwrite, model_folder, tiny_gpt2_dir, sample_dir, tmp_path
):
    """Issue 19: the old code said a model folder "already holds a run" (it has a
    config.json), and with --overwrite deleted the model's config.json and wrote its own."""
    model = model_folder.path
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=1,
                     run_dir=model, overwrite=overwrite)  # fmt: skip
    with pytest.raises(UserInputError) as exc:
        run_finetune(spec)
    msg = str(exc.value)
    assert msg.startswith(
        f"--run-dir {model} is not a zfctl run (its config.json was not written by zfctl) and "
        "is not empty (it holds config.json, metrics.jsonl, model.safetensors, "
        "special_tokens_map.json, tokenizer.json, tokenizer_config.json)"
    )
    assert msg.endswith("Choose an empty or new folder for --run-dir.")
    assert "already holds a run" not in msg
    assert ("nothing was removed" in msg) == overwrite
    assert model_folder.unchanged()  # every file as it was, and no lock file added


def test_a_folder_of_other_files_is_refused_an_empty_one_taken(tiny_gpt2_dir, sample_dir, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=1,
                     run_dir=notes)  # fmt: skip
    with pytest.raises(UserInputError, match=r"not empty \(it holds notes.txt\)"):
        run_finetune(spec)
    assert os.listdir(notes) == ["notes.txt"]
    # --overwrite of an empty (or new) folder has nothing to remove: the run starts there.
    for run_dir in (tmp_path / "empty", tmp_path / "new"):
        if run_dir.name == "empty":
            run_dir.mkdir()
        s = run_finetune(dataclasses.replace(spec, run_dir=run_dir, overwrite=True))
        assert s["status"] == "finished" and runs.holds_run(run_dir)
        assert runs.run_config(run_dir)[runs.RUN_MARK] == runs.RUN_FORMAT


def test_overwrite_with_resume_or_without_run_dir_is_refused(tiny_gpt2_dir, sample_dir, tmp_path):
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=1)
    with pytest.raises(UserInputError, match="--overwrite and --resume contradict"):
        run_finetune(dataclasses.replace(spec, overwrite=True, resume="auto"))
    with pytest.raises(UserInputError, match="--overwrite needs --run-dir"):
        run_finetune(dataclasses.replace(spec, overwrite=True))


# ------------------------------------------------------------------- item 2: the lock

HOLD_LOCK = """
import sys, time
from zenflow.train.runs import RunDirLock
lock = RunDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _hold_lock(run_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_lock_refuses_a_second_process_and_dies_with_its_holder(
    tiny_gpt2_dir, sample_dir, tmp_path
):
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=2,
                     run_dir=run_dir)  # fmt: skip
    holder = _hold_lock(run_dir)
    try:
        with pytest.raises(UserInputError) as exc:
            run_finetune(spec)
        assert f"run dir {run_dir} in use by PID {holder.pid}" in str(exc.value)
        assert not runs.holds_run(run_dir)  # refused before writing anything
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    # The holder died without cleaning up: its lock file (with its PID) is still there, and
    # must not block anyone.
    assert (run_dir / runs.LOCK_FILE).read_text().strip() == str(holder.pid)
    s = run_finetune(spec)
    assert s["status"] == "finished" and s["steps"] == 2


def test_resume_of_a_run_in_use_is_refused(tiny_gpt2_dir, sample_dir, tmp_path):
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=2)
    first = run_finetune(spec)
    holder = _hold_lock(first["run_dir"])
    try:
        with pytest.raises(UserInputError, match=f"in use by PID {holder.pid}"):
            run_finetune(dataclasses.replace(spec, resume="auto", max_steps=3))
    finally:
        holder.kill()
        holder.wait(timeout=60)


def test_lock_is_released_after_an_error_in_the_same_process(tiny_gpt2_dir, sample_dir, tmp_path):
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=1,
                     run_dir=run_dir, seq_len=1000)  # fmt: skip
    with pytest.raises(UserInputError, match="--seq-len 1000"):
        run_finetune(spec)
    s = run_finetune(dataclasses.replace(spec, seq_len=16))  # not blocked by our own lock
    assert s["steps"] == 1


# ---------------------------------------------- item 3: finished runs, interrupted endings


def test_resume_of_a_finished_run_does_nothing(tiny_gpt2_dir, sample_dir, tmp_path):
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, max_steps=3)  # zenflow engine
    first = run_finetune(spec)
    before = _files(first["run_dir"])
    events = []
    s = run_finetune(dataclasses.replace(spec, resume="auto"), events.append)
    assert [type(e) for e in events] == [RunAlreadyFinished]
    assert s == events[0].summary and s["steps"] == 3 and s["status"] == "finished"
    assert _files(first["run_dir"]) == before


class _Killed(BaseException):
    """Stands in for SIGKILL: nothing of the run's own handling runs after it."""


@pytest.mark.parametrize("mode", ["device", "zenflow"])
@pytest.mark.parametrize("killed_in", ["model save", "summary write"])
def test_run_stopped_during_its_final_save_is_completed(
    mode, killed_in, tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch
):
    straight = run_finetune(
        make_spec(tiny_gpt2_dir, sample_dir, tmp_path / "a", engine_mode=mode, max_steps=3)
    )
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path / "b", engine_mode=mode, max_steps=3)
    if killed_in == "model save":

        def killed(self):
            (self.run_dir / runs.MODEL_DIR).mkdir()
            (self.run_dir / runs.MODEL_DIR / "config.json").write_text("{")  # half written
            raise _Killed

        monkeypatch.setattr(_Run, "save_final_model", killed)
    else:
        real = runs.write_json_atomic

        def killed(path, obj):
            if path.name == runs.SUMMARY_FILE:
                raise _Killed
            real(path, obj)

        monkeypatch.setattr(runs, "write_json_atomic", killed)
    with pytest.raises(_Killed):
        run_finetune(spec)
    monkeypatch.undo()
    run_dir = runs.latest_run(tmp_path / "b")
    assert runs.checkpoint_step(runs.latest_checkpoint(run_dir)) == 3
    assert not (run_dir / runs.SUMMARY_FILE).exists()

    events = []
    s = run_finetune(dataclasses.replace(spec, resume=str(run_dir)), events.append)
    assert isinstance(events[0], RunStarted) and events[0].header["start_step"] == 3
    assert isinstance(events[-1], RunFinished) and s["status"] == "finished"
    run = runs.read_run(run_dir)
    assert run["summary"]["steps"] == 3
    assert losses(run_dir) == losses(straight["run_dir"])
    assert [e["step"] for e in run["evals"]] == [3]  # the final evaluation once, not twice
    assert run["evals"] == runs.read_run(straight["run_dir"])["evals"]
    # The saved model is complete and equals the uninterrupted run's.
    from transformers import AutoModelForSequenceClassification

    done = AutoModelForSequenceClassification.from_pretrained(run_dir / runs.MODEL_DIR)
    ref = AutoModelForSequenceClassification.from_pretrained(
        runs.latest_run(tmp_path / "a") / runs.MODEL_DIR
    )
    assert_same_params(done.state_dict(), ref.state_dict())
    assert_same_params(final_model(run_dir), final_model(straight["run_dir"]))
