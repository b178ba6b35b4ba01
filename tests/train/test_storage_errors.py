"""A write that fails mid-run (issue 10 item 5): one StorageError naming the path, the reason
and the free space, no temp file left, the last good checkpoint kept and resumable exactly.
Here the disk is made full by the writer (ENOSPC from torch.save or the metrics file);
tests/cli/test_full_disk.py fills a real tmpfs."""

from __future__ import annotations

import dataclasses
import errno
import io
from pathlib import Path

import pytest
import torch
from trainhelp import assert_same_params, final_model, losses, make_spec

from zenflow.errors import StorageError
from zenflow.train import runs
from zenflow.train.trainer import run_finetune


@pytest.fixture(scope="module")
def straight(tiny_gpt2_dir, sample_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    s = run_finetune(make_spec(tiny_gpt2_dir, sample_dir, root, engine_mode="device",
                               max_steps=6))  # fmt: skip
    return losses(s["run_dir"]), final_model(s["run_dir"])


def _temp_files(run_dir: Path) -> list[str]:
    return [p.name for p in Path(run_dir).rglob("*") if p.name.endswith(".tmp")]


def test_disk_full_during_a_checkpoint(tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch, straight):
    real_save = torch.save
    calls = {"n": 0}

    def save_until_full(obj, f, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # the step-4 checkpoint: half of it fits
            buf = io.BytesIO()
            real_save(obj, buf)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save_until_full)
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=6,
                     checkpoint_every=2)  # fmt: skip
    with pytest.raises(StorageError) as exc:
        run_finetune(spec)
    monkeypatch.undo()
    run_dir = runs.latest_run(tmp_path)
    kept = run_dir / runs.CHECKPOINT_DIR / "step-0000002.pt"
    msg = str(exc.value)
    assert msg.startswith(
        f"cannot write checkpoint {run_dir}/checkpoints/step-0000004.pt: No space left on device"
    )
    assert " free on " in msg
    assert f"The last good checkpoint, {kept}, is kept" in msg
    assert f"continue with: zfctl finetune {tiny_gpt2_dir} --task sst2 --resume {run_dir}" in msg
    assert _temp_files(run_dir) == [] and runs.checkpoints(run_dir) == [kept]

    ref_losses, ref_params = straight
    s = run_finetune(dataclasses.replace(spec, resume=str(run_dir)))
    assert s["steps"] == 6 and losses(run_dir) == ref_losses
    assert_same_params(final_model(run_dir), ref_params)


def test_disk_full_writing_metrics(tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch):
    from zenflow.train.metrics import MetricsLog

    real = MetricsLog.write

    def full_at_step_3(self, record):
        if record.get("step") == 3:
            self.file.write = _raise_enospc
        real(self, record)

    monkeypatch.setattr(MetricsLog, "write", full_at_step_3)
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=6,
                     checkpoint_every=1)  # fmt: skip
    with pytest.raises(StorageError) as exc:
        run_finetune(spec)
    run_dir = runs.latest_run(tmp_path)
    msg = str(exc.value)
    assert msg.startswith(f"cannot write {run_dir / runs.METRICS_FILE}: No space left on device")
    assert f"The last good checkpoint, {run_dir}/checkpoints/step-0000002.pt, is kept" in msg


def _raise_enospc(_text):
    raise OSError(errno.ENOSPC, "No space left on device")
