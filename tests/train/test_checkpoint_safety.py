"""Checkpoints are data, not code, and a bad one never ends a run's history (issue 10 items 6,
8 and 9; issue 8 item 4): weights_only loading refuses pickled objects without running them;
an unreadable newest checkpoint falls back to the newest readable one and says so; the
config is not copied into checkpoints; RNG states per device type; host snapshots."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
import torch
from trainhelp import CONFIG, assert_same_params, final_model, losses, make_spec

from zenflow.config import load_config
from zenflow.errors import CheckpointError, UserInputError
from zenflow.train import checkpointing, runs
from zenflow.train.events import RunStarted
from zenflow.train.trainer import run_finetune

MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / "zfctl-test-pickle-ran-code"


class Payload:
    """Unpickling this runs code: it creates MARKER (what a hostile checkpoint would do)."""

    def __reduce__(self):
        return (Path.touch, (MARKER,))


def _crafted_checkpoint(path: Path, like: Path) -> None:
    """A checkpoint that looks right (format, step, model...) but carries a Payload."""
    state = torch.load(like, weights_only=True)
    state["step"] += 1
    state["position"]["payload"] = Payload()
    torch.save(state, path)


@pytest.fixture
def marker():
    MARKER.unlink(missing_ok=True)
    yield MARKER
    MARKER.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def straight_device(tiny_gpt2_dir, sample_dir, tmp_path_factory):
    """An uninterrupted 6-step device-mode run: (losses, final weights)."""
    root = tmp_path_factory.mktemp("straight")
    s = run_finetune(make_spec(tiny_gpt2_dir, sample_dir, root, engine_mode="device",
                               max_steps=6))  # fmt: skip
    return losses(s["run_dir"]), final_model(s["run_dir"])


# ------------------------------------------------------------ item 9: checkpoints are data


def test_checkpoint_is_plain_data_without_the_config(tiny_gpt2_dir, sample_dir, tmp_path):
    """A real checkpoint loads with weights_only=True; it keeps a digest of the config, not
    the config: a 1 MB config makes it no bigger."""
    sizes = {}
    for name, extra in (("small", {}), ("big", {"comment": "x" * 2**20})):
        cfg = {**CONFIG, **extra}
        s = run_finetune(make_spec(tiny_gpt2_dir, sample_dir, tmp_path / name, config=cfg,
                                   engine_mode="zenflow", max_steps=2))  # fmt: skip
        ckpt = runs.latest_checkpoint(s["run_dir"])
        state = torch.load(ckpt, weights_only=True)
        assert "run" not in state and len(state["config_sha256"]) == 64
        assert isinstance(state["rng"]["python"]["state"], list)
        assert set(state["rng"]) == {"cpu", "python"}  # no CUDA here
        sizes[name] = ckpt.stat().st_size
        cfg_json = runs.read_run(s["run_dir"])["config"]
        assert cfg_json["run"]["config_input"].get("comment", "") == extra.get("comment", "")
    assert abs(sizes["big"] - sizes["small"]) < 4096, sizes


@pytest.mark.parametrize("resume_from", ["file", "run dir"])
def test_crafted_checkpoint_is_refused_not_executed(
    resume_from, tiny_gpt2_dir, sample_dir, tmp_path, marker
):
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=2)
    s = run_finetune(spec)
    run_dir = Path(s["run_dir"])
    evil = run_dir / runs.CHECKPOINT_DIR / "step-0000003.pt"  # the newest
    _crafted_checkpoint(evil, runs.latest_checkpoint(run_dir))
    # The payload works when unpickled the old way (so the test would see it run):
    torch.load(evil, weights_only=False)
    assert marker.exists()
    marker.unlink()

    target = str(evil) if resume_from == "file" else str(run_dir)
    with pytest.raises(CheckpointError) as exc:
        run_finetune(dataclasses.replace(spec, resume=target, max_steps=4))
    assert f"{evil} holds Python objects" in str(exc.value)
    assert "could run code" in str(exc.value) and "nothing in it was executed" in str(exc.value)
    assert not marker.exists()
    assert len(losses(run_dir)) == 2  # the run is left as it was


# --------------------------------------------------- item 6: an unreadable newest checkpoint


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def test_corrupt_newest_checkpoint_falls_back_and_says_so(
    tiny_gpt2_dir, sample_dir, tmp_path, straight_device
):
    ref_losses, ref_params = straight_device
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=4,
                     checkpoint_every=1)  # fmt: skip
    run_dir = Path(run_finetune(spec)["run_dir"])
    newest, older = runs.checkpoints(run_dir)[::-1]
    assert newest.name == "step-0000004.pt" and older.name == "step-0000003.pt"
    _truncate(newest)

    events = []
    s = run_finetune(dataclasses.replace(spec, resume="auto", max_steps=6), events.append)
    header = next(e for e in events if isinstance(e, RunStarted)).header
    assert header["start_step"] == 3 and header["resumed_from"] == str(older)
    # the header's other notes count the data's rows; exactly one speaks of the checkpoint
    (note,) = [n for n in header["notes"] if "checkpoint" in n]
    assert f"Cannot read checkpoint {newest}" in note and "instead" in note and str(older) in note
    assert s["steps"] == 6
    assert losses(run_dir) == ref_losses  # steps 4-6 redone, exactly
    assert_same_params(final_model(run_dir), ref_params)


def test_corrupt_named_checkpoint_names_the_one_to_use(tiny_gpt2_dir, sample_dir, tmp_path):
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=2,
                     checkpoint_every=1)  # fmt: skip
    run_dir = Path(run_finetune(spec)["run_dir"])
    newest, older = runs.checkpoints(run_dir)[::-1]
    _truncate(newest)
    with pytest.raises(CheckpointError) as exc:
        run_finetune(dataclasses.replace(spec, resume=str(newest), max_steps=3))
    msg = str(exc.value)
    assert f"Cannot read checkpoint {newest}" in msg and f"--resume {older}" in msg
    _truncate(older)
    with pytest.raises(CheckpointError) as exc:
        run_finetune(dataclasses.replace(spec, resume=str(run_dir), max_steps=3))
    msg = str(exc.value)
    assert msg.startswith("No readable checkpoint to resume from")
    assert str(newest) in msg and str(older) in msg and "--overwrite" in msg


def test_checkpoint_of_an_edited_config_is_refused(tiny_gpt2_dir, sample_dir, tmp_path):
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=1)
    run_dir = Path(run_finetune(spec)["run_dir"])
    cfg = json.loads((run_dir / runs.CONFIG_FILE).read_text())
    cfg["run"]["config_input"]["optimizer"]["params"]["lr"] = 0.5
    (run_dir / runs.CONFIG_FILE).write_text(json.dumps(cfg))
    edited = load_config(cfg["run"]["config_input"])  # as `--config edited.json` gives it
    with pytest.raises(UserInputError, match="written with a different config"):
        run_finetune(dataclasses.replace(spec, resume=str(run_dir), max_steps=2, config=edited))


def test_foreign_or_old_file_is_refused(tmp_path):
    path = tmp_path / "step-0000001.pt"
    torch.save({"format": 1, "step": 1}, path)  # an older zfctl's layout
    with pytest.raises(CheckpointError, match="not a zfctl checkpoint of format 2 .found 1."):
        checkpointing.read_checkpoint(torch, path)
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="found 'list'"):
        checkpointing.read_checkpoint(torch, path)


# ------------------------------------------------- resume on any device (issue 8 item 4)


def test_rng_state_round_trip_is_plain_and_exact():
    dev = torch.device("cpu")
    torch.manual_seed(3)
    random.seed(3)
    state = checkpointing.rng_state(torch, dev)
    expect_t, expect_p = torch.rand(4), [random.random() for _ in range(3)]
    torch.rand(100), random.random()  # move both on
    checkpointing.set_rng_state(torch, dev, state)
    assert torch.equal(torch.rand(4), expect_t)
    assert [random.random() for _ in range(3)] == expect_p


class _FakeCuda:
    """torch.cuda's documented RNG API, recorded (no GPU here): get_rng_state_all() returns
    one CPU ByteTensor per device; set_rng_state(state, device_index)."""

    def __init__(self, n: int):
        self.n = n
        self.states = [torch.full((8,), i, dtype=torch.uint8) for i in range(n)]
        self.set_calls: list = []

    def get_rng_state_all(self):
        return [s.clone() for s in self.states]

    def set_rng_state(self, state, device):
        assert state.device.type == "cpu"
        self.set_calls.append((device, state.clone()))

    def device_count(self):
        return self.n


class _TorchWithFakeCuda:
    def __init__(self, n: int):
        self.cuda = _FakeCuda(n)

    def __getattr__(self, name):
        return getattr(torch, name)


def test_cuda_rng_states_are_saved_per_device_and_restored_to_those_present():
    saving = _TorchWithFakeCuda(2)
    state = checkpointing.rng_state(saving, torch.device("cuda", 0))
    assert [s.tolist() for s in state["cuda"]] == [[0] * 8, [1] * 8]
    resuming = _TorchWithFakeCuda(1)  # a machine with one GPU resumes it
    checkpointing.set_rng_state(resuming, torch.device("cuda", 0), state)
    assert [(d, s.tolist()) for d, s in resuming.cuda.set_calls] == [(0, [0] * 8)]
    on_cpu = _TorchWithFakeCuda(0)  # resumed on the CPU: the CUDA states are not used
    checkpointing.set_rng_state(on_cpu, torch.device("cpu"), state)
    assert on_cpu.cuda.set_calls == []


def test_final_checkpoint_is_written_before_the_flush_from_the_engines_state(
    tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch
):
    """The end-of-run checkpoint is the engine as an uninterrupted longer run would have it:
    written before the final flush changes the host state, and before the final evaluation.
    Every checkpoint, periodic ones included, is written straight from the host state (no
    second copy of the optimizer state in host memory). The host state is released after
    the evaluation and before the final model is saved (issue 27)."""
    import inspect

    from zenflow import ZenFlowEngine
    from zenflow.train import trainer
    from zenflow.train.resume import RunCheckpoints

    order, shared = [], []
    real_state = RunCheckpoints.state
    default = inspect.signature(real_state).parameters["share_host"].default
    spied = {
        (RunCheckpoints, "save"): "save",
        (ZenFlowEngine, "flush"): "flush",
        (trainer._Run, "evaluate"): "eval",
        (ZenFlowEngine, "release_host_state"): "release",
        (trainer._Run, "save_final_model"): "model",
    }

    def state_spy(self, *a, **kw):
        shared.append(kw.get("share_host", default))
        return real_state(self, *a, **kw)

    def spy(name, real):
        def wrapper(self, *a, **kw):
            order.append(name)
            return real(self, *a, **kw)

        return wrapper

    monkeypatch.setattr(RunCheckpoints, "state", state_spy)
    for (cls, attr), name in spied.items():
        monkeypatch.setattr(cls, attr, spy(name, getattr(cls, attr)))
    run_finetune(make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="zenflow",
                           max_steps=3, checkpoint_every=1))  # fmt: skip
    assert order[-5:] == ["save", "flush", "eval", "release", "model"]
    # the periodic checkpoints (every step) and the final one: each shares the host state
    assert len(shared) == order.count("save") >= 3 and all(shared), shared


# ------------------------------------------------------------- permissions (issue 31)


@pytest.mark.parametrize("umask", [0o022, 0o007])
def test_run_files_honour_the_umask(umask, tiny_gpt2_dir, sample_dir, tmp_path):
    """Old: every file of the atomic writer (config.json, summary.json, hw.json, the
    metrics file cut back at a resume) was 0600 whatever the umask, so a teammate could not
    `zfctl report` the run. Now 0666 less the umask, as for any new file; a rewritten
    file keeps the permissions it has."""
    (tmp_path / runs.HW_FILE).write_text('{"cpu": {}}')  # ./hw.json: copied into the run
    run_dir = tmp_path / "r1"
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=2,
                     checkpoint_every=1, run_dir=run_dir)  # fmt: skip
    old = os.umask(umask)
    try:
        run_finetune(spec)
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    names = [
        runs.CONFIG_FILE,
        runs.SUMMARY_FILE,
        runs.HW_FILE,
        runs.METRICS_FILE,
        f"{runs.CHECKPOINT_DIR}/step-0000001.pt",
        f"{runs.CHECKPOINT_DIR}/step-0000002.pt",
    ]
    modes = {n: oct((run_dir / n).stat().st_mode & 0o777) for n in names}
    assert modes == dict.fromkeys(names, oct(want))  # fmt: skip
    # A file that is there keeps its own permissions when zfctl writes it again.
    (run_dir / runs.METRICS_FILE).chmod(0o640)
    run_finetune(dataclasses.replace(spec, resume=str(run_dir), run_dir=None, max_steps=3))
    assert (run_dir / runs.METRICS_FILE).stat().st_mode & 0o777 == 0o640
    assert (run_dir / runs.CONFIG_FILE).stat().st_mode & 0o777 == want
