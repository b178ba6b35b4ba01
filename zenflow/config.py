"""Parse and validate a DeepSpeed JSON config into frozen dataclasses, once.

Config flows one way: a JSON file (or dict) plus CLI overrides -> ``load_config`` ->
``Config`` -> engine. The engine never reads the file again.

What is honoured (everything else is listed in ``Config.ignored`` and printed once by the
caller, never silently dropped and never an error):

- ``zero_optimization.zenflow``: the ZenFlow block, validated strictly (unknown keys are
  errors, with a "did you mean" suggestion). See ``ZenFlowConfig`` and ``FIELD_DOCS``.
- ``zero_optimization.stage`` and ``zero_optimization.offload_optimizer.{device,pin_memory}``.
  With a zenflow block, stage must be 2 and the optimizer must be offloaded to ``"cpu"``.
- ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``:
  DeepSpeed's rule ``train_batch_size = micro * accumulation * world_size`` is checked when all
  three are given and the missing one is derived otherwise.
- ``optimizer`` (``AdamW`` or ``Adam``; params ``lr``, ``betas``, ``eps``, ``weight_decay``,
  ``adam_w_mode``), ``scheduler`` (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``),
  ``gradient_clipping``, ``bf16.enabled``, ``fp16.enabled``, ``steps_per_print``,
  ``wall_clock_breakdown``.

Every problem of one file is collected and raised together in one ``ConfigError``; each names
the JSON path, the bad value, what is allowed and how to fix it. ``null`` for an honoured key
outside the zenflow block means "not given" (as in DeepSpeed). HF-style ``"auto"`` values are
accepted only where the zenflow table allows them; everywhere else a number is required.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zenflow.errors import UserInputError

__all__ = [
    "FIELD_DOCS",
    "Config",
    "ConfigError",
    "ConfigProblem",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZenFlowConfig",
    "apply_overrides",
    "load_config",
    "parse_set_args",
]


class _Missing:
    """Sentinel for a required key that is absent; shows as ``(missing)`` in messages."""

    def __repr__(self) -> str:
        return "(missing)"


MISSING: Any = _Missing()


@dataclass(frozen=True)
class ConfigProblem:
    """One problem found in a config: where, what, what is allowed and how to fix it."""

    path: str
    """JSON path in dotted form, e.g. ``zero_optimization.zenflow.topk_ratio``."""
    value: Any
    """The offending value as read from the JSON (``MISSING`` for a required absent key)."""
    allowed: str
    """What is allowed there, as a phrase."""
    fix: str
    """What to do about it, as a sentence."""

    def __str__(self) -> str:
        return f"{self.path} = {self.value!r}: {self.allowed}. Fix: {self.fix}"


class ConfigError(UserInputError, ValueError):
    """All problems of one DeepSpeed config, reported together."""

    def __init__(self, problems: Sequence[ConfigProblem], source: str = "<dict>") -> None:
        self.problems: tuple[ConfigProblem, ...] = tuple(problems)
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        lines = [f"{self.source}: {len(self.problems)} problem(s) in the DeepSpeed config:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._message()


# --------------------------------------------------------------------------------------
# Dataclasses
# --------------------------------------------------------------------------------------

FIELD_DOCS: dict[str, str] = {
    "topk_ratio": "Share of each weight's input columns updated on the device every step "
    "(0 < x <= 1); the rest accumulate on the host.",
    "select_strategy": 'When columns are re-selected: "auto" (once per epoch), "step" '
    '(every select_interval steps) or "epoch" (every select_interval epochs).',
    "select_interval": 'Re-selection period in steps or epochs (int >= 1), or "auto"; an int '
    'needs select_strategy "step" or "epoch".',
    "update_interval": "Steps per host window: the host AdamW step for non-selected columns "
    'runs every this many steps (int >= 1), or "auto" to end a window when the accumulated '
    "non-selected gradient catches up with the selected one.",
    "full_warm_up_rounds": "Number of first steps that update every parameter synchronously "
    "(plain offloaded AdamW) before selection starts (int >= 0).",
    "overlap_step": "Run the host optimizer step on a background worker while the next "
    "window's forward/backward proceeds (true/false).",
    "auto_ratio": 'Share of weights that must vote for a host update before an "auto" '
    "update_interval ends the window (0 < x <= 1).",
    "pt_reserved_cores_perc": "Share of CPU cores kept for the training thread when "
    "overlap_step is on; the host worker gets the rest (0 < x < 1).",
}


@dataclass(frozen=True)
class ZenFlowConfig:
    """The ``zero_optimization.zenflow`` block (ZENFLOW.md section 3). Field docs: FIELD_DOCS."""

    topk_ratio: float = 0.1
    """Share of each weight's input columns updated on the device every step (0 < x <= 1)."""
    select_strategy: str = "auto"
    """When columns are re-selected: "auto" (once per epoch), "step" or "epoch"."""
    select_interval: int | str = "auto"
    """Re-selection period (int >= 1, in steps or epochs per select_strategy) or "auto"."""
    update_interval: int | str = "auto"
    """Steps per host window (int >= 1) or "auto" (gradient-mass trigger, see auto_ratio)."""
    full_warm_up_rounds: int = 0
    """Number of first steps with a full synchronous update of every parameter (>= 0)."""
    overlap_step: bool = False
    """Run the host step on a background worker, overlapped with the next window."""
    auto_ratio: float = 0.99
    """Share of weights voting for a host update that ends an "auto" window (0 < x <= 1)."""
    pt_reserved_cores_perc: float = 0.5
    """Share of cores kept for the training thread when overlapping (0 < x < 1)."""


@dataclass(frozen=True)
class OptimizerConfig:
    """The ``optimizer`` block. Only AdamW and Adam are supported.

    ``adamw_mode`` says whether weight decay is decoupled (AdamW) or added to the gradient
    (classic Adam/L2). As in DeepSpeed: type ``AdamW`` always means decoupled decay (True);
    type ``Adam`` takes ``params.adam_w_mode``, whose default is True, so a plain ``"Adam"``
    block also trains with decoupled weight decay unless ``adam_w_mode: false`` is given.
    """

    type: str = "AdamW"
    """Normalised optimizer name: "AdamW" or "Adam" (the JSON is case-insensitive)."""
    lr: float = 1e-3
    """Base learning rate (> 0); a scheduler multiplies or replaces it per step."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2), each 0 <= b < 1."""
    eps: float = 1e-8
    """Adam's epsilon (> 0)."""
    weight_decay: float = 0.0
    """Weight decay (>= 0); decoupled when adamw_mode is True."""
    adamw_mode: bool = True
    """Decoupled weight decay (AdamW). AdamW -> True; Adam -> params.adam_w_mode (default True)."""


def _frozen_params(params: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(params or {}))


@dataclass(frozen=True)
class SchedulerConfig:
    """The ``scheduler`` block, with every parameter of its type filled in.

    ``params`` always holds the complete parameter set of the type (DeepSpeed's defaults
    filled in), so ``lr_schedule.lr_at`` and the JSON written back need no defaults of their
    own. One deliberate difference from DeepSpeed: when ``warmup_max_lr`` is absent it is set
    to ``optimizer.params.lr`` for both WarmupLR (DeepSpeed does the same) and WarmupDecayLR
    (DeepSpeed would use 0.001); the value is written out explicitly by
    ``Config.to_json_dict`` so DeepSpeed sees the same number.
    """

    type: str | None = None
    """None (constant lr), "WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"."""
    params: Mapping[str, Any] = field(default_factory=_frozen_params)
    """Read-only mapping of the type's parameters, defaults filled in."""


@dataclass(frozen=True)
class Config:
    """A validated DeepSpeed config, as the engine honours it.

    Equality compares the honoured values and ``ignored``; ``source`` and ``raw`` are
    excluded, so ``load_config(cfg.to_json_dict()) == cfg``.
    """

    zenflow: ZenFlowConfig | None
    """The ZenFlow block; None when the config has none (plain offload or device training)."""
    optimizer: OptimizerConfig
    """The optimizer (defaults when the config has no optimizer block)."""
    scheduler: SchedulerConfig
    """The learning-rate schedule (type None when the config has none)."""
    train_batch_size: int | None
    """Samples per optimizer step over all ranks; derived when not given (None if unknown)."""
    train_micro_batch_size_per_gpu: int | None
    """Samples per forward/backward per rank; derived when not given (None if unknown)."""
    gradient_accumulation_steps: int
    """Backward passes per optimizer step (resolved, >= 1)."""
    gradient_clipping: float
    """Global gradient-norm clip; 0.0 = off. Default 1.0, as DeepSpeed 0.19.6."""
    bf16: bool
    """bf16 autocast (``bf16.enabled``)."""
    fp16: bool
    """Always False: fp16 is rejected as not supported by the engine."""
    steps_per_print: int
    """Print progress every this many optimizer steps (default 10)."""
    wall_clock_breakdown: bool
    """Report per-phase timings."""
    zero_stage: int
    """``zero_optimization.stage`` (0..3; 2 with ZenFlow). Default 0."""
    offload_device: str
    """``zero_optimization.offload_optimizer.device``: "cpu" or "none"."""
    pin_memory: bool
    """``zero_optimization.offload_optimizer.pin_memory``."""
    ignored: tuple[str, ...]
    """Dotted paths of keys present in the JSON that the engine does not honour."""
    source: str = field(default="<dict>", compare=False)
    """Where the config came from: a file path or "<dict>"."""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Deep copy of the input JSON after overrides (read it, do not change it)."""

    def to_json_dict(self, resolved: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Return this config as a DeepSpeed JSON dict.

        Starts from a deep copy of ``raw`` (so ignored keys survive) and writes every honoured
        value over it in its normalised form (full zenflow block, full scheduler params,
        optimizer type spelled "AdamW"/"Adam"). With ``resolved`` (e.g.
        ``{"update_interval": 4, "select_strategy": "epoch", "select_interval": 1}``), zenflow
        fields whose value is ``"auto"`` are replaced by the resolved value; keys that are not
        zenflow field names are skipped.
        """
        out: dict[str, Any] = copy.deepcopy(dict(self.raw))
        for key in _BATCH_KEYS:
            out.pop(key, None)
        if self.train_batch_size is not None and "train_batch_size" in self.raw:
            out["train_batch_size"] = self.train_batch_size
        if self.train_micro_batch_size_per_gpu is not None:
            out["train_micro_batch_size_per_gpu"] = self.train_micro_batch_size_per_gpu
        elif self.train_batch_size is not None:
            out["train_batch_size"] = self.train_batch_size
        out["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        out["gradient_clipping"] = self.gradient_clipping
        out["steps_per_print"] = self.steps_per_print
        out["wall_clock_breakdown"] = self.wall_clock_breakdown
        out.pop("bfloat16", None)
        out["bf16"] = {**_as_dict(self.raw.get("bf16") or self.raw.get("bfloat16"))}
        out["bf16"]["enabled"] = self.bf16
        if isinstance(self.raw.get("fp16"), Mapping):
            out["fp16"] = {**self.raw["fp16"], "enabled": False}

        opt = self.optimizer
        raw_opt = _as_dict(self.raw.get("optimizer"))
        opt_params = {**_as_dict(raw_opt.get("params"))}
        opt_params.update(
            lr=opt.lr, betas=list(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
        )
        if opt.type == "Adam":
            opt_params["adam_w_mode"] = opt.adamw_mode
        else:
            opt_params.pop("adam_w_mode", None)
        out["optimizer"] = {**raw_opt, "type": opt.type, "params": opt_params}

        if self.scheduler.type is None:
            out.pop("scheduler", None)
        else:
            raw_sch = _as_dict(self.raw.get("scheduler"))
            sch_params = {**_as_dict(raw_sch.get("params")), **dict(self.scheduler.params)}
            out["scheduler"] = {**raw_sch, "type": self.scheduler.type, "params": sch_params}

        zero = {**_as_dict(self.raw.get("zero_optimization"))}
        zero["stage"] = self.zero_stage
        offload = {**_as_dict(zero.get("offload_optimizer"))}
        offload["device"] = self.offload_device
        offload["pin_memory"] = self.pin_memory
        zero["offload_optimizer"] = offload
        if self.zenflow is None:
            zero.pop("zenflow", None)
        else:
            block = dataclasses.asdict(self.zenflow)
            for key, value in (resolved or {}).items():
                if key in block and block[key] == "auto":
                    block[key] = value
            zero["zenflow"] = block
        out["zero_optimization"] = zero
        return out

    def replace_zenflow(self, **changes: Any) -> Config:
        """Return a copy whose zenflow block has ``changes`` applied (validated like the JSON).

        Starts from the current block, or from the defaults when there is none. Only the
        block's own rules are checked (not the stage/offload rules of the whole file). Raises
        ``ConfigError`` on a bad field or value.
        """
        base = dataclasses.asdict(self.zenflow) if self.zenflow else {}
        block = {**base, **changes}
        problems: list[ConfigProblem] = []
        zf = _parse_zenflow(block, "zero_optimization.zenflow", problems)
        if problems:
            raise ConfigError(problems, self.source)
        raw = copy.deepcopy(dict(self.raw))
        zero = raw.setdefault("zero_optimization", {})
        if isinstance(zero, dict):
            zero["zenflow"] = dataclasses.asdict(zf)
        return dataclasses.replace(self, zenflow=zf, raw=raw)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _as_dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


# --------------------------------------------------------------------------------------
# Typed readers. Each appends a problem and returns None (or the default) on a bad value.
# --------------------------------------------------------------------------------------


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


def _parse_zenflow(block: Mapping, path: str, problems: list[ConfigProblem]) -> ZenFlowConfig:
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
        if not _is_int(value) or value < 1:
            r.problem(
                p(key),
                value,
                'must be an integer >= 1 or "auto"',
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


def _parse_zero(
    r: _Reader, raw: Mapping, problems_zenflow: list[ConfigProblem]
) -> tuple[ZenFlowConfig | None, int, str, bool]:
    zero = r.obj(raw, "zero_optimization", "zero_optimization") or {}
    r.ignore_unknown(zero, ("stage", "offload_optimizer", "zenflow"), "zero_optimization")
    block = r.obj(zero, "zenflow", "zero_optimization.zenflow")
    zenflow = None
    if block is not None:
        zenflow = _parse_zenflow(block, "zero_optimization.zenflow", problems_zenflow)

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
    pin = r.boolean(offload, "pin_memory", "zero_optimization.offload_optimizer.pin_memory", False)
    return zenflow, stage, device, pin


def _validate(raw: Mapping, source: str, world_size: int) -> Config:
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
        if bf16:
            r.problem("bf16.enabled", True, "bf16 and fp16 cannot both be enabled", "disable fp16")

    steps_per_print = r.integer(raw, "steps_per_print", "steps_per_print", 10, 1)
    wall = r.boolean(raw, "wall_clock_breakdown", "wall_clock_breakdown", False)
    zenflow, stage, device, pin = _parse_zero(r, raw, zf_problems)

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
        source=source,
        raw=copy.deepcopy(dict(raw)),
    )


# --------------------------------------------------------------------------------------
# Loading and overrides
# --------------------------------------------------------------------------------------


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "(file)",
                    path,
                    f"cannot be read ({exc.strerror or exc})",
                    "check the path, or create a config with `zfctl init`",
                )
            ],
            path,
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "(file)",
                    path,
                    f"is not UTF-8 text ({exc.reason})",
                    "save the config as UTF-8 JSON",
                )
            ],
            path,
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        line_text = text.splitlines()[exc.lineno - 1] if text.splitlines() else ""
        raise ConfigError(
            [
                ConfigProblem(
                    f"(JSON syntax) line {exc.lineno}, column {exc.colno}",
                    line_text.strip(),
                    f"not valid JSON: {exc.msg}",
                    f"correct the JSON at line {exc.lineno}, column {exc.colno} of {path} "
                    "(common causes: a trailing comma, a missing comma, single quotes, "
                    "or a comment)",
                )
            ],
            path,
        ) from None


def load_config(
    src: str | os.PathLike | Mapping,
    overrides: Mapping[str, Any] | None = None,
    *,
    world_size: int = 1,
) -> Config:
    """Read, override and validate a DeepSpeed config; raise ``ConfigError`` listing every problem.

    ``src`` is a path to a JSON file or an already-parsed dict (source ``"<dict>"``).
    ``overrides`` maps dotted paths to values (see ``apply_overrides``), applied before
    validation; ``Config.raw`` holds the result. ``world_size`` enters the batch-size rule.
    """
    if isinstance(src, Mapping):
        source, raw = "<dict>", copy.deepcopy(dict(src))
    else:
        source = os.fspath(src)
        raw = _read_json(source)
    if overrides:
        if not isinstance(raw, Mapping):
            _validate(raw, source, world_size)  # raises the top-level problem
        raw = apply_overrides(raw, overrides, source=source)
    return _validate(raw, source, world_size)


def apply_overrides(raw: Mapping, overrides: Mapping[str, Any], *, source: str = "--set") -> dict:
    """Return a deep copy of ``raw`` with each dotted path in ``overrides`` set to its value.

    Missing intermediate objects are created. A path whose intermediate exists but is not an
    object (``"bf16.enabled"`` when ``bf16`` is ``true``) is a ``ConfigError``; all such
    paths are reported together.
    """
    out = copy.deepcopy(dict(raw))
    problems: list[ConfigProblem] = []
    for dotted, value in overrides.items():
        parts = str(dotted).split(".")
        if not all(parts):
            problems.append(
                ConfigProblem(
                    str(dotted),
                    value,
                    "must be a dotted key path",
                    "write it like zero_optimization.zenflow.topk_ratio",
                )
            )
            continue
        node: dict = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                problems.append(
                    ConfigProblem(
                        prefix,
                        child,
                        f"is not a JSON object, so {dotted} cannot be set",
                        f"override {prefix} itself, or fix the path {dotted}",
                    )
                )
                break
            node = child
        else:
            node[parts[-1]] = copy.deepcopy(value)
    if problems:
        raise ConfigError(problems, source)
    return out


def parse_set_args(items: Sequence[str]) -> dict[str, Any]:
    """Parse CLI ``--set a.b.c=value`` items into ``{"a.b.c": value}``.

    The value is parsed as JSON when it parses (``0.05``, ``true``, ``4``, ``"x"``, ``[0.9,
    0.99]``, ``null``) and kept as a string otherwise (``auto``, ``AdamW``). Items without
    ``=`` or with an empty key are reported together in one ``ConfigError``.
    """
    out: dict[str, Any] = {}
    problems: list[ConfigProblem] = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not all(key.split(".")):
            problems.append(
                ConfigProblem(
                    "--set",
                    item,
                    "must look like KEY.PATH=VALUE",
                    "write e.g. --set zero_optimization.zenflow.topk_ratio=0.05",
                )
            )
            continue
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        out[key] = value
    if problems:
        raise ConfigError(problems, "--set")
    return out
