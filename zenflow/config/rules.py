"""The rules of a DeepSpeed config: what ``zenflow.config.load_config`` checks.

Typed readers that collect problems instead of raising, the zenflow block (ZENFLOW.md
section 3: fields, defaults, allowed values, cross-field rules), and the honoured keys of
the rest of the file (optimizer, scheduler, batch sizes, ZeRO stage and offload). The entry
points are ``validate`` (a whole file) and ``parse_zenflow`` (one zenflow block); both
append every problem they find to a list, so one file's problems are reported together.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

from zenflow.config.schema import (
    _BATCH_KEYS,
    MISSING,
    Config,
    ConfigError,
    ConfigProblem,
    EngineOptions,
    LogDirConfig,
    MonitorConfig,
    OptimizerConfig,
    SchedulerConfig,
    WandbConfig,
    ZenFlowConfig,
)

# --------------------------------------------------------------------------------------
# Typed readers. Each appends a problem and returns None (or the default) on a bad value.
# --------------------------------------------------------------------------------------


# The largest whole number a config key takes (steps, rounds, intervals, batch sizes): a
# bigger one is a typo or a pasted exponent, and would overflow a C int further in.
MAX_INT = 2**31 - 1


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _type_fix(path: str, what: str, value: Any) -> str:
    leaf = path.rsplit(".", 1)[-1]
    if value == "auto":
        return f'replace "auto" with {what}; only the zenflow block takes "auto" (where allowed)'
    if isinstance(value, str):
        return f'write {leaf} as {what} without quotes, e.g. "{leaf}": ...'
    return f"set {leaf} to {what}"


class _Reader:
    """Collects problems while reading typed values out of JSON objects."""

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []
        self.ignored: list[str] = []

    def problem(self, path: str, value: Any, allowed: str, fix: str) -> None:
        self.problems.append(ConfigProblem(path, value, allowed, fix))

    def obj(self, parent: Mapping, key: str, path: str) -> dict | None:
        """A nested JSON object, None when absent or null."""
        value = parent.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            self.problem(
                path, value, "must be a JSON object", f"write {key} as {{...}} or remove it"
            )
            return None
        return dict(value)

    def boolean(self, parent: Mapping, key: str, path: str, default: bool) -> bool:
        value = parent.get(key)
        if value is None:
            return default
        if not _is_bool(value):
            self.problem(
                path, value, "must be true or false", _type_fix(path, "true or false", value)
            )
            return default
        return value

    def integer(
        self, parent: Mapping, key: str, path: str, default: Any, lo: int, hi: int | None = None
    ) -> Any:
        value = parent.get(key)
        if value is None:
            return default
        rng = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"
        if not _is_int(value):
            self.problem(path, value, f"must be {rng}", _type_fix(path, rng, value))
            return default
        if hi is None and value > MAX_INT:
            hi, rng = MAX_INT, f"an integer from {lo} to {MAX_INT}"
        if value < lo or (hi is not None and value > hi):
            self.problem(path, value, f"must be {rng}", f"set {key} to {rng}")
            return default
        return value

    def number(
        self,
        parent: Mapping,
        key: str,
        path: str,
        default: Any,
        rule: str,
        ok: Any,
    ) -> Any:
        """A float (JSON ints accepted and converted) that satisfies ``ok``; ``rule`` says it."""
        value = parent.get(key)
        if value is None:
            return default
        if not _is_number(value):
            self.problem(
                path, value, f"must be a number {rule}", _type_fix(path, "a number", value)
            )
            return default
        if not ok(value):
            self.problem(path, value, f"must be a number {rule}", f"set {key} to a number {rule}")
            return default
        return float(value)

    def ignore_unknown(self, obj: Mapping, known: Sequence[str], path: str) -> None:
        for key in obj:
            if key not in known:
                self.ignored.append(f"{path}.{key}" if path else str(key))


# --------------------------------------------------------------------------------------
# The zenflow block
# --------------------------------------------------------------------------------------

_ZENFLOW_FIELDS = tuple(f.name for f in dataclasses.fields(ZenFlowConfig))
# Keys DeepSpeed's own ZenFlowConfig knows but this engine does not implement.
_DEEPSPEED_ONLY_ZENFLOW_KEYS = {
    "offload": "DeepSpeed's option to keep the selective optimizer state on the CPU; this "
    "engine keeps it on the device",
    "steps_per_epoch": "DeepSpeed fills it in at run time; the engine takes the epoch length "
    "from the data loader",
}


def parse_zenflow(block: Mapping, path: str, problems: list[ConfigProblem]) -> ZenFlowConfig:
    """The zenflow block at JSON path ``path`` as a ``ZenFlowConfig``.

    Every problem (unknown key, with a "did you mean"; bad type or value; a cross-field
    rule) is appended to ``problems``; the fields in question keep their defaults.
    """
    r = _Reader()
    for key in block:
        if key in _ZENFLOW_FIELDS:
            continue
        kpath = f"{path}.{key}"
        if key in _DEEPSPEED_ONLY_ZENFLOW_KEYS:
            r.problem(
                kpath,
                block[key],
                f"not supported by the zenflow engine ({_DEEPSPEED_ONLY_ZENFLOW_KEYS[key]})",
                f"remove {key} from the zenflow block",
            )
            continue
        close = difflib.get_close_matches(str(key), _ZENFLOW_FIELDS, n=1, cutoff=0.6)
        hint = f'did you mean "{close[0]}"? ' if close else ""
        r.problem(
            kpath,
            block[key],
            f"unknown key in the zenflow block (known: {', '.join(_ZENFLOW_FIELDS)})",
            f"{hint}rename or remove {key}",
        )

    d = ZenFlowConfig()
    # Inside the zenflow block null is not "absent": DeepSpeed rejects it too.
    for key in _ZENFLOW_FIELDS:
        if key in block and block[key] is None:
            r.problem(f"{path}.{key}", None, "must not be null", f"set {key} or remove it")

    def p(key: str) -> str:
        return f"{path}.{key}"

    topk = r.number(
        block, "topk_ratio", p("topk_ratio"), d.topk_ratio, "in (0, 1]", lambda x: 0 < x <= 1
    )
    auto_ratio = r.number(
        block, "auto_ratio", p("auto_ratio"), d.auto_ratio, "in (0, 1]", lambda x: 0 < x <= 1
    )
    cores = r.number(
        block,
        "pt_reserved_cores_perc",
        p("pt_reserved_cores_perc"),
        d.pt_reserved_cores_perc,
        "in (0, 1) (strictly between)",
        lambda x: 0 < x < 1,
    )
    warm = r.integer(
        block, "full_warm_up_rounds", p("full_warm_up_rounds"), d.full_warm_up_rounds, 0
    )
    overlap = r.boolean(block, "overlap_step", p("overlap_step"), d.overlap_step)

    strategy = block.get("select_strategy", d.select_strategy)
    if strategy is None:
        strategy = d.select_strategy
    elif strategy not in ("auto", "step", "epoch"):
        r.problem(
            p("select_strategy"),
            strategy,
            'must be one of "auto", "step", "epoch"',
            'set select_strategy to "auto" (once per epoch), "step" or "epoch"',
        )
        strategy = None

    def interval(key: str) -> int | str:
        value = block.get(key, "auto")
        if value is None or value == "auto":
            return "auto"
        if not _is_int(value) or not 1 <= value <= MAX_INT:
            r.problem(
                p(key),
                value,
                f'must be an integer from 1 to {MAX_INT} or "auto"',
                f'set {key} to a whole number of steps such as 4, or to "auto"',
            )
            return "auto"
        return value

    select_interval = interval("select_interval")
    update_interval = interval("update_interval")
    if strategy == "auto" and _is_int(select_interval):
        r.problem(
            p("select_interval"),
            select_interval,
            'an integer interval needs select_strategy "step" or "epoch" '
            '(with "auto" the interval is one epoch)',
            'set select_strategy to "step" or "epoch", or select_interval to "auto"',
        )
    problems.extend(r.problems)
    return ZenFlowConfig(
        topk_ratio=topk,
        select_strategy=strategy or d.select_strategy,
        select_interval=select_interval,
        update_interval=update_interval,
        full_warm_up_rounds=warm,
        overlap_step=overlap,
        auto_ratio=auto_ratio,
        pt_reserved_cores_perc=cores,
    )


def run_length_notes(zf: ZenFlowConfig | None, total_steps: int) -> list[str]:
    """The zenflow block bounded against the run: each interval or count that is valid on
    its own but at least as long as the run's ``total_steps``, said as what then never
    happens (the run goes on; a note, not an error)."""
    if zf is None:
        return []
    notes = []
    block = "zero_optimization.zenflow"
    if _is_int(zf.update_interval) and zf.update_interval > total_steps:
        notes.append(
            f"{block}.update_interval {zf.update_interval} is longer than this run's "
            f"{total_steps} steps: the host never updates the non-selected columns during the "
            "run (only the final flush applies them); set it below the run's length."
        )
    if zf.full_warm_up_rounds >= total_steps:
        notes.append(
            f"{block}.full_warm_up_rounds {zf.full_warm_up_rounds} covers all {total_steps} "
            "steps: the whole run is warm-up (every parameter updated by offloaded AdamW), "
            "and selection never starts; lower it to use ZenFlow."
        )
    if zf.select_strategy == "step" and _is_int(zf.select_interval) \
            and zf.select_interval > total_steps:  # fmt: skip
        notes.append(
            f"{block}.select_interval {zf.select_interval} steps is longer than the run's "
            f"{total_steps}: the columns chosen first are never re-selected."
        )
    return notes


# --------------------------------------------------------------------------------------
# The rest of the DeepSpeed config
# --------------------------------------------------------------------------------------

_TOP_LEVEL_HONOURED = (
    *_BATCH_KEYS,
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "bf16",
    "bfloat16",
    "fp16",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_optimization",
    "tensorboard",
    "csv_monitor",
    "wandb",
    "zfctl",
)

_SCHEDULER_PARAMS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": (
        "total_num_steps",
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
    ),
    "WarmupCosineLR": (
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
    ),
}
# DeepSpeed 0.19.6's defaults (deepspeed/runtime/lr_schedules.py); warmup_max_lr: see
# SchedulerConfig.
_SCHEDULER_DEFAULTS: dict[str, Any] = {
    "warmup_min_lr": 0.0,
    "warmup_num_steps": 1000,
    "warmup_type": "log",
    "warmup_min_ratio": 0.0,
    "cos_min_ratio": 0.0001,
}


def _parse_optimizer(r: _Reader, raw: Mapping) -> OptimizerConfig:
    d = OptimizerConfig()
    block = r.obj(raw, "optimizer", "optimizer")
    if block is None:
        return d
    r.ignore_unknown(block, ("type", "params"), "optimizer")
    name = block.get("type")
    opt_type = d.type
    if name is None:
        r.problem("optimizer.type", MISSING, 'must be "AdamW" or "Adam"', 'add "type": "AdamW"')
    elif not isinstance(name, str) or name.lower() not in ("adamw", "adam"):
        r.problem(
            "optimizer.type",
            name,
            'must be "AdamW" or "Adam" (the zenflow engine implements only Adam-family steps)',
            'set optimizer.type to "AdamW"',
        )
    else:
        opt_type = "AdamW" if name.lower() == "adamw" else "Adam"
    params = r.obj(block, "params", "optimizer.params") or {}
    r.ignore_unknown(
        params, ("lr", "betas", "eps", "weight_decay", "adam_w_mode"), "optimizer.params"
    )
    lr = r.number(params, "lr", "optimizer.params.lr", d.lr, "> 0", lambda x: x > 0)
    eps = r.number(params, "eps", "optimizer.params.eps", d.eps, "> 0", lambda x: x > 0)
    wd = r.number(
        params,
        "weight_decay",
        "optimizer.params.weight_decay",
        d.weight_decay,
        ">= 0",
        lambda x: x >= 0,
    )
    betas = d.betas
    raw_betas = params.get("betas")
    if raw_betas is not None:
        ok = (
            isinstance(raw_betas, (list, tuple))
            and len(raw_betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in raw_betas)
        )
        if ok:
            betas = (float(raw_betas[0]), float(raw_betas[1]))
        else:
            r.problem(
                "optimizer.params.betas",
                raw_betas,
                "must be a list of two numbers, each 0 <= b < 1",
                "set betas to e.g. [0.9, 0.999]",
            )
    adam_w_mode = r.boolean(params, "adam_w_mode", "optimizer.params.adam_w_mode", True)
    if opt_type == "AdamW":
        if params.get("adam_w_mode") is False:
            r.problem(
                "optimizer.params.adam_w_mode",
                False,
                'type "AdamW" always decouples weight decay',
                'use type "Adam" with adam_w_mode false for L2-style decay, or remove adam_w_mode',
            )
        adam_w_mode = True
    return OptimizerConfig(
        type=opt_type, lr=lr, betas=betas, eps=eps, weight_decay=wd, adamw_mode=adam_w_mode
    )


def _parse_scheduler(r: _Reader, raw: Mapping, optimizer_lr: float) -> SchedulerConfig:
    block = r.obj(raw, "scheduler", "scheduler")
    if block is None:
        return SchedulerConfig()
    r.ignore_unknown(block, ("type", "params"), "scheduler")
    name = block.get("type")
    if name not in _SCHEDULER_PARAMS:
        r.problem(
            "scheduler.type",
            MISSING if name is None else name,
            f"must be one of {', '.join(_SCHEDULER_PARAMS)}",
            'set scheduler.type to "WarmupLR" (or remove the scheduler block for a constant lr)',
        )
        return SchedulerConfig()
    known = _SCHEDULER_PARAMS[name]
    params = r.obj(block, "params", "scheduler.params") or {}
    r.ignore_unknown(params, known, "scheduler.params")
    out: dict[str, Any] = {}

    def path(key: str) -> str:
        return f"scheduler.params.{key}"

    for key in known:
        if key in ("warmup_min_lr", "warmup_max_lr"):
            default = _SCHEDULER_DEFAULTS.get(key, optimizer_lr)
            out[key] = r.number(params, key, path(key), default, ">= 0", lambda x: x >= 0)
        elif key in ("warmup_min_ratio", "cos_min_ratio"):
            out[key] = r.number(
                params, key, path(key), _SCHEDULER_DEFAULTS[key], "in [0, 1]", lambda x: 0 <= x <= 1
            )
        elif key == "warmup_num_steps":
            out[key] = r.integer(params, key, path(key), _SCHEDULER_DEFAULTS[key], 1)
        elif key == "total_num_steps":
            if params.get(key) is None:
                r.problem(
                    path(key),
                    MISSING,
                    f"{name} needs the total number of optimizer steps (an integer >= 1)",
                    f"add total_num_steps to scheduler.params (e.g. --set {path(key)}=1000)",
                )
                out[key] = 1
            else:
                out[key] = r.integer(params, key, path(key), 1, 1)
        elif key == "warmup_type":
            value = params.get(key)
            if value is None:
                value = _SCHEDULER_DEFAULTS[key]
            elif value not in ("log", "linear"):
                r.problem(
                    path(key),
                    value,
                    'must be "log" or "linear"',
                    'set warmup_type to "log" (DeepSpeed\'s default) or "linear"',
                )
                value = _SCHEDULER_DEFAULTS[key]
            out[key] = value
    return SchedulerConfig(type=name, params=types.MappingProxyType(out))


def _string(r: _Reader, parent: Mapping, key: str, path: str, default: Any, *, empty: bool):
    """A JSON string (``empty``: "" allowed); null or absent gives ``default``."""
    value = parent.get(key)
    if value is None:
        return default
    if not isinstance(value, str) or (not empty and not value):
        what = "a string" if empty else "a non-empty string"
        r.problem(path, value, f"must be {what}", f'write {key} as "..." or remove it')
        return default
    return value


def _parse_log_dir(r: _Reader, raw: Mapping, key: str) -> LogDirConfig:
    d = LogDirConfig()
    block = r.obj(raw, key, key)
    if block is None:
        return d
    r.ignore_unknown(block, ("enabled", "output_path", "job_name"), key)
    return LogDirConfig(
        enabled=r.boolean(block, "enabled", f"{key}.enabled", d.enabled),
        output_path=_string(
            r, block, "output_path", f"{key}.output_path", d.output_path, empty=True
        ),
        job_name=_string(r, block, "job_name", f"{key}.job_name", d.job_name, empty=False),
    )


def _parse_monitor(r: _Reader, raw: Mapping) -> MonitorConfig:
    """DeepSpeed's monitor blocks (deepspeed/monitor/config.py of 0.19.6 for the keys)."""
    d = WandbConfig()
    wandb = r.obj(raw, "wandb", "wandb")
    if wandb is None:
        wandb_cfg = d
    else:
        r.ignore_unknown(wandb, ("enabled", "group", "team", "project"), "wandb")
        wandb_cfg = WandbConfig(
            enabled=r.boolean(wandb, "enabled", "wandb.enabled", d.enabled),
            group=_string(r, wandb, "group", "wandb.group", d.group, empty=False),
            team=_string(r, wandb, "team", "wandb.team", d.team, empty=False),
            project=_string(r, wandb, "project", "wandb.project", d.project, empty=False),
        )
    return MonitorConfig(
        tensorboard=_parse_log_dir(r, raw, "tensorboard"),
        csv_monitor=_parse_log_dir(r, raw, "csv_monitor"),
        wandb=wandb_cfg,
    )


def _resolve_batch(r: _Reader, raw: Mapping, world_size: int) -> tuple[int | None, int | None, int]:
    train = r.integer(raw, "train_batch_size", "train_batch_size", None, 1)
    micro = r.integer(
        raw, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu", None, 1
    )
    gas = r.integer(raw, "gradient_accumulation_steps", "gradient_accumulation_steps", None, 1)
    fix = (
        "give two of train_batch_size, train_micro_batch_size_per_gpu and "
        "gradient_accumulation_steps and let the third be derived, or make them agree"
    )
    rule = (
        f"train_batch_size must equal train_micro_batch_size_per_gpu * "
        f"gradient_accumulation_steps * world_size ({world_size})"
    )
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world_size:
            r.problem(
                "train_batch_size",
                train,
                f"{rule} = {micro} * {gas} * {world_size} = {micro * gas * world_size}",
                fix,
            )
        return train, micro, gas
    if train is not None and micro is not None:
        if train % (micro * world_size):
            r.problem(
                "train_batch_size",
                train,
                f"{rule}: {train} is not a multiple of {micro} * {world_size}",
                fix,
            )
            return train, micro, 1
        return train, micro, train // (micro * world_size)
    if train is not None and gas is not None:
        if train % (gas * world_size):
            r.problem(
                "train_batch_size",
                train,
                f"{rule}: {train} is not a multiple of {gas} * {world_size}",
                fix,
            )
            return train, None, gas
        return train, train // (gas * world_size), gas
    if micro is not None:
        gas = gas or 1
        return micro * gas * world_size, micro, gas
    if train is not None:
        if train % world_size:
            r.problem(
                "train_batch_size", train, f"{rule}: {train} is not a multiple of {world_size}", fix
            )
            return train, None, 1
        return train, train // world_size, 1
    return None, None, gas or 1


_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineOptions))
_ENGINE_CHOICES = {
    "grad_accumulation": ("host", "device"),
    "stream_grads": (True, False, "auto"),
    "window_lr": ("last", "sum", "sqrt"),
    "select_schedule": ("fixed", "doubling"),
}


def _parse_engine(r: _Reader, raw: Mapping) -> EngineOptions:
    """The top-level ``zfctl`` block (unknown keys are errors, as in the zenflow block)."""
    block = r.obj(raw, "zfctl", "zfctl")
    d = EngineOptions()
    if block is None:
        return d
    for key in block:
        if key not in _ENGINE_FIELDS:
            close = difflib.get_close_matches(str(key), _ENGINE_FIELDS, n=1, cutoff=0.6)
            hint = f'did you mean "{close[0]}"? ' if close else ""
            r.problem(
                f"zfctl.{key}",
                block[key],
                f"unknown key in the zfctl block (known: {', '.join(_ENGINE_FIELDS)})",
                f"{hint}rename or remove {key}",
            )
    values: dict[str, Any] = {}
    for f in dataclasses.fields(EngineOptions):
        default = getattr(d, f.name)
        path = f"zfctl.{f.name}"
        if f.name in _ENGINE_CHOICES:
            choices = _ENGINE_CHOICES[f.name]
            value = block.get(f.name, default)
            if not any(value is c or (isinstance(c, str) and value == c) for c in choices):
                allowed = " or ".join(json.dumps(c) for c in choices)
                r.problem(path, value, f"must be {allowed}", f"set {f.name} to {allowed}")
                value = default
            values[f.name] = value
        elif isinstance(default, bool):
            values[f.name] = r.boolean(block, f.name, path, default)
    buckets = block.get("copy_buckets", "auto")
    if buckets != "auto" and (
        isinstance(buckets, bool) or not isinstance(buckets, int) or not 2 <= buckets <= MAX_INT
    ):
        r.problem("zfctl.copy_buckets", buckets,
                  f'must be an integer from 2 to {MAX_INT} or "auto"',
                  'set copy_buckets to 2, 8, 16, ... or "auto"')  # fmt: skip
        buckets = "auto"
    values["copy_buckets"] = buckets
    return EngineOptions(**values)


def _parse_zero(
    r: _Reader, raw: Mapping, problems_zenflow: list[ConfigProblem]
) -> tuple[ZenFlowConfig | None, int, str, bool]:
    zero = r.obj(raw, "zero_optimization", "zero_optimization") or {}
    r.ignore_unknown(zero, ("stage", "offload_optimizer", "zenflow"), "zero_optimization")
    block = r.obj(zero, "zenflow", "zero_optimization.zenflow")
    zenflow = None
    if block is not None:
        zenflow = parse_zenflow(block, "zero_optimization.zenflow", problems_zenflow)

    stage = r.integer(zero, "stage", "zero_optimization.stage", 0, 0, 3)
    raw_stage = zero.get("stage")
    stage_valid = raw_stage is None or (_is_int(raw_stage) and 0 <= raw_stage <= 3)
    if zenflow is not None and stage_valid and stage != 2:
        r.problem(
            "zero_optimization.stage",
            MISSING if raw_stage is None else raw_stage,
            "must be 2 when a zenflow block is present",
            'set "stage": 2 in zero_optimization (or remove the zenflow block)',
        )
    offload = r.obj(zero, "offload_optimizer", "zero_optimization.offload_optimizer") or {}
    r.ignore_unknown(offload, ("device", "pin_memory"), "zero_optimization.offload_optimizer")
    device = offload.get("device")
    if device is None:
        device = "none"
        if zenflow is not None:
            r.problem(
                "zero_optimization.offload_optimizer.device",
                MISSING,
                'must be "cpu" when a zenflow block is present',
                'add "offload_optimizer": {"device": "cpu", "pin_memory": true}',
            )
    elif device not in ("cpu", "none"):
        r.problem(
            "zero_optimization.offload_optimizer.device",
            device,
            'must be "cpu" or "none" (NVMe offload is not supported by the zenflow engine)',
            'set offload_optimizer.device to "cpu"',
        )
        device = "none"
    elif zenflow is not None and device != "cpu":
        r.problem(
            "zero_optimization.offload_optimizer.device",
            device,
            'must be "cpu" when a zenflow block is present',
            'set offload_optimizer.device to "cpu" (or remove the zenflow block)',
        )
    # Default true (DeepSpeed's is false): pageable staging makes every device->host copy of
    # a gradient piece a synchronous one on CUDA. Only what crosses the link is pinned.
    pin = r.boolean(offload, "pin_memory", "zero_optimization.offload_optimizer.pin_memory", True)
    return zenflow, stage, device, pin


def validate(raw: Mapping, source: str, world_size: int) -> Config:
    """The whole config as a ``Config``; raises one ``ConfigError`` with every problem."""
    if not isinstance(raw, Mapping):
        raise ConfigError(
            [
                ConfigProblem(
                    "(top level)",
                    type(raw).__name__,
                    "a DeepSpeed config must be a JSON object",
                    "wrap the settings in { ... }",
                )
            ],
            source,
        )
    r = _Reader()
    zf_problems: list[ConfigProblem] = []
    r.ignore_unknown(raw, _TOP_LEVEL_HONOURED, "")

    train, micro, gas = _resolve_batch(r, raw, world_size)
    optimizer = _parse_optimizer(r, raw)
    scheduler = _parse_scheduler(r, raw, optimizer.lr)
    clip = r.number(
        raw, "gradient_clipping", "gradient_clipping", 1.0, ">= 0 (0 = off)", lambda x: x >= 0
    )

    if raw.get("bf16") is not None and raw.get("bfloat16") is not None:
        r.problem(
            "bfloat16",
            raw["bfloat16"],
            "bfloat16 is an alias of bf16; give only one",
            "remove the bfloat16 block",
        )
    bf16_key = "bf16" if raw.get("bf16") is not None else "bfloat16"
    bf16_block = r.obj(raw, bf16_key, bf16_key) or {}
    r.ignore_unknown(bf16_block, ("enabled",), bf16_key)
    if bf16_block.get("enabled") == "auto":  # the DeepSpeed / HF convention: by the device
        bf16 = "auto"
    else:
        bf16 = r.boolean(bf16_block, "enabled", f"{bf16_key}.enabled", False)

    fp16_block = r.obj(raw, "fp16", "fp16") or {}
    r.ignore_unknown(fp16_block, ("enabled",), "fp16")
    fp16 = r.boolean(fp16_block, "enabled", "fp16.enabled", False)
    if fp16:
        r.problem(
            "fp16.enabled",
            True,
            "fp16 is not supported by the zenflow engine",
            'use bf16 instead: "bf16": {"enabled": true} and "fp16": {"enabled": false}',
        )
        if bf16 is True:
            r.problem("bf16.enabled", True, "bf16 and fp16 cannot both be enabled", "disable fp16")

    steps_per_print = r.integer(raw, "steps_per_print", "steps_per_print", 10, 1)
    wall = r.boolean(raw, "wall_clock_breakdown", "wall_clock_breakdown", False)
    zenflow, stage, device, pin = _parse_zero(r, raw, zf_problems)
    monitor = _parse_monitor(r, raw)
    engine = _parse_engine(r, raw)

    problems = r.problems + zf_problems
    if problems:
        raise ConfigError(problems, source)
    return Config(
        zenflow=zenflow,
        optimizer=optimizer,
        scheduler=scheduler,
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        gradient_clipping=clip,
        bf16=bf16,
        fp16=False,
        steps_per_print=steps_per_print,
        wall_clock_breakdown=wall,
        zero_stage=stage,
        offload_device=device,
        pin_memory=pin,
        ignored=tuple(r.ignored),
        monitor=monitor,
        engine=engine,
        source=source,
        raw=copy.deepcopy(dict(raw)),
    )
