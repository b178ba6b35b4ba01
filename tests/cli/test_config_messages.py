"""Config messages found by issue 31: a JSON object or array as scheduler.type is a config
problem naming the key (it was a TypeError, exit 1); bf16.enabled's problem names all
three allowed values, "auto" included; a `zfctl init` flag's bad value is attributed to
that flag (``--window-lr bogus``), not to a ``--set`` the user never typed."""

from __future__ import annotations

import json

import pytest
from clihelp import assert_user_error

from zenflow.config import ConfigError, load_config


@pytest.mark.parametrize("kind", [{"type": "WarmupLR"}, ["WarmupLR"], 3])
def test_scheduler_type_that_is_not_a_string(kind, tmp_path, cli):
    """Old: `name not in _SCHEDULER_PARAMS` raised TypeError (unhashable dict or list)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"scheduler": {"type": kind, "params": {}}}))
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    (problem,) = exc.value.problems
    assert problem.path == "scheduler.type" and problem.value == kind
    assert "must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR" in problem.allowed
    r = cli("init", "--print", "--set", f"scheduler.type={json.dumps(kind)}")
    assert_user_error(r, "scheduler.type (from --set scheduler.type=", "must be one of WarmupLR")


@pytest.mark.parametrize("value", ["yes", 1, None], ids=["string", "number", "null"])
def test_bf16_enabled_names_auto_among_the_allowed_values(value):
    raw = {"bf16": {"enabled": value}}
    if value is None:  # null: not given, so off
        assert load_config(raw).bf16 is False
        return
    with pytest.raises(ConfigError) as exc:
        load_config(raw)
    (problem,) = exc.value.problems
    assert problem.path == "bf16.enabled"
    assert problem.allowed == 'must be true, false or "auto"'
    assert 'true, false or "auto"' in problem.fix
    for ok in (True, False, "auto"):
        assert load_config({"bf16": {"enabled": ok}}).bf16 == ok


def test_init_names_the_flag_a_bad_value_came_from(cli):
    """Old: "zfctl.window_lr (from --set zfctl.window_lr=bogus)" for `--window-lr bogus`."""
    r = cli("init", "--print", "--window-lr", "bogus", "--topk-ratio", "5")
    assert_user_error(
        r,
        "zfctl.window_lr (from --window-lr bogus) = 'bogus'",
        "zero_optimization.zenflow.topk_ratio (from --topk-ratio 5.0) = 5.0",
    )
    assert "--set" not in r.output
    # A --set item is still named as typed, beside a flag's problem.
    r = cli("init", "--print", "--lr", "-1", "--set", "zfctl.select_schedule=often")
    assert_user_error(r, "optimizer.params.lr (from --lr -1.0)",
                      "zfctl.select_schedule (from --set zfctl.select_schedule=often)")  # fmt: skip
