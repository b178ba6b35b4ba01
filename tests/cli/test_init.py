"""`zfctl init`: what it writes is accepted by our parser and by DeepSpeed; errors exit 2."""

from __future__ import annotations

import json

import pytest
from clihelp import assert_user_error

from zenflow.config import load_config


def test_writes_default_config(cli, tmp_path):
    out = tmp_path / "ds.json"
    r = cli("init", "--output", out)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    zo = data["zero_optimization"]
    assert zo["stage"] == 2
    assert zo["offload_optimizer"]["device"] == "cpu"
    assert zo["offload_optimizer"]["pin_memory"] is True
    assert "zenflow" in zo
    cfg = load_config(out)
    assert cfg.zenflow is not None
    assert f"wrote {out}" in r.output


def test_flags_land_in_the_file(cli, tmp_path):
    out = tmp_path / "ds.json"
    r = cli(
        "init", "-o", out, "--topk-ratio", "0.2", "--update-interval", "8",
        "--select-interval", "auto", "--no-overlap-step", "--lr", "3e-5", "--micro-batch", "4",
        "--grad-accum", "2", "--set", "gradient_clipping=0.5",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    cfg = load_config(out)
    assert cfg.zenflow.topk_ratio == pytest.approx(0.2)
    assert cfg.zenflow.update_interval == 8
    assert cfg.zenflow.select_interval == "auto"
    assert cfg.zenflow.overlap_step is False
    assert cfg.optimizer.lr == pytest.approx(3e-5)
    assert cfg.train_micro_batch_size_per_gpu == 4
    assert cfg.gradient_accumulation_steps == 2
    assert cfg.gradient_clipping == pytest.approx(0.5)
    raw = json.loads(out.read_text())
    assert raw["scheduler"]["params"]["warmup_max_lr"] == pytest.approx(3e-5)


@pytest.mark.parametrize("template", ["zenflow", "offload"])
def test_written_config_accepted_by_deepspeed(cli, tmp_path, template):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    out = tmp_path / f"{template}.json"
    r = cli("init", "--template", template, "-o", out)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    ds = DeepSpeedConfig(data)  # raises on keys DeepSpeed 0.19.6 rejects
    assert ds.zero_optimization_stage == 2
    assert ds.train_micro_batch_size_per_gpu == data["train_micro_batch_size_per_gpu"]
    assert (load_config(out).zenflow is None) == (template == "offload")


def test_refuses_to_overwrite_without_force(cli, tmp_path):
    out = tmp_path / "ds.json"
    out.write_text('{"keep": "me"}')
    r = cli("init", "-o", out)
    assert_user_error(r, "already exists", "--force")
    assert out.read_text() == '{"keep": "me"}'  # never lose data
    r = cli("init", "-o", out, "--force")
    assert r.exit_code == 0, r.output
    assert "zero_optimization" in json.loads(out.read_text())


def test_print_writes_nothing(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli("init", "--print", "--topk-ratio", "0.3")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["zero_optimization"]["zenflow"]["topk_ratio"] == pytest.approx(0.3)
    assert list(tmp_path.iterdir()) == []


def test_all_problems_reported_together(cli, tmp_path):
    out = tmp_path / "ds.json"
    r = cli("init", "-o", out, "--topk-ratio", "1.5", "--update-interval", "zero",
            "--set", "zero_optimization.zenflow.no_such_key=1")  # fmt: skip
    assert_user_error(r, "topk_ratio", "update_interval", "no_such_key", "zfctl init")
    assert not out.exists()


def test_zenflow_flag_on_offload_template(cli, tmp_path):
    r = cli("init", "--template", "offload", "-o", tmp_path / "x.json", "--topk-ratio", "0.1")
    assert_user_error(r, "--topk-ratio", "--template zenflow")


def test_unknown_template(cli, tmp_path):
    r = cli("init", "--template", "nope", "-o", tmp_path / "x.json")
    assert_user_error(r, "'nope'", "zenflow, offload")


def test_bad_set_syntax(cli, tmp_path):
    r = cli("init", "-o", tmp_path / "x.json", "--set", "gradient_clipping")
    assert_user_error(r, "gradient_clipping")


def test_logging_blocks_written_and_accepted_by_deepspeed(cli, tmp_path):
    out = tmp_path / "ds.json"
    r = cli("init", "-o", out, "--tensorboard", "logs/tb", "--csv-monitor", "logs/csv",
            "--job-name", "sst2")  # fmt: skip
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["tensorboard"] == {"enabled": True, "output_path": "logs/tb", "job_name": "sst2"}
    assert data["csv_monitor"] == {"enabled": True, "output_path": "logs/csv", "job_name": "sst2"}
    assert "tensorboard: logs/tb/sst2" in r.output and "csv_monitor: logs/csv/sst2" in r.output
    mon = load_config(out).monitor
    assert mon.tensorboard.enabled and mon.csv_monitor.output_path == "logs/csv"
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(data).monitor_config
    assert ds.tensorboard.enabled and ds.tensorboard.output_path == "logs/tb"
    assert ds.csv_monitor.enabled and ds.csv_monitor.job_name == "sst2"


def test_tensorboard_without_job_name_names_it_after_the_run(cli, tmp_path):
    out = tmp_path / "ds.json"
    r = cli("init", "-o", out, "--tensorboard", "tb")
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["tensorboard"] == {"enabled": True, "output_path": "tb"}
    assert "tensorboard: tb/<run name>" in r.output
    assert "csv_monitor" not in json.loads(out.read_text())


def test_job_name_alone_is_an_error(cli, tmp_path):
    r = cli("init", "-o", tmp_path / "x.json", "--job-name", "a")
    assert_user_error(r, "--job-name", "--tensorboard")
