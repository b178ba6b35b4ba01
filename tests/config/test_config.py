"""zenflow.config: the DeepSpeed JSON contract of ZENFLOW.md section 3."""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zenflow.config import (
    FIELD_DOCS,
    Config,
    ConfigError,
    ConfigProblem,
    OptimizerConfig,
    SchedulerConfig,
    ZenFlowConfig,
    apply_overrides,
    load_config,
    parse_set_args,
    replace_zenflow,
)
from zenflow.config.schema import MISSING
from zenflow.errors import UserInputError

ZF = "zero_optimization.zenflow"

# The block of ZENFLOW.md section 3, verbatim.
DOC_EXAMPLE = """
{
  "train_micro_batch_size_per_gpu": 4,
  "zero_optimization": {
    "stage": 2,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "zenflow": {
      "topk_ratio": 0.05,
      "select_strategy": "auto",
      "select_interval": "auto",
      "update_interval": 4,
      "full_warm_up_rounds": 0,
      "overlap_step": true
    }
  }
}
"""


def base(**zenflow) -> dict:
    """A minimal valid ZenFlow config with ``zenflow`` keys merged into its block."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "zenflow": dict(zenflow),
        },
    }


def problems_of(cfg, **kw) -> tuple[ConfigProblem, ...]:
    with pytest.raises(ConfigError) as info:
        load_config(cfg, **kw)
    return info.value.problems


def only_problem(cfg, **kw) -> ConfigProblem:
    problems = problems_of(cfg, **kw)
    assert len(problems) == 1, problems
    return problems[0]


# ------------------------------------------------------------------------------ example


def test_doc_example_accepted_as_is(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(DOC_EXAMPLE)
    cfg = load_config(path)
    assert cfg.zenflow == ZenFlowConfig(
        topk_ratio=0.05,
        select_strategy="auto",
        select_interval="auto",
        update_interval=4,
        full_warm_up_rounds=0,
        overlap_step=True,
        auto_ratio=0.99,
        pt_reserved_cores_perc=0.5,
    )
    assert cfg.zero_stage == 2
    assert cfg.offload_device == "cpu"
    assert cfg.pin_memory is True
    assert cfg.source == str(path)
    assert cfg.ignored == ()
    assert cfg.raw == json.loads(DOC_EXAMPLE)


def test_defaults_filled():
    cfg = load_config(base())
    assert cfg.zenflow == ZenFlowConfig()
    z = cfg.zenflow
    assert (z.topk_ratio, z.select_strategy, z.select_interval, z.update_interval) == (
        0.1,
        "auto",
        "auto",
        "auto",
    )
    assert (z.full_warm_up_rounds, z.overlap_step, z.auto_ratio, z.pt_reserved_cores_perc) == (
        0,
        False,
        0.99,
        0.5,
    )
    assert cfg.optimizer == OptimizerConfig("AdamW", 1e-3, (0.9, 0.999), 1e-8, 0.0, True)
    assert cfg.scheduler.type is None and dict(cfg.scheduler.params) == {}
    assert cfg.gradient_clipping == 1.0  # DeepSpeed 0.19.6's default
    assert (cfg.bf16, cfg.fp16, cfg.steps_per_print, cfg.wall_clock_breakdown) == (
        False,
        False,
        10,
        False,
    )
    assert cfg.source == "<dict>"


def test_empty_config_is_plain_training():
    cfg = load_config({})
    assert cfg.zenflow is None
    # pin_memory defaults to true (DeepSpeed's default is false): pageable staging would make
    # every device->host copy synchronous; only what crosses the link is pinned
    assert (cfg.zero_stage, cfg.offload_device, cfg.pin_memory) == (0, "none", True)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (None, None)
    assert cfg.gradient_accumulation_steps == 1


def test_field_docs_cover_every_zenflow_field():
    names = {f for f in ZenFlowConfig.__dataclass_fields__}
    assert set(FIELD_DOCS) == names
    assert all(len(doc) > 20 for doc in FIELD_DOCS.values())


def test_dataclasses_are_frozen():
    cfg = load_config(base())
    with pytest.raises(AttributeError):
        cfg.zero_stage = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.zenflow.topk_ratio = 0.5  # type: ignore[misc,union-attr]
    with pytest.raises(TypeError):
        cfg.scheduler.params["x"] = 1  # type: ignore[index]


# ------------------------------------------------------------------- zenflow table rules

GOOD_VALUES = [
    ("topk_ratio", 1.0, 1.0),
    ("topk_ratio", 1, 1.0),
    ("topk_ratio", 1e-4, 1e-4),
    ("select_strategy", "step", "step"),
    ("select_strategy", "epoch", "epoch"),
    ("update_interval", 1, 1),
    ("update_interval", "auto", "auto"),
    ("full_warm_up_rounds", 0, 0),
    ("full_warm_up_rounds", 7, 7),
    ("overlap_step", False, False),
    ("auto_ratio", 1.0, 1.0),
    ("auto_ratio", 0.5, 0.5),
    ("pt_reserved_cores_perc", 0.25, 0.25),
]


@pytest.mark.parametrize(("key", "value", "expected"), GOOD_VALUES)
def test_zenflow_good_values(key, value, expected):
    cfg = load_config(base(**{key: value}))
    got = getattr(cfg.zenflow, key)
    assert got == expected and type(got) is type(expected)


BAD_VALUES = [
    ("topk_ratio", 0),
    ("topk_ratio", 0.0),
    ("topk_ratio", -0.1),
    ("topk_ratio", 1.01),
    ("topk_ratio", "0.1"),
    ("topk_ratio", True),
    ("topk_ratio", "auto"),
    ("select_strategy", "Auto"),
    ("select_strategy", "steps"),
    ("select_strategy", 1),
    ("select_interval", 0),
    ("select_interval", -2),
    ("select_interval", 2.0),
    ("select_interval", "sometimes"),
    ("select_interval", True),
    ("update_interval", 0),
    ("update_interval", 4.5),
    ("update_interval", "4"),
    ("update_interval", False),
    ("full_warm_up_rounds", -1),
    ("full_warm_up_rounds", 1.0),
    ("full_warm_up_rounds", True),
    ("full_warm_up_rounds", "auto"),
    ("overlap_step", 1),
    ("overlap_step", 0),
    ("overlap_step", "true"),
    ("auto_ratio", 0),
    ("auto_ratio", 1.5),
    ("auto_ratio", False),
    ("pt_reserved_cores_perc", 0),
    ("pt_reserved_cores_perc", 1),
    ("pt_reserved_cores_perc", 1.0),
    ("pt_reserved_cores_perc", -0.5),
    ("pt_reserved_cores_perc", None),
    ("topk_ratio", float("nan")),
    ("topk_ratio", float("inf")),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES)
def test_zenflow_bad_value_is_one_problem_naming_path_and_value(key, value):
    p = only_problem(base(**{key: value}))
    assert p.path == f"{ZF}.{key}"
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(p.value)
    else:
        assert p.value == value and type(p.value) is type(value)
    assert p.allowed and p.fix
    line = str(p)
    assert line.startswith(f"{ZF}.{key} = {value!r}: ")
    assert "Fix: " in line


def test_int_select_interval_needs_step_or_epoch_strategy():
    p = only_problem(base(select_interval=3))  # strategy defaults to "auto"
    assert p.path == f"{ZF}.select_interval" and p.value == 3
    assert "step" in p.allowed and "epoch" in p.allowed
    p = only_problem(base(select_strategy="auto", select_interval=3))
    assert p.path == f"{ZF}.select_interval"
    assert load_config(base(select_strategy="step", select_interval=3)).zenflow.select_interval == 3
    cfg = load_config(base(select_strategy="epoch", select_interval=2))
    assert (cfg.zenflow.select_strategy, cfg.zenflow.select_interval) == ("epoch", 2)
    # "auto" interval goes with any strategy
    assert load_config(base(select_strategy="step")).zenflow.select_interval == "auto"


def test_unknown_zenflow_key_is_an_error_with_suggestion():
    p = only_problem(base(topk_ration=0.2))
    assert p.path == f"{ZF}.topk_ration" and p.value == 0.2
    assert 'did you mean "topk_ratio"' in p.fix
    p = only_problem(base(overlap_steps=True))
    assert 'did you mean "overlap_step"' in p.fix
    p = only_problem(base(frobnicate=1))
    assert "did you mean" not in p.fix
    assert "unknown key" in p.allowed


def test_deepspeed_only_zenflow_keys_are_errors_not_ignored():
    p = only_problem(base(offload=True))
    assert p.path == f"{ZF}.offload" and "not supported" in p.allowed


def test_zenflow_block_must_be_object():
    cfg = base()
    cfg["zero_optimization"]["zenflow"] = [1]
    p = only_problem(cfg)
    assert p.path == ZF and p.value == [1]


def test_zenflow_requires_stage_2_and_cpu_offload():
    cfg = base()
    cfg["zero_optimization"]["stage"] = 3
    p = only_problem(cfg)
    assert (p.path, p.value) == ("zero_optimization.stage", 3)
    cfg = base()
    del cfg["zero_optimization"]["stage"]
    p = only_problem(cfg)
    assert p.path == "zero_optimization.stage" and p.value is MISSING
    assert "(missing)" in str(p)
    cfg = base()
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "none"
    p = only_problem(cfg)
    assert (p.path, p.value) == ("zero_optimization.offload_optimizer.device", "none")
    cfg = base()
    del cfg["zero_optimization"]["offload_optimizer"]
    p = only_problem(cfg)
    assert p.path == "zero_optimization.offload_optimizer.device" and p.value is MISSING


def test_zero_rules_without_zenflow():
    cfg = load_config({"zero_optimization": {"stage": 1}})
    assert (cfg.zenflow, cfg.zero_stage, cfg.offload_device) == (None, 1, "none")
    for bad in (4, -1, "2", 2.0):
        p = only_problem({"zero_optimization": {"stage": bad}})
        assert (p.path, p.value) == ("zero_optimization.stage", bad)
    p = only_problem({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    assert (p.path, p.value) == ("zero_optimization.offload_optimizer.device", "nvme")
    p = only_problem({"zero_optimization": {"offload_optimizer": {"pin_memory": "yes"}}})
    assert p.path == "zero_optimization.offload_optimizer.pin_memory"


# ------------------------------------------------------------------- rest of the config


def test_optimizer_parsed_and_normalised():
    cfg = load_config(
        {
            "optimizer": {
                "type": "adamw",
                "params": {"lr": 3e-5, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1},
            }
        }
    )
    assert cfg.optimizer == OptimizerConfig("AdamW", 3e-5, (0.8, 0.95), 1e-6, 0.1, True)
    assert load_config({"optimizer": {"type": "ADAM"}}).optimizer.adamw_mode is True
    adam_l2 = load_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert (adam_l2.optimizer.type, adam_l2.optimizer.adamw_mode) == ("Adam", False)
    # JSON ints are fine where a float is expected
    assert load_config({"optimizer": {"type": "AdamW", "params": {"lr": 1}}}).optimizer.lr == 1.0


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("optimizer.type", "Lamb"),
        ("optimizer.type", "SGD"),
        ("optimizer.type", 3),
        ("optimizer.params.lr", "auto"),
        ("optimizer.params.lr", 0),
        ("optimizer.params.lr", -1e-3),
        ("optimizer.params.lr", "1e-3"),
        ("optimizer.params.eps", 0.0),
        ("optimizer.params.weight_decay", -0.01),
        ("optimizer.params.weight_decay", "auto"),
        ("optimizer.params.betas", [0.9]),
        ("optimizer.params.betas", [0.9, 1.0]),
        ("optimizer.params.betas", "auto"),
        ("optimizer.params.betas", [0.9, "0.99"]),
        ("optimizer.params.adam_w_mode", 1),
        ("train_batch_size", 0),
        ("train_batch_size", "auto"),
        ("train_micro_batch_size_per_gpu", 2.0),
        ("gradient_accumulation_steps", 0),
        ("gradient_accumulation_steps", True),
        ("gradient_clipping", -1.0),
        ("gradient_clipping", "auto"),
        ("bf16.enabled", 1),
        ("fp16.enabled", "false"),
        ("steps_per_print", 0),
        ("steps_per_print", 2.5),
        ("wall_clock_breakdown", "no"),
    ],
)
def test_honoured_key_bad_value(path, value):
    cfg = apply_overrides({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, {path: value})
    p = only_problem(cfg)
    assert (p.path, p.value) == (path, value)


def test_auto_in_optimizer_names_the_fix():
    p = only_problem({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert '"auto"' in p.fix


def test_fp16_is_not_supported():
    p = only_problem({"fp16": {"enabled": True}})
    assert (p.path, p.value) == ("fp16.enabled", True)
    assert "not supported by the zenflow engine" in p.allowed and "bf16" in p.fix
    cfg = load_config({"fp16": {"enabled": False, "loss_scale": 0}, "bf16": {"enabled": True}})
    assert (cfg.fp16, cfg.bf16) == (False, True)
    assert cfg.ignored == ("fp16.loss_scale",)


def test_bfloat16_alias():
    assert load_config({"bfloat16": {"enabled": True}}).bf16 is True
    p = only_problem({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert p.path == "bfloat16"


def test_scheduler_defaults_filled_and_max_lr_from_optimizer():
    opt = {"type": "AdamW", "params": {"lr": 5e-5}}
    cfg = load_config({"optimizer": opt, "scheduler": {"type": "WarmupLR"}})
    assert cfg.scheduler.type == "WarmupLR"
    assert dict(cfg.scheduler.params) == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 5e-5,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    }
    cfg = load_config(
        {
            "optimizer": opt,
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}},
        }
    )
    assert cfg.scheduler.params["warmup_max_lr"] == 5e-5
    assert cfg.scheduler.params["total_num_steps"] == 500
    cfg = load_config(
        {
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"total_num_steps": 50, "cos_min_ratio": 0.1, "last_batch_iteration": -1},
            }
        }
    )
    assert dict(cfg.scheduler.params) == {
        "total_num_steps": 50,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.1,
        "warmup_type": "log",
    }
    assert cfg.ignored == ("scheduler.params.last_batch_iteration",)


@pytest.mark.parametrize(
    ("sched", "path", "value"),
    [
        ({"type": "OneCycle"}, "scheduler.type", "OneCycle"),
        ({"params": {}}, "scheduler.type", MISSING),
        ({"type": "WarmupDecayLR"}, "scheduler.params.total_num_steps", MISSING),
        ({"type": "WarmupCosineLR"}, "scheduler.params.total_num_steps", MISSING),
        (
            {"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
            "scheduler.params.warmup_type",
            "cosine",
        ),
        (
            {"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
            "scheduler.params.warmup_num_steps",
            0,
        ),
        (
            {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
            "scheduler.params.warmup_max_lr",
            "auto",
        ),
        (
            {"type": "WarmupLR", "params": {"warmup_min_lr": -1.0}},
            "scheduler.params.warmup_min_lr",
            -1.0,
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 2}},
            "scheduler.params.cos_min_ratio",
            2,
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_min_ratio": -1}},
            "scheduler.params.warmup_min_ratio",
            -1,
        ),
        (
            {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}},
            "scheduler.params.total_num_steps",
            0,
        ),
    ],
)
def test_scheduler_bad(sched, path, value):
    p = only_problem({"scheduler": sched})
    assert p.path == path
    assert p.value is value if value is MISSING else p.value == value


# ------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ({"train_micro_batch_size_per_gpu": 4}, 1, (4, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 1, (12, 4, 3)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, 1, (32, 8, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 1, (32, 16, 2)),
        ({"train_batch_size": 32}, 1, (32, 32, 1)),
        (
            {
                "train_batch_size": 24,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 3,
            },
            2,
            (24, 4, 3),
        ),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, 2, (32, 8, 2)),
        ({"gradient_accumulation_steps": 5}, 1, (None, None, 5)),
    ],
)
def test_gradient_accumulation_derivation(given, world, expected):
    cfg = load_config(given, world_size=world)
    got = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    assert got == expected


@pytest.mark.parametrize(
    "given",
    [
        {
            "train_batch_size": 30,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        },
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
        {"train_batch_size": 30, "gradient_accumulation_steps": 4},
    ],
)
def test_inconsistent_batch_sizes(given):
    p = only_problem(given)
    assert (p.path, p.value) == ("train_batch_size", 30)
    assert "train_micro_batch_size_per_gpu" in p.allowed


def test_world_size_enters_the_batch_rule():
    given = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    assert load_config(given).gradient_accumulation_steps == 2
    p = only_problem(given, world_size=2)
    assert "4 * 2 * 2 = 16" in p.allowed


# ------------------------------------------------------------------- ignored keys


def test_ignored_keys_listed_not_errors():
    raw = base(topk_ratio=0.2)
    raw["activation_checkpointing"] = {"partition_activations": True}
    raw["zero_optimization"]["overlap_comm"] = True
    raw["zero_optimization"]["offload_optimizer"]["buffer_count"] = 4
    raw["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}
    raw["bf16"] = {"enabled": True, "immediate_grad_update": True}
    raw["scheduler"] = {"type": "WarmupLR", "params": {"total_num_steps": 10}}
    cfg = load_config(raw)
    assert set(cfg.ignored) == {
        "activation_checkpointing",
        "zero_optimization.overlap_comm",
        "zero_optimization.offload_optimizer.buffer_count",
        "optimizer.params.torch_adam",
        "bf16.immediate_grad_update",
        "scheduler.params.total_num_steps",  # not a WarmupLR parameter
    }
    assert cfg.zenflow.topk_ratio == 0.2 and cfg.bf16 is True


# ------------------------------------------------------------------- all problems at once


def test_several_problems_reported_together(tmp_path):
    raw = base(topk_ratio=2, overlap_step=1, update_intervall=4)
    raw["zero_optimization"]["stage"] = 3
    raw["optimizer"] = {"type": "Lamb", "params": {"lr": "auto"}}
    raw["fp16"] = {"enabled": True}
    raw["train_batch_size"] = 7
    raw["gradient_accumulation_steps"] = 2
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    paths = {(p.path, repr(p.value)) for p in err.problems}
    assert paths == {
        (f"{ZF}.topk_ratio", "2"),
        (f"{ZF}.overlap_step", "1"),
        (f"{ZF}.update_intervall", "4"),
        ("zero_optimization.stage", "3"),
        ("optimizer.type", "'Lamb'"),
        ("optimizer.params.lr", "'auto'"),
        ("fp16.enabled", "True"),
        ("train_batch_size", "7"),
    }
    assert err.source == str(path)
    lines = str(err).splitlines()
    assert lines[0] == f"{path}: 8 problem(s) in the DeepSpeed config:"
    assert len(lines) == 9
    for line, p in zip(lines[1:], err.problems, strict=True):
        assert line == f"  - {p.path} = {p.value!r}: {p.allowed}. Fix: {p.fix}"
    assert isinstance(err, ValueError) and isinstance(err, UserInputError)


# ------------------------------------------------------------------- files and syntax


def test_json_syntax_error_names_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "steps_per_print": 10,\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (p,) = info.value.problems
    assert "line 4, column 1" in p.path
    assert "not valid JSON" in p.allowed
    assert "trailing comma" in p.fix
    assert str(info.value).startswith(f"{path}: 1 problem(s)")


def test_unreadable_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    (p,) = info.value.problems
    assert p.value == str(missing) and "cannot be read" in p.allowed


def test_top_level_must_be_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    (p,) = problems_of(path)
    assert "JSON object" in p.allowed


# ------------------------------------------------------------------- overrides


def test_apply_overrides_creates_dicts_and_copies():
    raw = {"zero_optimization": {"stage": 2}}
    out = apply_overrides(
        raw, {"zero_optimization.zenflow.topk_ratio": 0.05, "bf16.enabled": True, "x": 1}
    )
    assert out == {
        "zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.05}},
        "bf16": {"enabled": True},
        "x": 1,
    }
    assert raw == {"zero_optimization": {"stage": 2}}  # input untouched


def test_apply_overrides_through_a_scalar_is_an_error():
    with pytest.raises(ConfigError) as info:
        apply_overrides({"bf16": True}, {"bf16.enabled": True, "a..b": 1})
    assert [p.path for p in info.value.problems] == ["bf16", "a..b"]


def test_load_config_with_overrides(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(DOC_EXAMPLE)
    overrides = parse_set_args(
        [
            "zero_optimization.zenflow.topk_ratio=0.2",
            "zero_optimization.zenflow.update_interval=auto",
            "optimizer.type=AdamW",
            "optimizer.params.lr=3e-4",
        ]
    )
    cfg = load_config(path, overrides)
    assert cfg.zenflow.topk_ratio == 0.2 and cfg.zenflow.update_interval == "auto"
    assert cfg.optimizer.lr == 3e-4
    assert cfg.raw["zero_optimization"]["zenflow"]["topk_ratio"] == 0.2
    # a bad override is reported with its path like a bad file value
    (p,) = problems_of(path, overrides={"zero_optimization.zenflow.topk_ratio": 0})
    assert (p.path, p.value) == (f"{ZF}.topk_ratio", 0)


def test_parse_set_args_values():
    got = parse_set_args(
        [
            "a.b=0.05",
            "c=true",
            "d=4",
            'e="x"',
            "f=auto",
            "g=AdamW",
            "h=[0.9, 0.99]",
            "i=null",
            "j=",
            "k=a=b",
        ]
    )
    assert got == {
        "a.b": 0.05,
        "c": True,
        "d": 4,
        "e": "x",
        "f": "auto",
        "g": "AdamW",
        "h": [0.9, 0.99],
        "i": None,
        "j": "",
        "k": "a=b",
    }
    assert type(got["d"]) is int


def test_parse_set_args_malformed_names_the_item():
    with pytest.raises(ConfigError) as info:
        parse_set_args(["ok=1", "novalue", "=3", "a..b=1"])
    assert [p.value for p in info.value.problems] == ["novalue", "=3", "a..b=1"]
    assert "novalue" in str(info.value)


# ------------------------------------------------------------------- JSON round trip


def _full_config() -> dict:
    raw = base(topk_ratio=0.05, update_interval="auto", select_strategy="step", select_interval=10)
    raw.update(
        {
            "train_batch_size": 16,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.5,
            "bf16": {"enabled": True},
            "steps_per_print": 5,
            "wall_clock_breakdown": True,
            "optimizer": {"type": "adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
            "activation_checkpointing": {"partition_activations": False},
        }
    )
    raw.pop("train_micro_batch_size_per_gpu")
    return raw


@pytest.mark.parametrize(
    "raw",
    [
        _full_config(),
        base(),
        {},
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        {"train_batch_size": 12},
    ],
)
def test_to_json_dict_round_trip(raw):
    cfg = load_config(raw)
    out = cfg.to_json_dict()
    json.dumps(out)  # plain JSON types only
    again = load_config(out)
    assert again == cfg
    assert again.ignored == cfg.ignored
    assert again.to_json_dict() == out


def test_to_json_dict_is_a_complete_deepspeed_config():
    cfg = load_config(_full_config())
    out = cfg.to_json_dict()
    assert out["zero_optimization"]["zenflow"] == {
        "topk_ratio": 0.05,
        "select_strategy": "step",
        "select_interval": 10,
        "update_interval": "auto",
        "full_warm_up_rounds": 0,
        "overlap_step": False,
        "auto_ratio": 0.99,
        "pt_reserved_cores_perc": 0.5,
    }
    assert out["optimizer"] == {
        "type": "Adam",
        "params": {
            "lr": 1e-4,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.0,
            "adam_w_mode": False,
        },
    }
    assert out["scheduler"]["params"]["warmup_max_lr"] == 1e-4
    assert out["activation_checkpointing"] == {"partition_activations": False}
    assert (out["train_batch_size"], out["gradient_accumulation_steps"]) == (16, 2)
    assert out["train_micro_batch_size_per_gpu"] == 8
    assert out["bf16"] == {"enabled": True}


def test_to_json_dict_resolved_replaces_only_auto_values():
    cfg = load_config(base(update_interval="auto", topk_ratio=0.3))
    out = cfg.to_json_dict(
        resolved={
            "update_interval": 6,
            "topk_ratio": 0.9,  # not "auto": kept
            "select_strategy": "epoch",
            "select_interval": 1,
            "steps_per_epoch": 123,  # not a zenflow field: skipped
        }
    )
    block = out["zero_optimization"]["zenflow"]
    assert block["update_interval"] == 6
    assert block["topk_ratio"] == 0.3
    assert (block["select_strategy"], block["select_interval"]) == ("epoch", 1)
    assert "steps_per_epoch" not in block
    again = load_config(out)
    assert again.zenflow.update_interval == 6
    assert cfg.zenflow.update_interval == "auto"  # the config itself is unchanged


def test_replace_zenflow():
    cfg = load_config(base(topk_ratio=0.05))
    new = replace_zenflow(cfg, update_interval=8, overlap_step=True)
    assert new.zenflow == ZenFlowConfig(topk_ratio=0.05, update_interval=8, overlap_step=True)
    assert cfg.zenflow.update_interval == "auto"
    assert load_config(new.to_json_dict()) == new
    with pytest.raises(ConfigError) as info:
        replace_zenflow(cfg, topk_ratio=0, bogus=1)
    assert {p.path for p in info.value.problems} == {f"{ZF}.topk_ratio", f"{ZF}.bogus"}
    plain = load_config({})
    assert replace_zenflow(plain, topk_ratio=0.2).zenflow == ZenFlowConfig(topk_ratio=0.2)


def test_config_equality_ignores_source(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(DOC_EXAMPLE)
    assert load_config(path) == load_config(json.loads(DOC_EXAMPLE))
    assert load_config(path) != load_config(json.loads(DOC_EXAMPLE), {"steps_per_print": 3})


def test_scheduler_config_default():
    assert SchedulerConfig() == SchedulerConfig(None, {})
    assert isinstance(load_config({}), Config)


# ------------------------------------------------------------------- property test

_zf_values = st.fixed_dictionaries(
    {},
    optional={
        "topk_ratio": st.floats(0.001, 1.0),
        "update_interval": st.one_of(st.integers(1, 64), st.just("auto")),
        "full_warm_up_rounds": st.integers(0, 100),
        "overlap_step": st.booleans(),
        "auto_ratio": st.floats(0.01, 1.0),
        "pt_reserved_cores_perc": st.floats(0.01, 0.99),
        "select_strategy": st.sampled_from(["step", "epoch"]),
        "select_interval": st.integers(1, 50),
    },
)


@given(_zf_values)
def test_valid_blocks_round_trip(block):
    if "select_interval" in block and "select_strategy" not in block:
        block["select_strategy"] = "step"  # an int interval needs step or epoch
    cfg = load_config(base(**block))
    for key, value in block.items():
        assert getattr(cfg.zenflow, key) == value
    assert load_config(copy.deepcopy(cfg.to_json_dict())) == cfg
