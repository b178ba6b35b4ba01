"""`zfctl init`: what it writes is accepted by our parser and by DeepSpeed; errors exit 2;
--output - (and --print) is stdout; a FIFO or device is written into, never replaced; a
flag that has no effect is named in a warning."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading

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


def test_update_interval_auto_turns_the_templates_early_ramp_off(cli, tmp_path):
    """The template's early ramp (zfctl.early, 200 steps) grows the window to
    update_interval: --update-interval auto writes it off, with a warning, where the config
    would refuse the pair; an integer keeps it; your own zfctl.early with auto is refused
    by the config's rule, with the fixes."""
    out = tmp_path / "ds.json"
    assert cli("init", "-o", out).exit_code == 0
    assert load_config(out).engine.early.steps == 200  # the template's
    r = cli("init", "-o", out, "--force", "--update-interval", "auto")
    assert r.exit_code == 0, r.output
    assert "zfctl.early turned off" in " ".join(r.output.split())
    cfg = load_config(out)
    assert cfg.zenflow.update_interval == "auto" and cfg.engine.early.steps == 0
    r = cli("init", "-o", out, "--force", "--update-interval", "8")
    assert r.exit_code == 0 and load_config(out).engine.early.steps == 200
    r = cli("init", "-o", out, "--force", "--update-interval", "auto",
            "--set", "zfctl.early.steps=50")  # fmt: skip
    assert_user_error(r, "zfctl.early.windows", "update_interval", "zfctl.early.steps to 0")


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


@pytest.mark.parametrize(
    "key,value,bad,allowed",
    [("window_lr", "sum", "mean", '"last" or "sum" or "sqrt"'),
     ("select_schedule", "doubling", "dense", '"fixed" or "doubling"')],
)  # fmt: skip
def test_zfctl_block_algorithm_flags(cli, tmp_path, key, value, bad, allowed):
    flag = "--" + key.replace("_", "-")
    out = tmp_path / "ds.json"
    r = cli("init", "-o", out, flag, value)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["zfctl"][key] == value
    assert getattr(load_config(out).engine, key) == value
    assert_user_error(cli("init", "-o", tmp_path / "y.json", flag, bad), f"zfctl.{key}", allowed)
    r = cli("init", "--template", "offload", "-o", tmp_path / "x.json", flag, value)
    assert_user_error(r, flag, "--template zenflow")


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


# ------------------------------------------------ issue 19: stdout, devices, dropped flags


@pytest.mark.parametrize("flags", [["--output", "-"], ["--print"]], ids=["dash", "print"])
def test_stdout_gets_the_json_alone(cli, tmp_path, monkeypatch, flags):
    monkeypatch.chdir(tmp_path)
    r = cli("init", *flags, "--topk-ratio", "0.3")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)  # nothing but the document on stdout
    assert data["zero_optimization"]["zenflow"]["topk_ratio"] == pytest.approx(0.3)
    assert "wrote the config to stdout (template zenflow)" in r.stderr
    assert "next: zfctl tune-hw --config FILE --write" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_print_with_an_output_file_is_refused(cli, tmp_path):
    out = tmp_path / "ds.json"
    r = cli("init", "--print", "--output", out)
    assert_user_error(r, f"--print writes the config to stdout and --output {out} to a file",
                      "--output - is the same as --print")  # fmt: skip
    assert not out.exists()


def test_dev_stdout_redirected_to_a_file_holds_only_the_json(tmp_path):
    """`--output /dev/stdout > file`: /dev/stdout is the file, so the messages go to stderr
    (the old code renamed its temp file onto the /dev/stdout link itself, as root)."""
    out = tmp_path / "out.json"
    was_link = os.path.islink("/dev/stdout")
    with open(out, "w") as f:
        r = subprocess.run([sys.executable, "-m", "zfctl", "init", "--output", "/dev/stdout"],
                           stdout=f, stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["zero_optimization"]["stage"] == 2
    assert "wrote the config to stdout" in r.stderr
    assert os.path.islink("/dev/stdout") == was_link  # not replaced by a file


def test_a_fifo_output_is_written_into(cli, tmp_path):
    """The old code asked for --force, then put a regular file in the FIFO's place."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []

    def read():
        with open(fifo, encoding="utf-8") as f:
            got.append(f.read())

    for force in ([], ["--force"]):  # nothing is replaced: --force is not needed
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        r = cli("init", "--output", fifo, *force)
        reader.join(timeout=300)  # a guard only: a reader still waiting this long hung
        assert not reader.is_alive(), "the FIFO's reader hung: nothing was written into it"
        assert r.exit_code == 0, r.output
        assert json.loads(got.pop())["zero_optimization"]["stage"] == 2
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_dev_null_and_dev_full(cli):
    r = cli("init", "--output", "/dev/null")
    assert r.exit_code == 0, r.output
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    r = cli("init", "--output", "/dev/full", "--force")
    assert_user_error(r, "--output: cannot write /dev/full: No space left on device",
                      "character device")  # fmt: skip
    assert stat.S_ISCHR(os.lstat("/dev/full").st_mode)


def test_a_socket_output_is_refused(cli, tmp_path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        r = cli("init", "--output", path, "--force")
        assert_user_error(r, f"--output: cannot write {path}: it is a socket", "give a file path")
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_a_link_output_writes_the_file_it_names(cli, tmp_path):
    real = tmp_path / "configs" / "ds.json"
    real.parent.mkdir()
    real.write_text("{}")
    link = tmp_path / "ds.json"
    link.symlink_to(real)
    assert_user_error(cli("init", "--output", link), "already exists", "--force")
    r = cli("init", "--output", link, "--force")
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and json.loads(real.read_text())["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize(
    ("flags", "warning", "absent"),
    [
        (["--scheduler", "none", "--warmup-steps", "5"],
         "warning: --warmup-steps 5 dropped: --scheduler none writes no scheduler block.",
         "scheduler"),
        (["--scheduler", "none", "--total-steps", "100"],
         "warning: --total-steps 100 dropped: --scheduler none", "scheduler"),
        (["--total-steps", "100"],
         "warning: --total-steps 100 dropped: the WarmupLR scheduler has no total_num_steps",
         "total_num_steps"),
        (["--print", "--force"],
         "warning: --force has no effect when the config goes to stdout; ignored it.", None),
    ],
    ids=["warmup-none", "total-none", "total-warmuplr", "force-print"],
)  # fmt: skip
def test_a_dropped_flag_is_named(cli, tmp_path, flags, warning, absent):
    """The old code dropped these without a word."""
    out = tmp_path / "ds.json"
    args = flags if "--print" in flags else [*flags, "--output", out]
    r = cli("init", *args)
    assert r.exit_code == 0, r.output
    assert warning in " ".join(r.stderr.split())
    if absent is not None:
        assert absent not in out.read_text()


def test_total_steps_with_a_scheduler_that_takes_it_is_kept(cli, tmp_path):
    out = tmp_path / "ds.json"
    r = cli("init", "--output", out, "--scheduler", "WarmupDecayLR", "--total-steps", "100")
    assert r.exit_code == 0, r.output
    assert "warning" not in r.stderr
    assert json.loads(out.read_text())["scheduler"]["params"]["total_num_steps"] == 100
