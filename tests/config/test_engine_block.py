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
    assert again.to_json_dict()["zfctl"] == {"stream_grads": False, "grad_accumulation": "device"}


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
