"""The sections of a DeepSpeed config that say how the run steps: the optimizer (Adam or
AdamW and its params), the LR scheduler (DeepSpeed's WarmupLR / WarmupDecayLR /
WarmupCosineLR and their params) and the batch sizes (two of three given, the third derived).

Each reader appends its problems to the ``Reader`` it is given and returns the section with
defaults where a value was bad. The LR curves themselves are ``zenflow.config.lr_schedule``'s.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from zenflow.config.readers import Reader, is_number
from zenflow.config.schema import MISSING, OptimizerConfig, SchedulerConfig

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


# --------------------------------------------------------------------------------------
# optimizer
# --------------------------------------------------------------------------------------


def parse_optimizer(r: Reader, raw: Mapping) -> OptimizerConfig:
    d = OptimizerConfig()
    block = r.obj(raw, "optimizer", "optimizer")
    if block is None:
        return d
    r.ignore_unknown(block, ("type", "params"), "optimizer")
    opt_type = _optimizer_type(r, block, d.type)
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
    betas = _betas(r, params, d.betas)
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


def _optimizer_type(r: Reader, block: Mapping, default: str) -> str:
    """optimizer.type as "AdamW" or "Adam" (either case); ``default`` after a problem."""
    name = block.get("type")
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
        return "AdamW" if name.lower() == "adamw" else "Adam"
    return default


def _betas(r: Reader, params: Mapping, default: tuple[float, float]) -> tuple[float, float]:
    """optimizer.params.betas: two numbers, each 0 <= b < 1."""
    raw_betas = params.get("betas")
    if raw_betas is None:
        return default
    ok = (
        isinstance(raw_betas, (list, tuple))
        and len(raw_betas) == 2
        and all(is_number(b) and 0 <= b < 1 for b in raw_betas)
    )
    if ok:
        return (float(raw_betas[0]), float(raw_betas[1]))
    r.problem(
        "optimizer.params.betas",
        raw_betas,
        "must be a list of two numbers, each 0 <= b < 1",
        "set betas to e.g. [0.9, 0.999]",
    )
    return default


# --------------------------------------------------------------------------------------
# scheduler
# --------------------------------------------------------------------------------------


def parse_scheduler(r: Reader, raw: Mapping, optimizer_lr: float) -> SchedulerConfig:
    block = r.obj(raw, "scheduler", "scheduler")
    if block is None:
        return SchedulerConfig()
    r.ignore_unknown(block, ("type", "params"), "scheduler")
    name = block.get("type")
    # a JSON object or array is not hashable: test the kind before the table lookup
    if not isinstance(name, str) or name not in _SCHEDULER_PARAMS:
        r.problem(
            "scheduler.type",
            MISSING if name is None else name,
            f"must be one of {', '.join(_SCHEDULER_PARAMS)} (a string)",
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


# --------------------------------------------------------------------------------------
# batch sizes
# --------------------------------------------------------------------------------------


def resolve_batch(r: Reader, raw: Mapping, world_size: int) -> tuple[int | None, int | None, int]:
    """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps): the
    ones given, and the third derived from two (with ``world_size``)."""
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
