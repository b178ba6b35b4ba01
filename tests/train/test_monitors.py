"""DeepSpeed's monitor blocks: a real run's TensorBoard events and CSV files hold exactly what
metrics.jsonl holds; a resumed run's logs do not repeat steps; W&B only when installed."""

from __future__ import annotations

import csv
import json
import sys
import types

import numpy as np
import pytest

from zenflow.config import load_config
from zenflow.engine.stats import StepStats
from zenflow.errors import UserInputError
from zenflow.train import runs
from zenflow.train.data import write_sst2_sample
from zenflow.train.events import EvalEvent, RunFinished, RunStarted, StepEvent
from zenflow.train.monitors import MonitorSink, csv_filename, eval_scalars, step_scalars
from zenflow.train.spec import RunSpec
from zenflow.train.trainer import run_finetune

BASE = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True},
    },
}


def _tb_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _csv_rows(path) -> tuple[list[str], list[tuple[int, str]]]:
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    return rows[0], [(int(r[0]), r[1]) for r in rows[1:]]


def _f32(x: float) -> float:
    """What TensorBoard stores: the value rounded to float32."""
    return float(np.float32(x))


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    return write_sst2_sample(tmp_path_factory.mktemp("sample"), n=24, n_dev=8)


def test_step_and_eval_scalars_are_the_events_values():
    stats = StepStats(
        step=3, lr=2e-5, loss=0.5, step_ms=10.0, forward_ms=4.0, backward_ms=5.0,
        device_opt_ms=1.5, stall_ms=0.25, transfer_ms=0.5, d2h_bytes=100, h2d_bytes=28,
        host_update=True, selection_changed=7, grad_norm=1.25, device_bytes=4096,
    )  # fmt: skip
    ev = StepEvent(stats, samples_per_s=8.0, tokens_per_s=128.0, progress=0.5, eta_s=1.0,
                   epoch=0.75, total_steps=6)  # fmt: skip
    t = "Train/Steps/"
    assert step_scalars(ev) == {
        t + "loss": 0.5, t + "lr": 2e-5, t + "step_ms": 10.0, t + "forward_ms": 4.0,
        t + "backward_ms": 5.0, t + "device_opt_ms": 1.5, t + "stall_ms": 0.25,
        t + "transfer_ms": 0.5, t + "d2h_bytes": 100, t + "h2d_bytes": 28,
        t + "host_update": 1, t + "selection_changed": 7, t + "grad_norm": 1.25,
        t + "bytes_per_step": 128, t + "samples_per_s": 8.0, t + "tokens_per_s": 128.0,
        t + "epoch": 0.75, t + "device_bytes": 4096,
    }  # fmt: skip
    # grad_norm absent (None) is not logged
    no_norm = StepEvent(StepStats(step=1, lr=0.1), 1.0, 2.0, 0.1, None, 0.1, 10)
    assert t + "grad_norm" not in step_scalars(no_norm)
    assert eval_scalars(EvalEvent(4, {"accuracy": 0.75, "eval_loss": 0.5, "eval_samples": 8})) == {
        "Eval/Steps/accuracy": 0.75, "Eval/Steps/eval_loss": 0.5, "Eval/Steps/eval_samples": 8,
    }  # fmt: skip
    assert csv_filename("Train/Steps/loss") == "Train_Steps_loss.csv"


def test_run_logs_equal_metrics_jsonl(tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch):
    cfg = load_config(
        {
            **BASE,
            "tensorboard": {"enabled": True},  # output_path "": inside the run directory
            "csv_monitor": {
                "enabled": True,
                "output_path": str(tmp_path / "csv"),
                "job_name": "job",
                "flush_every": 5,
            },  # fmt: skip
        }
    )
    assert cfg.ignored == ("csv_monitor.flush_every",)  # unknown keys reported, not fatal
    spec = RunSpec(
        model=str(tiny_gpt2_dir), task="sst2", config=cfg, data_dir=str(sample_dir), seq_len=16,
        runs_root=tmp_path / "runs", max_steps=6, eval_every=3, max_eval_samples=8,
    )  # fmt: skip
    monkeypatch.chdir(tmp_path)  # no ./hw.json to pick up
    summary = run_finetune(spec)
    run_dir = tmp_path / "runs" / next(p.name for p in (tmp_path / "runs").iterdir())
    assert summary["run_dir"] == str(run_dir)
    metrics = runs.read_metrics(run_dir / runs.METRICS_FILE)
    steps = [m for m in metrics if m["type"] == "step"]
    evals = [m for m in metrics if m["type"] == "eval"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6] and [m["step"] for m in evals] == [3, 6]

    tb = _tb_scalars(run_dir / "tensorboard" / run_dir.name)
    assert tb["Train/Steps/loss"] == [(m["step"], _f32(m["loss"])) for m in steps]
    assert tb["Train/Steps/lr"] == [(m["step"], _f32(m["lr"])) for m in steps]
    assert tb["Train/Steps/bytes_per_step"] == [
        (m["step"], _f32(m["d2h_bytes"] + m["h2d_bytes"])) for m in steps
    ]
    assert tb["Train/Steps/host_update"] == [(m["step"], float(m["host_update"])) for m in steps]
    assert tb["Train/Steps/samples_per_s"] == [(m["step"], _f32(m["samples_per_s"])) for m in steps]
    assert tb["Train/Steps/grad_norm"] == [(m["step"], _f32(m["grad_norm"])) for m in steps]
    assert tb["Eval/Steps/accuracy"] == [(m["step"], _f32(m["accuracy"])) for m in evals]
    assert tb["Eval/Steps/eval_loss"] == [(m["step"], _f32(m["eval_loss"])) for m in evals]
    assert any(m["host_update"] for m in steps)  # the run crossed a host window

    csv_dir = tmp_path / "csv" / "job"
    header, rows = _csv_rows(csv_dir / "Train_Steps_loss.csv")
    assert header == ["step", "loss"]
    assert [(s, float(v)) for s, v in rows] == [(m["step"], m["loss"]) for m in steps]  # exact
    header, rows = _csv_rows(csv_dir / "Eval_Steps_accuracy.csv")
    assert header == ["step", "accuracy"]
    assert [(s, float(v)) for s, v in rows] == [(m["step"], m["accuracy"]) for m in evals]
    header, rows = _csv_rows(csv_dir / "Train_Steps_stall_ms.csv")
    assert [(s, float(v)) for s, v in rows] == [(m["step"], m["stall_ms"]) for m in steps]
    # The run's config.json keeps the blocks, so a resumed run logs the same way.
    saved = json.loads((run_dir / runs.CONFIG_FILE).read_text())
    assert saved["csv_monitor"]["job_name"] == "job" and saved["tensorboard"]["enabled"] is True
    assert "tensorboard" not in saved["config_ignored"]


def _step(step: int, loss: float) -> StepEvent:
    return StepEvent(StepStats(step=step, lr=0.1, loss=loss), 4.0, 64.0, step / 5, None, 0.0, 5)


def test_resumed_run_drops_what_was_logged_after_its_checkpoint(tmp_path):
    cfg = load_config({"tensorboard": {"enabled": True}, "csv_monitor": {"enabled": True}})
    run_dir = tmp_path / "run"
    first = MonitorSink(cfg.monitor)
    first(RunStarted({"run_dir": str(run_dir), "start_step": 0}))
    for s in (1, 2, 3, 4):  # killed after step 4; the last checkpoint is at step 2
        first(_step(s, 1.0 + s))
    first(EvalEvent(2, {"accuracy": 0.5}))
    first.close()
    second = MonitorSink(cfg.monitor)
    second(RunStarted({"run_dir": str(run_dir), "start_step": 2}))
    for s in (3, 4, 5):
        second(_step(s, 10.0 + s))
    second(RunFinished({}))
    second.close()

    want = [(1, 2.0), (2, 3.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    _, rows = _csv_rows(run_dir / "csv_monitor" / "run" / "Train_Steps_loss.csv")
    assert [(s, float(v)) for s, v in rows] == want
    _, rows = _csv_rows(run_dir / "csv_monitor" / "run" / "Eval_Steps_accuracy.csv")
    assert rows == [(2, "0.5")]  # at the checkpoint's step: kept
    assert _tb_scalars(run_dir / "tensorboard" / "run")["Train/Steps/loss"] == want


def test_nothing_enabled_does_nothing(tmp_path):
    sink = MonitorSink(load_config({"tensorboard": {"enabled": False}}).monitor)

    def render(event):
        pass

    assert sink.tee(render) is render  # no wrapper at all
    sink(RunStarted({"run_dir": str(tmp_path), "start_step": 0}))
    sink(_step(1, 1.0))
    assert list(tmp_path.iterdir()) == []


class _FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logs, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        return object()

    def log(self, data, step=None):
        self.logs.append((step, data))

    def finish(self):
        self.finished += 1


def test_wandb_logs_offline_when_installed(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config({"wandb": {"enabled": True, "project": "p", "group": "g", "team": "t"}})
    sink = MonitorSink(cfg.monitor)
    sink(RunStarted({"run_dir": str(tmp_path / "r"), "start_step": 0, "model": "m"}))
    sink(_step(1, 0.5))
    sink(EvalEvent(1, {"accuracy": 0.75}))
    sink.close()
    (init,) = fake.inits
    assert init["mode"] == "offline" and init["project"] == "p" and init["group"] == "g"
    assert init["entity"] == "t" and init["name"] == "r" and init["config"]["model"] == "m"
    assert fake.logs[0][0] == 1 and fake.logs[0][1]["Train/Steps/loss"] == 0.5
    assert fake.logs[1] == (1, {"Eval/Steps/accuracy": 0.75})
    assert fake.finished == 1


def test_wandb_missing_stops_before_training(cli, tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserInputError, match="pip install wandb"):
        MonitorSink(load_config({"wandb": {"enabled": True}}).monitor)
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", sample_dir,
            "--runs-root", tmp_path / "runs", "--max-steps", "1", "--seq-len", "8",
            "--set", "wandb.enabled=true")  # fmt: skip
    text = r.output + r.stderr
    assert r.exit_code == 2 and "Traceback" not in text, text
    for fragment in ("wandb.enabled is true", "pip install wandb", "WANDB_MODE=offline",
                     '"wandb": {"enabled": false}'):  # fmt: skip
        assert fragment in " ".join(text.split()), (fragment, text)
    assert not (tmp_path / "runs").exists()  # stopped before a run directory was made
