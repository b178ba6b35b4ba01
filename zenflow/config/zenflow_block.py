"""The zenflow block and the ZeRO section that holds it (ZENFLOW.md section 3).

``parse_zenflow`` reads ``zero_optimization.zenflow``: its fields, defaults, allowed values
and cross-field rules, unknown keys with a "did you mean". ``parse_zero`` reads the rest of
``zero_optimization`` (stage, offload device, pinning) and the rules the zenflow block puts
on them. ``run_length_notes`` bounds a valid block against the run's length (notes, not
errors).

Every problem goes to a list, never raised: ``zenflow.config.rules.validate`` raises them
together. The rest of the file's sections are not read here.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping

from zenflow.config.readers import MAX_INT, Reader, is_int
from zenflow.config.schema import MISSING, ConfigProblem, ZenFlowConfig

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
    r = Reader()
    _check_keys(r, block, path)
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
    strategy = _select_strategy(r, block, path, d.select_strategy)
    select_interval = _interval(r, block, path, "select_interval")
    update_interval = _interval(r, block, path, "update_interval")
    if strategy == "auto" and is_int(select_interval):
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


def _check_keys(r: Reader, block: Mapping, path: str) -> None:
    """A problem for every key that is not a field: DeepSpeed-only keys say why they are not
    supported, unknown ones suggest the closest field."""
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


def _select_strategy(r: Reader, block: Mapping, path: str, default: str) -> str | None:
    """select_strategy ("auto", "step" or "epoch"); None after a problem (the caller then
    takes the default, and no cross-field rule fires on it)."""
    strategy = block.get("select_strategy", default)
    if strategy is None:
        return default
    if strategy not in ("auto", "step", "epoch"):
        r.problem(
            f"{path}.select_strategy",
            strategy,
            'must be one of "auto", "step", "epoch"',
            'set select_strategy to "auto" (once per epoch), "step" or "epoch"',
        )
        return None
    return strategy


def _interval(r: Reader, block: Mapping, path: str, key: str) -> int | str:
    """An interval in steps: a whole number from 1, or "auto" (also for absent or null)."""
    value = block.get(key, "auto")
    if value is None or value == "auto":
        return "auto"
    if not is_int(value) or not 1 <= value <= MAX_INT:
        r.problem(
            f"{path}.{key}",
            value,
            f'must be an integer from 1 to {MAX_INT} or "auto"',
            f'set {key} to a whole number of steps such as 4, or to "auto"',
        )
        return "auto"
    return value


def run_length_notes(zf: ZenFlowConfig | None, total_steps: int) -> list[str]:
    """The zenflow block bounded against the run: each interval or count that is valid on
    its own but at least as long as the run's ``total_steps``, said as what then never
    happens (the run goes on; a note, not an error)."""
    if zf is None:
        return []
    notes = []
    block = "zero_optimization.zenflow"
    if is_int(zf.update_interval) and zf.update_interval > total_steps:
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
    if zf.select_strategy == "step" and is_int(zf.select_interval) \
            and zf.select_interval > total_steps:  # fmt: skip
        notes.append(
            f"{block}.select_interval {zf.select_interval} steps is longer than the run's "
            f"{total_steps}: the columns chosen first are never re-selected."
        )
    return notes


# --------------------------------------------------------------------------------------
# zero_optimization: the stage and the offload device the zenflow block requires
# --------------------------------------------------------------------------------------


def parse_zero(
    r: Reader, raw: Mapping, problems_zenflow: list[ConfigProblem]
) -> tuple[ZenFlowConfig | None, int, str, bool]:
    """(zenflow block or None, ZeRO stage, offload device, pin_memory) of ``raw``."""
    zero = r.obj(raw, "zero_optimization", "zero_optimization") or {}
    r.ignore_unknown(zero, ("stage", "offload_optimizer", "zenflow"), "zero_optimization")
    block = r.obj(zero, "zenflow", "zero_optimization.zenflow")
    zenflow = None
    if block is not None:
        zenflow = parse_zenflow(block, "zero_optimization.zenflow", problems_zenflow)

    stage = r.integer(zero, "stage", "zero_optimization.stage", 0, 0, 3)
    raw_stage = zero.get("stage")
    stage_valid = raw_stage is None or (is_int(raw_stage) and 0 <= raw_stage <= 3)
    if zenflow is not None and stage_valid and stage != 2:
        r.problem(
            "zero_optimization.stage",
            MISSING if raw_stage is None else raw_stage,
            "must be 2 when a zenflow block is present",
            'set "stage": 2 in zero_optimization (or remove the zenflow block)',
        )
    offload = r.obj(zero, "offload_optimizer", "zero_optimization.offload_optimizer") or {}
    r.ignore_unknown(offload, ("device", "pin_memory"), "zero_optimization.offload_optimizer")
    device = _offload_device(r, offload, zenflow is not None)
    # Default true (DeepSpeed's is false): pageable staging makes every device->host copy of
    # a gradient piece a synchronous one on CUDA. Only what crosses the link is pinned.
    pin = r.boolean(offload, "pin_memory", "zero_optimization.offload_optimizer.pin_memory", True)
    return zenflow, stage, device, pin


def _offload_device(r: Reader, offload: Mapping, has_zenflow: bool) -> str:
    """offload_optimizer.device: "cpu" or "none" ("cpu" required by a zenflow block)."""
    device = offload.get("device")
    if device is None:
        device = "none"
        if has_zenflow:
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
    elif has_zenflow and device != "cpu":
        r.problem(
            "zero_optimization.offload_optimizer.device",
            device,
            'must be "cpu" when a zenflow block is present',
            'set offload_optimizer.device to "cpu" (or remove the zenflow block)',
        )
    return device
