"""DeepSpeed's monitor blocks (tensorboard, csv_monitor, wandb) parsed into MonitorConfig:
defaults, unknown keys reported as ignored, bad values as problems, DeepSpeed agrees."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zenflow.config import (
    ConfigError,
    LogDirConfig,
    MonitorConfig,
    WandbConfig,
    load_config,
)

BLOCKS = {
    "tensorboard": {"enabled": True, "output_path": "logs/tb", "job_name": "run1"},
    "csv_monitor": {"enabled": True, "output_path": "", "job_name": "run1"},
    "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
}


def test_blocks_parsed_not_ignored():
    cfg = load_config(BLOCKS)
    assert cfg.ignored == ()
    assert cfg.monitor == MonitorConfig(
        tensorboard=LogDirConfig(enabled=True, output_path="logs/tb", job_name="run1"),
        csv_monitor=LogDirConfig(enabled=True, output_path="", job_name="run1"),
        wandb=WandbConfig(enabled=True, group="g", team="t", project="p"),
    )
    assert cfg.monitor.enabled


def test_defaults_are_off_and_deepspeeds_where_not_deliberately_different():
    cfg = load_config({"tensorboard": {}, "wandb": {"enabled": False}})
    assert cfg.monitor == MonitorConfig() and not cfg.monitor.enabled
    assert load_config({}).monitor == MonitorConfig()
    d = MonitorConfig()
    assert (d.tensorboard.enabled, d.tensorboard.output_path) == (False, "")
    assert d.tensorboard.job_name is None  # DeepSpeed: "DeepSpeedJobName"; ours: the run's name
    assert (d.wandb.project, d.wandb.group, d.wandb.team) == ("deepspeed", None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.tensorboard.enabled = True  # type: ignore[misc]


def test_unknown_keys_inside_blocks_are_ignored_and_listed():
    cfg = load_config(
        {
            "tensorboard": {"enabled": True, "flush_secs": 10},
            "wandb": {"enabled": False, "entity": "x"},
            "comet": {"enabled": True},  # a DeepSpeed monitor zfctl does not write
        }
    )
    assert set(cfg.ignored) == {"tensorboard.flush_secs", "wandb.entity", "comet"}
    assert cfg.monitor.tensorboard.enabled


@pytest.mark.parametrize(
    "block, key, value",
    [
        ("tensorboard", "enabled", "yes"),
        ("tensorboard", "output_path", 3),
        ("csv_monitor", "job_name", ""),
        ("csv_monitor", "enabled", 1),
        ("wandb", "project", ["p"]),
        ("wandb", "team", 5),
    ],
)
def test_bad_values_are_problems_naming_the_path(block, key, value):
    with pytest.raises(ConfigError) as e:
        load_config({block: {key: value}})
    (problem,) = e.value.problems
    assert problem.path == f"{block}.{key}" and problem.value == value


def test_block_must_be_an_object():
    with pytest.raises(ConfigError) as e:
        load_config({"tensorboard": True})
    assert e.value.problems[0].path == "tensorboard"


def test_round_trip_keeps_the_blocks():
    cfg = load_config(BLOCKS)
    out = cfg.to_json_dict()
    assert {k: out[k] for k in BLOCKS} == BLOCKS
    assert load_config(json.loads(json.dumps(out))) == cfg


def test_deepspeed_reads_the_same_blocks():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = {"train_micro_batch_size_per_gpu": 1, **BLOCKS}
    ours = load_config(raw).monitor
    theirs = DeepSpeedConfig(json.loads(json.dumps(raw))).monitor_config
    for name in ("tensorboard", "csv_monitor"):
        for key in ("enabled", "output_path", "job_name"):
            assert getattr(getattr(theirs, name), key) == getattr(getattr(ours, name), key)
    for key in ("enabled", "group", "team", "project"):
        assert getattr(theirs.wandb, key) == getattr(ours.wandb, key)
