"""The config reader is strict where JSON is lax (issue 10 items 7 and 8): a key given twice
in one object is an error naming it by its path (DeepSpeed refuses such files; Python's
json would keep the last value silently), and nesting too deep is a ConfigError, never a
RecursionError."""

from __future__ import annotations

import pytest

from zenflow.config import ConfigError, load_config
from zenflow.config.loader import MAX_DEPTH

BASE = '"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}'


def _load_text(tmp_path, text: str):
    path = tmp_path / "ds.json"
    path.write_text(text, encoding="utf-8")
    return load_config(path), str(path)


def test_duplicate_keys_are_named_by_path(tmp_path):
    text = (
        '{"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, '
        '"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "lr": 2e-3}}, '
        '"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5, '
        '"list": [{"a": 1, "a": 1}]}'
    )
    with pytest.raises(ConfigError) as exc:
        _load_text(tmp_path, text)
    paths = sorted(p.path for p in exc.value.problems)
    assert paths == ["gradient_clipping", "list[0].a", "optimizer.params.lr"]
    by_path = {p.path: p for p in exc.value.problems}
    assert by_path["optimizer.params.lr"].value == [1e-3, 2e-3]
    assert "is given 2 times in the same JSON object" in by_path["gradient_clipping"].allowed
    assert str(tmp_path / "ds.json") in str(exc.value)


def test_the_same_key_in_different_objects_is_fine(tmp_path):
    cfg, _ = _load_text(tmp_path, '{"x": {"lr": 1}, "y": {"lr": 2}, ' + BASE + "}")
    assert cfg.raw["x"] == {"lr": 1} and cfg.raw["y"] == {"lr": 2}


@pytest.mark.parametrize("depth", [MAX_DEPTH, MAX_DEPTH + 1, 50_000])
def test_nesting_depth(tmp_path, depth):
    # "x" is at level 2 (the top-level object is 1): depth - 1 more arrays reach `depth`.
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    text = "{" + BASE + ', "x": ' + inner + "}"
    if depth <= MAX_DEPTH:
        cfg, _ = _load_text(tmp_path, text)
        assert "x" in cfg.raw
        return
    with pytest.raises(ConfigError) as exc:
        _load_text(tmp_path, text)
    (problem,) = exc.value.problems
    assert f"more than {MAX_DEPTH} levels deep" in problem.allowed
    # the first level too deep, MAX_DEPTH + 1, is x (level 2) and MAX_DEPTH - 1 [0] below it
    assert problem.path in ("(top level)", "x" + "[0]" * (MAX_DEPTH - 1))


def test_nesting_depth_of_a_dict_and_of_overrides():
    deep: dict = {}
    node = deep
    for _ in range(5000):  # deeper than Python's recursion limit: deepcopy would crash
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ConfigError, match="levels deep"):
        load_config({"train_micro_batch_size_per_gpu": 4, "deep": deep})
    with pytest.raises(ConfigError, match="levels deep"):
        load_config({"train_micro_batch_size_per_gpu": 4}, overrides={"x": deep})
