"""`zfctl report` on synthetic run directories: chosen runs, numbers, comparison, plot, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from clihelp import assert_user_error

from zenflow.train import runs
from zenflow.train.runs import write_json_atomic
from zfctl.report import compare, run_report

MICRO_BATCH, GAS, SEQ_LEN = 8, 2, 64
MODEL_BYTES = 4 * 2**20
MiB = 2**20


def step_line(step: int, wall_ms: float, loss: float | None = None) -> dict:
    """A step line as the trainer writes it; the parts are fixed fractions of wall_ms."""
    return {
        "type": "step",
        "step": step,
        "lr": 2e-5,
        "loss": 1.0 / step if loss is None else loss,
        "wall_ms": wall_ms,
        "step_ms": 0.25 * wall_ms,
        "forward_ms": 0.3 * wall_ms,
        "backward_ms": 0.4 * wall_ms,
        "device_opt_ms": 0.1 * wall_ms,
        "stall_ms": 0.05 * wall_ms,
        "transfer_ms": 0.02 * wall_ms,
        "d2h_bytes": 3 * MiB,
        "h2d_bytes": 1 * MiB,
        "host_update": step % 2 == 0,
        "window_len": 2 if step % 2 == 0 else 0,
        "selection_changed": 1 if step == 1 else 0,
        "skipped": False,
        "mode": "zenflow",
        "epoch": step / 100,
    }


def eval_line(step: int, accuracy: float) -> dict:
    return {
        "type": "eval",
        "step": step,
        "accuracy": accuracy,
        "eval_loss": 0.5,
        "eval_samples": 32,
    }


def make_run(
    root: Path,
    name: str,
    walls: list[float],
    *,
    model: str = "gpt2",
    task: str = "sst2",
    engine_mode: str = "zenflow",
    accuracy: float | None = 0.875,
    finished: bool = True,
    checkpoint_step: int | None = None,
    lines: list[dict] | None = None,
) -> Path:
    """A run directory like `zfctl finetune` leaves: config.json, metrics.jsonl and, when
    ``finished``, a summary.json with the numbers the trainer computes from those lines."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    zenflow = {"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "epoch"}
    zenflow |= {"select_interval": 1, "overlap_step": True, "full_warm_up_rounds": 0}
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
        "zero_optimization": {"stage": 2, "zenflow": zenflow},
        "run": {
            "model": model,
            "task": task,
            "engine_mode": engine_mode,
            "micro_batch": MICRO_BATCH,
            "seq_len": SEQ_LEN,
            "max_steps": len(walls),
            "config_source": "ds_config.json",
        },
        "sources": {"model": f"hub cache: {model}", "tokenizer": "hub cache", "data": "glue"},
    }
    write_json_atomic(run_dir / "config.json", config)
    if lines is None:
        lines = [step_line(i + 1, w) for i, w in enumerate(walls)]
        if accuracy is not None:
            lines.append(eval_line(len(walls), accuracy))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    if checkpoint_step is not None:
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / f"step-{checkpoint_step:07d}.pt").write_bytes(b"")
    if finished:
        write_json_atomic(run_dir / "summary.json", summary_for(run_dir, walls, accuracy, config))
    return run_dir


def summary_for(run_dir: Path, walls: list[float], accuracy: float | None, config: dict) -> dict:
    n = len(walls)
    mean_wall = sum(walls) / n
    samples = n * MICRO_BATCH * GAS
    train_s = sum(walls) / 1e3
    timing = {
        "wall_ms": mean_wall,
        "step_ms": 0.25 * mean_wall,
        "forward_ms": 0.3 * mean_wall,
        "backward_ms": 0.4 * mean_wall,
        "device_opt_ms": 0.1 * mean_wall,
        "stall_ms": 0.05 * mean_wall,
        "transfer_ms": 0.02 * mean_wall,
    }
    last_eval = eval_line(n, accuracy) if accuracy is not None else None
    if last_eval:
        last_eval.pop("type")
    return {
        "status": "finished",
        "run_dir": str(run_dir),
        "model": config["run"]["model"],
        "task": config["run"]["task"],
        "engine_mode": config["run"]["engine_mode"],
        "steps": n,
        "total_steps": n,
        "epochs": n / 100,
        "final_loss": 1.0 / n,
        "final_loss_mean_last_10": sum(1.0 / (i + 1) for i in range(n)[-10:]) / len(walls[-10:]),
        "eval": last_eval,
        "validation": {"accuracy": accuracy} if last_eval else None,
        "validation_accuracy": accuracy,
        "non_finite_steps": 0,
        "timing_ms_mean": timing,
        "stall_fraction": 0.05,
        "d2h_bytes_total": n * 3 * MiB,
        "h2d_bytes_total": n * MiB,
        "bytes_per_step": 4 * MiB,
        "bytes_per_step_x_model": 4 * MiB / MODEL_BYTES,
        "host_updates": n // 2,
        "mean_window_len": 2.0,
        "selection_changes": 1,
        "samples": samples,
        "tokens": samples * SEQ_LEN,
        "train_s": train_s,
        "samples_per_s": samples / train_s,
        "tokens_per_s": samples * SEQ_LEN / train_s,
        "wall_s": train_s + 5.0,
        "model_bytes": MODEL_BYTES,
        "params": MODEL_BYTES // 4,
        "sources": config["sources"],
        "config": {
            "source": "ds_config.json",
            "lr": 2e-5,
            "optimizer": "AdamW",
            "weight_decay": 0.01,
            "scheduler": "WarmupLR",
            "micro_batch": MICRO_BATCH,
            "gradient_accumulation_steps": GAS,
            "seq_len": SEQ_LEN,
            "gradient_clipping": 1.0,
            "bf16": False,
            "zenflow": config["zero_optimization"]["zenflow"],
            "engine_resolved": {"host_kernel": "native"},
        },
        "checkpoint": str(run_dir / "checkpoints" / f"step-{n:07d}.pt"),
    }


def run_json(cli, *args) -> dict:
    result = cli("report", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stdout is exactly one JSON document


# ---------------------------------------------------------------------------- choosing runs


def test_default_is_the_latest_run(cli, tmp_path):
    root = tmp_path / "runs"
    make_run(root, "20240101-120000-gpt2-sst2", [100.0] * 4)
    newest = make_run(root, "20240102-090000-opt-sst2", [50.0] * 4, model="opt")
    make_run(root, "not-a-run-dir", [10.0])  # no config.json -> ignored by latest_run
    (root / "not-a-run-dir" / "config.json").unlink()
    doc = run_json(cli, "--runs-root", root)
    assert [r["run_dir"] for r in doc["runs"]] == [str(newest)]
    assert doc["runs"][0]["model"] == "opt"
    assert "comparison" not in doc


def test_a_model_folder_is_not_taken_for_a_run(cli, tmp_path, model_folder):
    """Issue 19: the old code took any folder with a config.json for a run, so the newest
    "run" under runs/ could be a model someone saved there."""
    root = tmp_path / "runs"
    run = make_run(root, "20240101-120000-gpt2-sst2", [100.0] * 2)
    model_folder.path.rename(root / "20250101-000000-my-model")
    doc = run_json(cli, "--runs-root", root)
    assert [r["run_dir"] for r in doc["runs"]] == [str(run)]
    model = root / "20250101-000000-my-model"
    assert_user_error(cli("report", model), f"{model} is not a zfctl run directory",
                      "its config.json was not written by zfctl")  # fmt: skip


def test_run_name_under_runs_root_and_file_inside_run(cli, tmp_path, monkeypatch):
    root = tmp_path / "runs"
    run = make_run(root, "20240101-120000-gpt2-sst2", [100.0] * 3)
    monkeypatch.chdir(tmp_path)
    doc = run_json(cli, "--runs-root", "runs", "20240101-120000-gpt2-sst2")
    assert Path(doc["runs"][0]["run_dir"]).resolve() == run.resolve()
    doc = run_json(cli, str(run / "summary.json"))
    assert doc["runs"][0]["run_dir"] == str(run)


# ---------------------------------------------------------------------------- numbers


def test_json_fields_equal_the_summary(cli, tmp_path):
    run = make_run(tmp_path, "20240101-120000-gpt2-sst2", [200.0, 220.0, 180.0, 200.0])
    summary = json.loads((run / "summary.json").read_text())
    (r,) = run_json(cli, run)["runs"]
    assert r["status"] == "finished" and r["has_summary"] is True
    for key in (
        "model", "task", "engine_mode", "steps", "final_loss", "validation",
        "validation_accuracy", "timing_ms_mean", "stall_fraction", "bytes_per_step",
        "bytes_per_step_x_model", "samples_per_s", "tokens_per_s", "wall_s", "train_s",
        "host_updates", "mean_window_len", "selection_changes", "sources", "checkpoint",
    ):  # fmt: skip
        assert r[key] == summary[key], key
    assert r["timing_ms_mean"]["wall_ms"] == pytest.approx(200.0)
    assert r["validation_accuracy"] == 0.875
    assert r["eval_loss"] == 0.5 and r["eval_step"] == 4
    assert r["config"]["lr"] == 2e-5 and r["config"]["micro_batch"] == MICRO_BATCH
    assert r["config"]["zenflow"]["topk_ratio"] == 0.1
    assert r["resume_command"] is None


def test_comparison_speedup_against_the_first_run(cli, tmp_path):
    a = make_run(tmp_path, "20240101-120000-gpt2-sst2", [200.0] * 5, engine_mode="offload")
    b = make_run(tmp_path, "20240101-130000-gpt2-sst2", [100.0] * 5)
    doc = run_json(cli, a, b)
    assert [r["run_dir"] for r in doc["runs"]] == [str(a), str(b)]
    first, second = doc["comparison"]
    assert first["speedup_vs_first"] == 1.0 and first["samples_per_s_vs_first"] == 1.0
    assert second["speedup_vs_first"] == pytest.approx(2.0)
    assert second["samples_per_s_vs_first"] == pytest.approx(2.0)
    assert second["mean_wall_ms"] == 100.0 and second["mean_stall_ms"] == pytest.approx(5.0)
    assert (first["engine_mode"], second["engine_mode"]) == ("offload", "zenflow")
    # Reversed order: the speed-up is relative to whichever run comes first.
    assert compare([run_report_of(b), run_report_of(a)])[1]["speedup_vs_first"] == 0.5

    table = cli("report", a, b)
    assert table.exit_code == 0, table.output
    assert "comparison" in table.stdout and "speed-up vs first" in table.stdout
    assert "2.00x" in table.stdout and "1.00x" in table.stdout


def test_learning_curves_at_matching_steps_against_the_first_run(cli, tmp_path):
    """Issue 17: `zfctl report A B` shows the accuracy of both at every step both
    evaluated, with B's difference from A (an evaluation only one run has is left out)."""
    steps = [step_line(i, 100.0) for i in range(1, 7)]
    a = make_run(
        tmp_path,
        "20240101-120000-gpt2-sst2",
        [100.0] * 6,
        engine_mode="device",
        lines=[*steps, eval_line(2, 0.70), eval_line(4, 0.80), eval_line(6, 0.84)],
    )
    b = make_run(tmp_path, "20240101-130000-gpt2-sst2", [100.0] * 6,
                 lines=[*steps, eval_line(2, 0.65), eval_line(3, 0.7), eval_line(4, 0.79),
                        eval_line(6, 0.845)])  # fmt: skip
    curve = run_json(cli, a, b)["learning_curve"]
    assert curve["metric"] == "accuracy" and curve["steps"] == [2, 4, 6]
    first, second = curve["runs"]
    assert first["values"] == {"2": 0.70, "4": 0.80, "6": 0.84}
    assert first["vs_first"] == {"2": 0.0, "4": 0.0, "6": 0.0}
    assert second["vs_first"] == {"2": pytest.approx(-0.05), "4": pytest.approx(-0.01),
                                  "6": pytest.approx(0.005)}  # fmt: skip
    assert second["eval_loss"] == {"2": 0.5, "4": 0.5, "6": 0.5}
    table = cli("report", a, b)
    assert table.exit_code == 0, table.output
    assert "learning curve: accuracy at matching steps" in table.stdout
    assert "0.6500 (-5.00)" in table.stdout and "0.8450 (+0.50)" in table.stdout
    # runs that evaluated at different steps: said, not a silent empty table
    c = make_run(tmp_path, "20240101-140000-gpt2-sst2", [100.0] * 6,
                 lines=[*steps, eval_line(5, 0.8)])  # fmt: skip
    result = cli("report", "--json", a, c)
    assert json.loads(result.stdout)["learning_curve"] is None
    assert "share no evaluated step" in result.stderr
    assert "learning_curve" not in run_json(cli, a)


def test_learning_curve_marks_evaluations_of_live_weights(cli, tmp_path):
    """Issue 30: an evaluation a ZenFlow run made while host updates were pending is
    marked (the JSON gives how many), and a flushed one is not; the validation figures
    leave the account of the weights out."""
    steps = [step_line(i, 100.0) for i in range(1, 5)]
    live = {"weights": "live", "pending_host_updates": 2, "pending_steps": 6}
    flushed = {"weights": "flushed", "pending_host_updates": 0, "pending_steps": 0}
    a = make_run(tmp_path, "20240101-120000-gpt2-sst2", [100.0] * 4, engine_mode="device",
                 lines=[*steps, eval_line(2, 0.70), eval_line(4, 0.80)])  # fmt: skip
    b = make_run(tmp_path, "20240101-130000-gpt2-sst2", [100.0] * 4, finished=False,
                 lines=[*steps, {**eval_line(2, 0.65), **live},
                        {**eval_line(4, 0.81), **flushed}])  # fmt: skip
    doc = run_json(cli, a, b)
    assert doc["learning_curve"]["runs"][1]["live"] == {"2": 2}
    assert doc["learning_curve"]["runs"][0]["live"] == {}
    assert doc["runs"][1]["validation"] == {"accuracy": 0.81}  # from its lines: no summary
    table = cli("report", a, b)
    assert table.exit_code == 0, table.output
    assert "0.6500* (-5.00)" in table.stdout and "0.8100 (+1.00)" in table.stdout
    assert "* live weights: ZenFlow host updates were pending" in table.stdout


def test_runs_of_other_tasks_or_models_get_no_speedup(cli, tmp_path):
    a = make_run(tmp_path, "20240101-120000-gpt2-sst2", [200.0] * 5)
    b = make_run(tmp_path, "20240101-130000-gpt2-rte", [100.0] * 5, task="rte")
    c = make_run(tmp_path, "20240101-140000-opt-sst2", [50.0] * 5, model="opt")
    d = make_run(tmp_path, "20240101-150000-gpt2-sst2", [100.0] * 5)
    result = cli("report", "--json", a, b, c, d)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rows = doc["comparison"]
    assert [r["comparable"] for r in rows] == [True, False, False, True]
    assert [r["speedup_vs_first"] for r in rows] == [1.0, None, None, pytest.approx(2.0)]
    assert rows[1]["samples_per_s_vs_first"] is None
    assert doc["warnings"] == [
        f"#2 {b.name} is not comparable with #1 {a.name} (task rte vs sst2): no speed-up "
        "shown for it.",
        f"#3 {c.name} is not comparable with #1 {a.name} (model opt vs gpt2): no speed-up "
        "shown for it.",
    ]
    table = cli("report", a, b, c, d)
    assert table.exit_code == 0, table.output
    text = " ".join(table.output.split())
    assert f"warning: #2 {b.name} is not comparable with #1 {a.name} (task rte vs sst2)" in text
    assert "not comparable" in table.stdout and "2.00x" in table.stdout


def test_garbage_lines_are_skipped_with_a_warning_and_reading_goes_on(cli, tmp_path):
    run = make_run(tmp_path, "20240101-120000-gpt2-sst2", [100.0] * 40, finished=False)
    lines = (run / "metrics.jsonl").read_bytes().splitlines(True)
    lines[10:10] = [b"\xff\xfe not utf-8\n", b"[1, 2]\n", b"{not json\n"]
    (run / "metrics.jsonl").write_bytes(b"".join(lines) + b'{"type": "step", "st')
    result = cli("report", "--json", run)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (r,) = doc["runs"]
    assert r["steps"] == 40 and r["validation_accuracy"] == 0.875  # the eval line is last
    m = run / "metrics.jsonl"
    assert (
        doc["warnings"]
        == r["warnings"]
        == [
            f"{m} line 11 is not UTF-8 text; skipped it",
            f"{m} line 12 is not a JSON object; skipped it",
            f"{m} line 13 is not valid JSON; skipped it",
            f"{m} line 45 (the last) is incomplete, as a crash mid-write leaves it; skipped it",
        ]
    )
    text = " ".join(result.output.split())
    assert f"warning: {m} line 11 is not UTF-8 text; skipped it" in text


def run_report_of(run_dir: Path) -> dict:
    from zenflow.train.runs import read_run

    return run_report(read_run(run_dir))


def test_unfinished_run_is_computed_from_metrics(cli, tmp_path):
    walls = [100.0, 200.0, 300.0, 400.0]
    run = make_run(tmp_path, "20240101-120000-gpt2-sst2", walls, finished=False, accuracy=0.75)
    (r,) = run_json(cli, run)["runs"]
    assert r["status"] == "unfinished" and r["has_summary"] is False
    assert r["steps"] == 4 and r["total_steps"] == 4
    assert r["timing_ms_mean"]["wall_ms"] == pytest.approx(250.0)
    assert r["timing_ms_mean"]["stall_ms"] == pytest.approx(12.5)
    assert r["stall_fraction"] == pytest.approx(0.05)
    assert r["bytes_per_step"] == 4 * MiB
    assert r["bytes_per_step_x_model"] is None  # the model size is only in summary.json
    samples = 4 * MICRO_BATCH * GAS
    assert r["samples"] == samples
    assert r["samples_per_s"] == pytest.approx(samples / 1.0)  # 1000 ms of steps in all
    assert r["tokens_per_s"] == pytest.approx(samples * SEQ_LEN)
    assert r["final_loss"] == 0.25 and r["validation"] == {"accuracy": 0.75}
    assert r["host_updates"] == 2 and r["mean_window_len"] == 2.0
    assert r["config"]["lr"] == 2e-5 and r["config"]["seq_len"] == SEQ_LEN
    assert r["checkpoint"] is None and r["resume_command"] is None

    # The finished run's summary says the same as the computation from its lines.
    done = make_run(tmp_path, "20240101-130000-gpt2-sst2", walls, accuracy=0.75)
    summary = json.loads((done / "summary.json").read_text())
    for key in ("timing_ms_mean", "stall_fraction", "bytes_per_step", "samples_per_s"):
        assert r[key] == pytest.approx(summary[key]), key


def test_interrupted_run_names_its_checkpoint(cli, tmp_path):
    run = make_run(
        tmp_path, "20240101-120000-gpt2-sst2", [100.0] * 3, finished=False, checkpoint_step=2
    )
    (r,) = run_json(cli, run)["runs"]
    assert r["status"] == "interrupted" and r["checkpoint_step"] == 2
    assert r["checkpoint"].endswith("step-0000002.pt")
    assert r["resume_command"] == (
        f"zfctl finetune gpt2 --task sst2 --resume {run} --config ds_config.json"
    )
    table = cli("report", run)
    assert table.exit_code == 0, table.output
    assert "interrupted (no summary.json; checkpoint at step 2)" in table.stdout
    assert f"--resume {run}" in table.stdout


def test_missing_values_render_as_dash(cli, tmp_path):
    """NaN loss, a step without timings, a config with nothing but the run mark: '-' and
    null, never a crash."""
    lines = [
        {"type": "step", "step": 1, "loss": math.nan, "skipped": True},
        {"type": "step", "step": 2, "loss": None, "wall_ms": None, "d2h_bytes": None},
    ]
    run = tmp_path / "20240101-120000-x-sst2"
    make_run(tmp_path, run.name, [], finished=False, lines=lines)
    write_json_atomic(run / "config.json", {runs.RUN_MARK: runs.RUN_FORMAT})
    (r,) = run_json(cli, run)["runs"]
    assert r["steps"] == 2 and r["non_finite_steps"] == 2
    assert r["final_loss"] is None and r["timing_ms_mean"]["wall_ms"] is None
    assert r["samples_per_s"] is None and r["validation"] is None
    table = cli("report", run)
    assert table.exit_code == 0, table.output
    assert "wall - = forward -" in table.stdout

    empty = tmp_path / "20240101-130000-y-sst2"
    empty.mkdir()
    write_json_atomic(empty / "config.json", {"run": {"model": "y"}})
    doc = run_json(cli, run, empty)
    assert doc["runs"][1]["steps"] == 0
    assert doc["comparison"][1]["speedup_vs_first"] is None


def test_table_shows_model_accuracy_and_config(cli, tmp_path):
    run = make_run(tmp_path, "20240101-120000-gpt2-sst2", [200.0] * 4, model="my-gpt2")
    result = cli("report", run)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "my-gpt2 / sst2 / zenflow" in out
    assert "accuracy 0.8750" in out
    assert "wall 200.0 = forward 60.0 + backward 80.0 + engine step 50.0 + other 10.0" in out
    assert "5.0 % of wall time" in out
    assert "4.2 MB (1.00x model" in out  # 4 MiB per step, shown in decimal units
    assert "80.0 samples/s, 5120 tokens/s" in out  # 8 x 2 samples of 64 tokens per 200 ms
    assert "topk_ratio 0.1, update_interval 4" in out
    assert "lr 2e-05 (AdamW" in out and "micro batch 8 x grad accum 2" in out


@pytest.mark.parametrize(
    "measured, shown",
    [
        # sim with its pool: the process's peak less the device's, against the estimate
        ({"process_rss_peak_bytes": 5_000_000_000, "host_rss_peak_bytes": 3_000_000_000,
          "host_peak_estimate_bytes": 4_000_000_000},
         "3.0 GB (process RSS 5.0 GB less the simulated device's 2.0 GB); estimate 4.0 GB, "
         "measured / estimate 0.75"),
        # CUDA: all of it is the host's; no estimate (--force)
        ({"process_rss_peak_bytes": 61_000_000_000, "host_rss_peak_bytes": 61_000_000_000,
          "host_peak_estimate_bytes": None}, "61.0 GB (process RSS)"),
        # sim without its pool: the device's memory cannot be told apart
        ({"process_rss_peak_bytes": 2_000_000_000, "host_rss_peak_bytes": None},
         "process RSS 2.0 GB (the simulated device's memory included)"),
        ({}, None),  # a run written before they were measured: no row
        ({"process_rss_peak_bytes": "lots", "host_rss_peak_bytes": -5}, None),
    ],
)  # fmt: skip
def test_the_host_peak_the_run_measured(cli, tmp_path, measured, shown):
    run = make_run(tmp_path, "20240101-120000-gpt2-sst2", [200.0] * 4)
    summary = json.loads((run / "summary.json").read_text()) | measured
    (run / "summary.json").write_text(json.dumps(summary))
    (r,) = run_json(cli, run)["runs"]
    for key in ("process_rss_peak_bytes", "host_rss_peak_bytes", "host_peak_estimate_bytes"):
        assert r[key] == summary.get(key), key
    out = cli("report", run)
    assert out.exit_code == 0, out.output
    rows = [ln for ln in out.stdout.splitlines() if "host peak" in ln]
    if shown is None:
        assert not rows
    else:
        assert len(rows) == 1 and shown in rows[0], out.stdout


# ---------------------------------------------------------------------------- plot


def test_plot_writes_a_png(cli, tmp_path):
    a = make_run(tmp_path, "20240101-120000-gpt2-sst2", [200.0] * 6)
    b = make_run(tmp_path, "20240101-130000-gpt2-sst2", [100.0] * 6, finished=False)
    out = tmp_path / "cmp.png"
    result = cli("report", a, b, "--plot", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote plot to {out}" in result.stdout

    out.unlink()
    result = cli("report", a, "--json", "--plot", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(result.stdout)["runs"][0]["run_dir"] == str(a)
    assert f"wrote plot to {out}" in result.stderr


@pytest.mark.parametrize(
    ("name", "fragment"),
    [("cmp.svg", "must end in .png"), ("missing/cmp.png", "does not exist")],
)
def test_bad_plot_path_is_a_user_error(cli, tmp_path, name, fragment):
    run = make_run(tmp_path, "20240101-120000-gpt2-sst2", [100.0] * 2)
    target = tmp_path / name
    assert_user_error(cli("report", run, "--plot", target), str(target), fragment)
    assert not target.exists()


def test_plot_onto_what_is_not_a_file_is_refused_and_a_link_written_through(cli, tmp_path):
    """Issue 19: a directory or socket named like a PNG is refused before any work; a link
    keeps being a link (the PNG lands in the file it names)."""
    import socket

    run = make_run(tmp_path, "20240101-120000-gpt2-sst2", [100.0] * 2)
    folder = tmp_path / "plots.png"
    folder.mkdir()
    assert_user_error(cli("report", run, "--plot", folder), f"{folder}: it is a directory")
    sock_path = tmp_path / "s.png"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(sock_path))
        assert_user_error(cli("report", run, "--plot", sock_path), f"{sock_path}: it is a socket")
    real = tmp_path / "real.png"
    real.write_bytes(b"old")
    link = tmp_path / "link.png"
    link.symlink_to(real)
    r = cli("report", run, "--plot", link)
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and real.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------- errors


def test_missing_run_path(cli, tmp_path):
    missing = tmp_path / "runs" / "nope"
    assert_user_error(cli("report", missing), str(missing), "does not exist")


def test_several_bad_run_paths_are_reported_together(cli, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    missing = tmp_path / "nope"
    result = cli("report", missing, plain)
    assert_user_error(result, "2 RUN paths", str(missing), f"{plain} is not a zfctl run")


def test_runs_root_given_as_run(cli, tmp_path):
    root = tmp_path / "runs"
    make_run(root, "20240101-120000-gpt2-sst2", [100.0])
    assert_user_error(cli("report", root), "holds 1 runs", f"--runs-root {root}")


def test_no_runs_under_runs_root(cli, tmp_path):
    empty = tmp_path / "runs"
    empty.mkdir()
    assert_user_error(cli("report", "--runs-root", empty), f"no runs found under {empty}")
    absent = tmp_path / "absent"
    assert_user_error(cli("report", "--runs-root", absent), "does not exist", "zfctl finetune")


def test_import_pulls_in_neither_torch_nor_matplotlib():
    code = (
        "import sys, zfctl.report; "
        "sys.exit(int('torch' in sys.modules) + 2 * int('matplotlib' in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0


def test_bad_values_are_warned_once_per_kind_and_not_plotted(cli, tmp_path, monkeypatch):
    """NaN (a bare token, as older files hold it), a null loss, negative step times and an
    accuracy above 1: one warning per kind with its count and first line; the report and
    the plot treat them as missing (before: no warning, and --plot drew them)."""
    lines = [step_line(i + 1, 100.0) for i in range(5)]
    lines[1]["loss"] = math.nan  # line 2
    lines[2]["loss"] = None  # line 3: a skipped step
    lines[3]["wall_ms"] = -5.0  # lines 4 and 5
    lines[4]["wall_ms"] = -1.0
    lines.append(eval_line(5, 1.5))  # line 6
    run = make_run(tmp_path, "20240101-120000-gpt2-sst2", [], finished=False, lines=lines)
    doc = run_json(cli, run)
    m = run / "metrics.jsonl"
    assert doc["warnings"] == [
        f"{m}: 1 step line with loss not finite (nan), first at line 2; read as a missing value",
        f"{m}: 1 step line with loss missing (null: a skipped, non-finite step), first at "
        "line 3; read as a missing value",
        f"{m}: 2 step lines with wall_ms out of range (-5; allowed 0 to inf), first at line 4; "
        "read as a missing value",
        f"{m}: 1 eval line with accuracy out of range (1.5; allowed 0 to 1), first at line 6; "
        "read as a missing value",
    ]
    (r,) = doc["runs"]
    assert r["timing_ms_mean"]["wall_ms"] == 100.0 and r["validation_accuracy"] is None
    assert r["non_finite_steps"] == 2

    import matplotlib.axes

    drawn = []
    real_plot = matplotlib.axes.Axes.plot

    def plot(self, *args, **kw):
        drawn.extend(v for a in args if isinstance(a, list) for v in a)
        return real_plot(self, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    out = tmp_path / "bad.png"
    result = cli("report", run, "--plot", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG"
    finite = [v for v in drawn if math.isfinite(v)]
    assert finite and min(finite) >= 0 and 1.5 not in finite  # nothing bad was drawn
    assert result.output.count("warning:") == 4
