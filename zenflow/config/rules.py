"""The rules of a DeepSpeed config: what ``zenflow.config.load_config`` checks.

``validate`` reads a whole file into a ``Config``: the top-level keys it honours, precision
(bf16 / fp16), the monitor blocks (tensorboard, csv_monitor, wandb) and the ``zfctl`` block
here; the zenflow block and ZeRO section from ``zenflow.config.zenflow_block``; optimizer,
scheduler and batch sizes from ``zenflow.config.training_sections``. Every section appends
its problems to one list, so one file's problems are reported together in one
``ConfigError``. The typed readers are ``zenflow.config.readers``'.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from collections.abc import Mapping
from typing import Any

from zenflow.config.readers import MAX_INT, Reader
from zenflow.config.schema import (
    _BATCH_KEYS,
    Config,
    ConfigError,
    ConfigProblem,
    EarlyOptions,
    EngineOptions,
    LogDirConfig,
    LoraOptions,
    MonitorConfig,
    WandbConfig,
)
from zenflow.config.training_sections import parse_optimizer, parse_scheduler, resolve_batch
from zenflow.config.zenflow_block import parse_zero

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
    r = Reader()
    zf_problems: list[ConfigProblem] = []
    r.ignore_unknown(raw, _TOP_LEVEL_HONOURED, "")

    train, micro, gas = resolve_batch(r, raw, world_size)
    optimizer = parse_optimizer(r, raw)
    scheduler = parse_scheduler(r, raw, optimizer.lr)
    clip = r.number(
        raw, "gradient_clipping", "gradient_clipping", 1.0, ">= 0 (0 = off)", lambda x: x >= 0
    )
    bf16 = _parse_precision(r, raw)
    steps_per_print = r.integer(raw, "steps_per_print", "steps_per_print", 10, 1)
    wall = r.boolean(raw, "wall_clock_breakdown", "wall_clock_breakdown", False)
    zenflow, stage, device, pin = parse_zero(r, raw, zf_problems)
    monitor = _parse_monitor(r, raw)
    engine = _parse_engine(r, raw)
    if zenflow is not None:
        _check_zenflow_options(r, zenflow, engine, gas)
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


def _check_zenflow_options(r: Reader, zenflow, engine: EngineOptions, gas: int) -> None:
    """The zfctl options that depend on the rest: the early ramp needs an integer
    update_interval; zfctl.step_store "off" or "q8" adds each piece as it arrives, so no
    micro-batch sum on the host (its fp32 sum would take the store's place). With clipping,
    "off" clips each window's host part by the smallest coefficient of its steps (the window's host
    step), not each step's pieces by their own."""
    if engine.early.on and engine.early.windows == "ramp" and zenflow.update_interval == "auto":
        r.problem("zfctl.early.windows", "ramp",
                  'ramps the window length up to update_interval, which is "auto" here',
                  'set zero_optimization.zenflow.update_interval to a number of steps, '
                  'zfctl.early.windows to "fixed", or zfctl.early.steps to 0 (the zenflow '
                  'template turns the ramp on)')  # fmt: skip
    if engine.step_store in ("on", "auto"):  # ("auto": the store unless it does not fit)
        return
    if gas > 1 and engine.grad_accumulation == "host":
        r.problem("zfctl.step_store", engine.step_store,
                  f"with gradient_accumulation_steps {gas} the micro-batches are summed on "
                  "the host in fp32, a store of its own",
                  'set zfctl.grad_accumulation "device", or zfctl.step_store "on"')  # fmt: skip


def _parse_precision(r: Reader, raw: Mapping) -> bool | str:
    """bf16.enabled (or its alias bfloat16): true, false or "auto"; fp16 is refused."""
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
    enabled = bf16_block.get("enabled")
    if enabled == "auto":  # the DeepSpeed / HF convention: by the device
        bf16 = "auto"
    elif enabled is None or isinstance(enabled, bool):
        bf16 = False if enabled is None else enabled
    else:  # all three allowed values named, "auto" included
        r.problem(f"{bf16_key}.enabled", enabled, 'must be true, false or "auto"',
                  f'set {bf16_key}.enabled to true, false or "auto" (as JSON: no quotes '
                  'around true and false)')  # fmt: skip
        bf16 = False

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
    return bf16


# --------------------------------------------------------------------------------------
# Monitors: DeepSpeed's tensorboard, csv_monitor and wandb blocks
# --------------------------------------------------------------------------------------


def _parse_log_dir(r: Reader, raw: Mapping, key: str) -> LogDirConfig:
    d = LogDirConfig()
    block = r.obj(raw, key, key)
    if block is None:
        return d
    r.ignore_unknown(block, ("enabled", "output_path", "job_name"), key)
    return LogDirConfig(
        enabled=r.boolean(block, "enabled", f"{key}.enabled", d.enabled),
        output_path=r.string(block, "output_path", f"{key}.output_path", d.output_path, empty=True),
        job_name=r.string(block, "job_name", f"{key}.job_name", d.job_name, empty=False),
    )


def _parse_monitor(r: Reader, raw: Mapping) -> MonitorConfig:
    """DeepSpeed's monitor blocks (deepspeed/monitor/config.py of 0.19.6 for the keys)."""
    d = WandbConfig()
    wandb = r.obj(raw, "wandb", "wandb")
    if wandb is None:
        wandb_cfg = d
    else:
        r.ignore_unknown(wandb, ("enabled", "group", "team", "project"), "wandb")
        wandb_cfg = WandbConfig(
            enabled=r.boolean(wandb, "enabled", "wandb.enabled", d.enabled),
            group=r.string(wandb, "group", "wandb.group", d.group, empty=False),
            team=r.string(wandb, "team", "wandb.team", d.team, empty=False),
            project=r.string(wandb, "project", "wandb.project", d.project, empty=False),
        )
    return MonitorConfig(
        tensorboard=_parse_log_dir(r, raw, "tensorboard"),
        csv_monitor=_parse_log_dir(r, raw, "csv_monitor"),
        wandb=wandb_cfg,
    )


# --------------------------------------------------------------------------------------
# The zfctl block: this engine's own options
# --------------------------------------------------------------------------------------

_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineOptions))
_ENGINE_CHOICES = {
    "grad_accumulation": ("host", "device"),
    "stream_grads": (True, False, "auto"),
    "window_lr": ("last", "sum", "sqrt"),
    "select_schedule": ("fixed", "doubling"),
    "host_state": ("exact", "compact"),
    "return_image": ("early", "always", "never"),
    "numa_binding": ("auto", "node", "off"),
    "step_store": ("auto", "on", "off", "q8"),
}


def _parse_engine(r: Reader, raw: Mapping) -> EngineOptions:
    """The top-level ``zfctl`` block (unknown keys are errors, as in the zenflow block)."""
    block = r.obj(raw, "zfctl", "zfctl")
    d = EngineOptions()
    if block is None:
        return d
    _unknown_keys(r, block, _ENGINE_FIELDS, "zfctl")
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
    values["lora"] = _parse_lora(r, block)
    values["early"] = _parse_early(r, block)
    return EngineOptions(**values)


def _sub_block(r: Reader, block: Mapping, name: str, options: type) -> Mapping | None:
    """The ``zfctl.<name>`` object (None when absent or not an object, said by ``r``),
    each key that is not a field of the dataclass ``options`` one problem."""
    sub = r.obj(block, name, f"zfctl.{name}")
    if sub is not None:
        _unknown_keys(r, sub, tuple(f.name for f in dataclasses.fields(options)),
                      f"zfctl.{name}")  # fmt: skip
    return sub


def _parse_early(r: Reader, block: Mapping) -> EarlyOptions:
    """``zfctl.early``: ZenFlow's early schedule (unknown keys are errors)."""
    early = _sub_block(r, block, "early", EarlyOptions)
    d = EarlyOptions()
    if early is None:
        return d
    windows = early.get("windows", d.windows)
    if windows not in ("ramp", "fixed"):
        r.problem("zfctl.early.windows", windows, 'must be "ramp" or "fixed"',
                  'set windows to "ramp" (lengths 1, 2, 4, ... up to update_interval) or '
                  '"fixed"')  # fmt: skip
        windows = d.windows
    return EarlyOptions(
        steps=r.integer(early, "steps", "zfctl.early.steps", d.steps, 0, MAX_INT),
        windows=windows,
        overlap=r.boolean(early, "overlap", "zfctl.early.overlap", d.overlap),
    )


def _unknown_keys(r: Reader, obj: Mapping, known: tuple[str, ...], path: str) -> None:
    """One problem per key of ``obj`` (the block at ``path``) that is not in ``known``."""
    for key in obj:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f'did you mean "{close[0]}"? ' if close else ""
            r.problem(f"{path}.{key}", obj[key],
                      f"unknown key in the {path} block (known: {', '.join(known)})",
                      f"{hint}rename or remove {key}")  # fmt: skip


def _parse_lora(r: Reader, block: Mapping) -> LoraOptions:
    """``zfctl.lora``: the adapters of ``--engine lora`` (unknown keys are errors)."""
    lora = _sub_block(r, block, "lora", LoraOptions)
    d = LoraOptions()
    if lora is None:
        return d
    return LoraOptions(
        rank=r.integer(lora, "rank", "zfctl.lora.rank", d.rank, 1, 65536),
        alpha=r.number(lora, "alpha", "zfctl.lora.alpha", d.alpha, "> 0",
                       lambda v: 0 < v < float("inf")),
        dropout=r.number(lora, "dropout", "zfctl.lora.dropout", d.dropout, "from 0 up to (not "
                         "including) 1", lambda v: 0 <= v < 1),
    )  # fmt: skip
