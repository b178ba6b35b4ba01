"""The top-level "zfctl" block: engine settings DeepSpeed has no key for."""

from __future__ import annotations

import dataclasses

import pytest

from zenflow.config import ENGINE_FIELD_DOCS, ConfigError, EngineOptions, load_config


def test_defaults_when_absent():
    cfg = load_config({})
    assert cfg.engine == EngineOptions()
    assert cfg.engine.stream_grads == "auto"
    assert cfg.engine.grad_accumulation == "host"


def test_values_read_and_written_back():
    cfg = load_config({"zfctl": {"stream_grads": False, "grad_accumulation": "device"}})
    assert cfg.engine == EngineOptions(stream_grads=False, grad_accumulation="device")
    again = load_config(cfg.to_json_dict())
    assert again == cfg
    assert again.to_json_dict()["zfctl"] == {
        "stream_grads": False,
        "grad_accumulation": "device",
        "copy_buckets": "auto",
        "window_lr": "last",
        "select_schedule": "fixed",
        "host_state": "exact",
        "lora": {"rank": 8, "alpha": 8.0, "dropout": 0.0},
        "early": {"steps": 0, "windows": "ramp", "overlap": True},
        "return_image": "early",
        "numa_binding": "auto",
        "step_store": "auto",
    }


def test_every_field_documented():
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    assert set(ENGINE_FIELD_DOCS) == names
    assert all(len(doc) > 20 for doc in ENGINE_FIELD_DOCS.values())


def test_problems_are_collected_with_paths():
    with pytest.raises(ConfigError) as err:
        load_config(
            {"zfctl": {"stream_grad": True, "grad_accumulation": "gpu", "stream_grads": "yes"}}
        )
    paths = {p.path for p in err.value.problems}
    assert paths == {"zfctl.stream_grad", "zfctl.grad_accumulation", "zfctl.stream_grads"}
    text = str(err.value)
    assert 'did you mean "stream_grads"' in text
    assert '"host" or "device"' in text
    assert 'true or false or "auto"' in text


def test_block_must_be_an_object():
    with pytest.raises(ConfigError) as err:
        load_config({"zfctl": [1]})
    assert err.value.problems[0].path == "zfctl"


@pytest.mark.parametrize("value", [0, 1, -4, 2.5, True, "many"])
def test_copy_buckets_must_be_an_integer_of_two_or_more(value):
    with pytest.raises(ConfigError) as err:
        load_config({"zfctl": {"copy_buckets": value}})
    (problem,) = err.value.problems
    assert problem.path == "zfctl.copy_buckets" and "integer from 2 to" in str(err.value)


def test_copy_buckets_sizes_the_engine_and_the_estimate():
    """An explicit count is what the engine allocates (never fewer than its default) and
    what the estimate counts: each bucket 1/64 of the offloaded elements."""
    import torch

    from zenflow import ZenFlowEngine
    from zenflow.engine.copies import bucket_count
    from zenflow.hardware.estimate import settings_from_config

    assert bucket_count("auto", False) == 2 and bucket_count("auto", True) == 4
    assert bucket_count(16, False) == 16 and bucket_count(2, True) == 4
    # "auto": 1/32 of the offloaded elements in flight, at most 16 buckets and 64M elements.
    # A small model's buckets are 1/64 of its elements (2 buckets); a 7B's are capped: 16M
    # elements for ZenFlow's pieces (4 buckets), 4M for offload's chunks (16).
    assert bucket_count("auto", False, 3_000_000, 3_000_000 // 64) == 2
    assert bucket_count("auto", False, 5_900_000_000, 16 * 2**20) == 4
    assert bucket_count("auto", False, 5_900_000_000, 4 * 2**20) == 16
    assert bucket_count("auto", False, 600_000_000, 4 * 2**20) == 4  # 18.75M in 4M buckets
    assert bucket_count("auto", True, 5_900_000_000, 32 * 2**20) == 4  # never below 4 (dp)
    raw = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                              "zenflow": {"topk_ratio": 0.1,
                                                      "select_strategy": "step",
                                                      "select_interval": 10}},
        "zfctl": {"copy_buckets": 8},
    }  # fmt: skip
    cfg = load_config(raw)
    assert settings_from_config(cfg).copy_buckets == 8
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 4))
    with ZenFlowEngine(model, cfg, accelerator="sim", host_kernel="reference",
                       min_numel=1000) as engine:  # fmt: skip
        held = engine.accel.held()["staging"]
        bucket = engine.impl.bucket_elems
        assert len(engine.impl.transport.buckets._flat) == 8
        assert engine.resolved["copy_buckets"] == 8
    # 8 buckets of the ZenFlow weights' bucket size, fp32 (no overlap: no return buckets)
    assert held == 8 * bucket * 4


@pytest.mark.parametrize(
    "key,default,other,bad,allowed",
    [("window_lr", "last", "sum", "mean", '"last" or "sum" or "sqrt"'),
     ("window_lr", "last", "sqrt", "mean", '"last" or "sum" or "sqrt"'),
     ("select_schedule", "fixed", "doubling", "dense", '"fixed" or "doubling"')],
)  # fmt: skip
def test_algorithm_options_take_their_choices(key, default, other, bad, allowed):
    assert getattr(load_config({}).engine, key) == default
    cfg = load_config({"zfctl": {key: other}})
    assert getattr(cfg.engine, key) == other
    assert getattr(load_config(cfg.to_json_dict()).engine, key) == other
    with pytest.raises(ConfigError) as err:
        load_config({"zfctl": {key: bad}})
    (problem,) = err.value.problems
    assert problem.path == f"zfctl.{key}" and allowed in str(err.value)


def test_early_block_is_read_checked_and_written_back():
    """zfctl.early: off by default; its steps, windows and overlap read and written back;
    each bad value or unknown key one problem at its path; a ramp needs an integer
    update_interval (it ramps up to it)."""
    assert not load_config({}).engine.early.on
    cfg = load_config({"zfctl": {"early": {"steps": 100, "overlap": False}}})
    assert cfg.engine.early.on
    assert (cfg.engine.early.steps, cfg.engine.early.windows, cfg.engine.early.overlap) == (
        100,
        "ramp",
        False,
    )
    assert load_config(cfg.to_json_dict()).engine.early == cfg.engine.early
    with pytest.raises(ConfigError) as err:
        load_config({"zfctl": {"early": {"steps": -1, "windows": "grow", "overlap": "no",
                                         "step": 3}}})  # fmt: skip
    paths = {p.path for p in err.value.problems}
    assert paths == {"zfctl.early.steps", "zfctl.early.windows", "zfctl.early.overlap",
                     "zfctl.early.step"}  # fmt: skip
    assert 'did you mean "steps"' in str(err.value)
    auto = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "zenflow": {"update_interval": "auto"}}}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_config({**auto, "zfctl": {"early": {"steps": 50}}})
    (problem,) = err.value.problems
    assert problem.path == "zfctl.early.windows" and '"fixed"' in problem.fix
    fixed = load_config({**auto, "zfctl": {"early": {"steps": 50, "windows": "fixed"}}})
    assert fixed.engine.early.windows == "fixed"
