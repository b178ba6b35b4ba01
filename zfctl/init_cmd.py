"""`zfctl init`: write a DeepSpeed JSON config (ZeRO-2, CPU offload, zenflow block).

Loads a template from templates/, applies the flags as dotted overrides, validates the
result with the engine's own parser and only then writes it (atomically).
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from zenflow import jsonout
from zfctl import panels
from zfctl.errors import err_console, user_error

TEMPLATES = ("zenflow", "offload")
ZF = "zero_optimization.zenflow."
SCHED = "scheduler.params."


def templates_dir() -> Path:
    """templates/ at the repository root (the package is installed editable)."""
    return Path(__file__).resolve().parents[1] / "templates"


def template_path(name: str) -> Path:
    if name not in TEMPLATES:
        raise user_error(
            f"--template {name!r} is not a template; choose one of {', '.join(TEMPLATES)}."
        )
    path = templates_dir() / f"{name}.json"
    if not path.is_file():
        raise user_error(
            f"template file {path} is missing; reinstall zfctl from its repository "
            "(pip install -e .)."
        )
    return path


def _int_or_auto(text: str | None) -> int | str | None:
    """'auto' stays a string, digits become an int; anything else is left for the config
    validator, which names the key, the value and what is allowed."""
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else text


def init(
    # -- Training: the optimizer and its schedule
    lr: Annotated[
        float | None, typer.Option(help="Peak learning rate.", rich_help_panel=panels.TRAINING)
    ] = None,
    weight_decay: Annotated[
        float | None, typer.Option(help="AdamW weight decay.", rich_help_panel=panels.TRAINING)
    ] = None,
    micro_batch: Annotated[
        int | None,
        typer.Option(help="train_micro_batch_size_per_gpu.", rich_help_panel=panels.TRAINING),
    ] = None,
    grad_accum: Annotated[
        int | None,
        typer.Option(
            help="Micro-batches per step (accumulated).",
            rich_help_panel=panels.TRAINING,
        ),
    ] = None,
    gradient_clipping: Annotated[
        float | None,
        typer.Option(
            help="Global gradient-norm clipping (0 = off).", rich_help_panel=panels.TRAINING
        ),
    ] = None,
    bf16: Annotated[
        bool | None,
        typer.Option(
            "--bf16/--no-bf16",
            help="bf16 weights, gradients and autocast.",
            rich_help_panel=panels.TRAINING,
        ),
    ] = None,
    scheduler: Annotated[
        str | None,
        typer.Option(
            help="WarmupLR, WarmupDecayLR, WarmupCosineLR or none.", rich_help_panel=panels.TRAINING
        ),
    ] = None,
    warmup_steps: Annotated[
        int | None,
        typer.Option(help="Scheduler warmup_num_steps.", rich_help_panel=panels.TRAINING),
    ] = None,
    total_steps: Annotated[
        int | None,
        typer.Option(help="Scheduler total_num_steps.", rich_help_panel=panels.TRAINING),
    ] = None,
    # -- Engine: the template and its zenflow block
    template: Annotated[
        str, typer.Option(help="zenflow or offload.", rich_help_panel=panels.ENGINE)
    ] = "zenflow",
    topk_ratio: Annotated[
        float | None,
        typer.Option(help="Device-updated share of columns.", rich_help_panel=panels.ENGINE),
    ] = None,
    select_strategy: Annotated[
        str | None,
        typer.Option(help="Re-selection: auto, step or epoch.", rich_help_panel=panels.ENGINE),
    ] = None,
    select_interval: Annotated[
        str | None,
        typer.Option(help="Re-selection period, or auto.", rich_help_panel=panels.ENGINE),
    ] = None,
    update_interval: Annotated[
        str | None,
        typer.Option(help="Steps per host window, or auto.", rich_help_panel=panels.ENGINE),
    ] = None,
    full_warm_up_rounds: Annotated[
        int | None,
        typer.Option(help="Warm-up steps of plain AdamW.", rich_help_panel=panels.ENGINE),
    ] = None,
    overlap_step: Annotated[
        bool | None,
        typer.Option(
            "--overlap-step/--no-overlap-step",
            help="Host step on a background worker.",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    auto_ratio: Annotated[
        float | None,
        typer.Option(help="Votes that end an auto window.", rich_help_panel=panels.ENGINE),
    ] = None,
    pt_reserved_cores_perc: Annotated[
        float | None,
        typer.Option(help="CPU share kept for training.", rich_help_panel=panels.ENGINE),
    ] = None,
    window_lr: Annotated[
        str | None,
        typer.Option(help="Host step lr: last, sum or sqrt.", rich_help_panel=panels.ENGINE),
    ] = None,
    select_schedule: Annotated[
        str | None,
        typer.Option(help="Re-selection: fixed or doubling.", rich_help_panel=panels.ENGINE),
    ] = None,
    host_state: Annotated[
        str | None,
        typer.Option(
            help="Host state: exact (fp32) or compact (8-bit moments).",
            rich_help_panel=panels.ENGINE,
        ),  # fmt: skip
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override: dotted.json.path=value.",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    # -- Output: where the config goes, and the run's logs
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Where to write it (default ds_config.json; - stdout).",
            show_default=False,
            rich_help_panel=panels.OUTPUT,
        ),
    ] = None,
    print_only: Annotated[
        bool,
        typer.Option(
            "--print",
            help="Same as --output -: the config on stdout.",
            rich_help_panel=panels.OUTPUT,
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Overwrite an existing file.", rich_help_panel=panels.OUTPUT),
    ] = False,
    tensorboard: Annotated[
        str | None,
        typer.Option(
            metavar="DIR",
            help="Log to TensorBoard under DIR/<job name>.",
            rich_help_panel=panels.OUTPUT,
        ),
    ] = None,
    csv_monitor: Annotated[
        str | None,
        typer.Option(
            metavar="DIR",
            help="Log to CSV files under DIR/<job name>.",
            rich_help_panel=panels.OUTPUT,
        ),
    ] = None,
    job_name: Annotated[
        str | None,
        typer.Option(
            help="job_name of those logs (default: the run's name).", rich_help_panel=panels.OUTPUT
        ),
    ] = None,
) -> None:
    """Write a DeepSpeed JSON config with a zenflow block, validated before it is written.

    A flag that would have no effect is dropped with a yellow warning on stderr naming it
    (exit 0): --warmup-steps and --total-steps with --scheduler none, --total-steps with
    WarmupLR, --force when writing to stdout. --print with --output FILE is refused (exit 2).
    Every option: README.md, "Option reference".
    """
    from zenflow.config import parse_set_args

    to_stdout = _writes_stdout(output, print_only)
    output = output or Path(DEFAULT_OUTPUT)
    warnings: list[str] = []
    if to_stdout and force:
        warnings.append("--force has no effect when the config goes to stdout; ignored it.")
    path = template_path(template)
    raw = json.loads(path.read_text(encoding="utf-8"))
    zenflow_flags = {
        "topk_ratio": topk_ratio,
        "select_strategy": select_strategy,
        "select_interval": _int_or_auto(select_interval),
        "update_interval": _int_or_auto(update_interval),
        "full_warm_up_rounds": full_warm_up_rounds,
        "overlap_step": overlap_step,
        "auto_ratio": auto_ratio,
        "pt_reserved_cores_perc": pt_reserved_cores_perc,
    }
    engine_flags = {"window_lr": window_lr, "select_schedule": select_schedule,
                    "host_state": host_state}  # fmt: skip
    overrides: dict[str, Any] = _zenflow_overrides(template, zenflow_flags, engine_flags)
    set_args = parse_set_args(set_ or [])
    warmup_steps, total_steps = _scheduler_steps(
        scheduler, warmup_steps, total_steps, set_args, raw, warnings
    )
    common = {
        "optimizer.params.lr": lr,
        "optimizer.params.weight_decay": weight_decay,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": gradient_clipping,
        "bf16.enabled": bf16,
        SCHED + "warmup_num_steps": warmup_steps,
        SCHED + "total_num_steps": total_steps,
    }
    overrides.update({k: v for k, v in common.items() if v is not None})
    if lr is not None:
        overrides[SCHED + "warmup_max_lr"] = lr  # the schedule's peak follows --lr
    if scheduler is not None:
        overrides = _set_scheduler(raw, overrides, scheduler)
    overrides.update(_monitor_overrides(tensorboard, csv_monitor, job_name))
    overrides.update(set_args)
    _early_off_for_auto(raw, overrides, warnings)
    config = _validated(raw, overrides, template, set_args)
    data = config.raw
    err = err_console()
    for line in warnings:
        err.print(f"[yellow]warning:[/] {escape(line)}")
    if to_stdout:
        typer.echo(jsonout.dumps(data, indent=2))
        describe(err, config, None, template)
        return
    _write_file(output, data, force)
    describe(Console(highlight=False, emoji=False), config, output, template)


DEFAULT_OUTPUT = "ds_config.json"


def _zenflow_overrides(template: str, zenflow_flags: dict, engine_flags: dict) -> dict[str, Any]:
    """The zenflow flags that were given, as dotted keys: the zero_optimization.zenflow block's
    and zfctl's engine block's; refused for a template without a zenflow block."""
    given = {ZF + k: v for k, v in zenflow_flags.items() if v is not None}
    # ZenFlow settings of zfctl's engine (the top-level block)
    for key, value in engine_flags.items():
        if value is not None:
            given["zfctl." + key] = value
    if given and template != "zenflow":
        flags = ", ".join("--" + k.rpartition(".")[2].replace("_", "-") for k in given)
        raise user_error(
            f"{flags} set zenflow fields, but --template {template} has no zenflow block; "
            "use --template zenflow."
        )
    return dict(given)


def _early_off_for_auto(raw: dict, overrides: dict[str, Any], warnings: list[str]) -> None:
    """The template's early ramp (zfctl.early) grows the window to update_interval: with
    --update-interval auto (or its --set) and no zfctl.early setting given, the early phase
    is turned off, with a warning, instead of the config refusing the pair."""
    if overrides.get(ZF + "update_interval") != "auto":
        return
    if any(k == "zfctl.early" or k.startswith("zfctl.early.") for k in overrides):
        return  # the user's own early settings: the config's rule speaks for them
    early = (raw.get("zfctl") or {}).get("early") or {}
    if early.get("steps", 0) and early.get("windows", "ramp") == "ramp":
        overrides["zfctl.early.steps"] = 0
        warnings.append(
            "zfctl.early turned off (steps 0): its ramp grows the window to update_interval, "
            "which is auto here; set an integer --update-interval to keep it."
        )


def _scheduler_steps(scheduler, warmup_steps, total_steps, set_args: dict, raw: dict,
                     warnings: list[str]) -> tuple[int | None, int | None]:  # fmt: skip
    """--warmup-steps and --total-steps as the scheduler can take them: both dropped for
    --scheduler none, --total-steps for WarmupLR (which has none), each with a warning."""
    if scheduler is not None and scheduler.lower() == "none":
        warnings += [
            f"{flag} {value} dropped: --scheduler none writes no scheduler block."
            for flag, value in (("--warmup-steps", warmup_steps), ("--total-steps", total_steps))
            if value is not None
        ]
        return None, None
    kind = set_args.get("scheduler.type", scheduler or (raw.get("scheduler") or {}).get("type"))
    if total_steps is not None and kind == "WarmupLR":
        warnings.append(
            f"--total-steps {total_steps} dropped: the WarmupLR scheduler has no "
            "total_num_steps (WarmupDecayLR and WarmupCosineLR do: add --scheduler "
            "WarmupDecayLR)."
        )
        total_steps = None
    return warmup_steps, total_steps


def _set_scheduler(raw: dict, overrides: dict[str, Any], scheduler: str) -> dict[str, Any]:
    """--scheduler: none removes the template's scheduler block and every scheduler key;
    a name sets scheduler.type."""
    if scheduler.lower() == "none":
        raw.pop("scheduler", None)
        return {k: v for k, v in overrides.items() if not k.startswith(SCHED)}
    overrides["scheduler.type"] = scheduler
    return overrides


def _monitor_overrides(tensorboard, csv_monitor, job_name) -> dict[str, Any]:
    """--tensorboard / --csv-monitor as their DeepSpeed blocks; --job-name needs one."""
    if job_name is not None and tensorboard is None and csv_monitor is None:
        raise user_error("--job-name names the logs of --tensorboard or --csv-monitor; pass one.")
    overrides: dict[str, Any] = {}
    for block, folder in (("tensorboard", tensorboard), ("csv_monitor", csv_monitor)):
        if folder is not None:
            overrides[f"{block}.enabled"] = True
            overrides[f"{block}.output_path"] = folder
            if job_name is not None:
                overrides[f"{block}.job_name"] = job_name
    return overrides


def _validated(raw: dict, overrides: dict[str, Any], template: str, set_args=()):
    """Validate exactly what will be written; raises ConfigError listing every problem,
    each one from a flag named by that flag (``--window-lr bogus``), from ``--set`` by the
    item (keys in ``set_args``)."""
    import dataclasses

    from zenflow.config import ConfigError, load_config

    try:
        return load_config(raw, overrides=overrides)
    except ConfigError as exc:  # name what the user gave, not an anonymous dict
        problems = [dataclasses.replace(p, origin=_flag_origin(p.origin, set_args))
                    for p in exc.problems]  # fmt: skip
        raise ConfigError(problems, f"zfctl init (template {template} + flags)") from None


# The flags of `zfctl init` that write a key outside the zenflow and zfctl blocks (whose
# flags are named by their key: zfctl.window_lr <- --window-lr).
_FLAG_OF_KEY = {
    "optimizer.params.lr": "--lr", SCHED + "warmup_max_lr": "--lr",
    "optimizer.params.weight_decay": "--weight-decay",
    "train_micro_batch_size_per_gpu": "--micro-batch",
    "gradient_accumulation_steps": "--grad-accum", "gradient_clipping": "--gradient-clipping",
    SCHED + "warmup_num_steps": "--warmup-steps", SCHED + "total_num_steps": "--total-steps",
    "scheduler.type": "--scheduler", "tensorboard.enabled": "--tensorboard",
    "tensorboard.output_path": "--tensorboard", "csv_monitor.enabled": "--csv-monitor",
    "csv_monitor.output_path": "--csv-monitor", "tensorboard.job_name": "--job-name",
    "csv_monitor.job_name": "--job-name",
}  # fmt: skip


def _flag_origin(origin: str, set_args) -> str:
    """``origin`` (the loader's "--set key=value") as the flag the user typed when the key
    came from a flag of this command rather than from --set."""
    if not origin.startswith("--set "):
        return origin
    key, _, value = origin[len("--set ") :].partition("=")
    if key in set_args:
        return origin
    if key == "bf16.enabled":
        return "--bf16" if value == "true" else "--no-bf16"
    flag = _FLAG_OF_KEY.get(key)
    if flag is None and key.startswith((ZF, "zfctl.")):
        flag = "--" + key.rpartition(".")[2].replace("_", "-")
    return f"{flag} {value}" if flag is not None else origin


def _writes_stdout(output: Path | None, print_only: bool) -> bool:
    """Whether the config goes to stdout: --print, --output -, or an --output that is this
    process's stdout (/dev/stdout, /dev/fd/1: the messages would otherwise land in the
    same place). --print with --output FILE contradict: refused."""
    if output is not None and str(output) == "-":
        return True
    if print_only:
        if output is not None:
            raise user_error(
                f"--print writes the config to stdout and --output {output} to a file; pass "
                "one of them (--output - is the same as --print)."
            )
        return True
    return output is not None and _is_stdout(output)


def _is_stdout(path: Path) -> bool:
    try:
        named, out = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return False  # no such path, or stdout is not a file descriptor (a test's capture)
    return (named.st_dev, named.st_ino) == (out.st_dev, out.st_ino)


def _write_file(output: Path, data: dict, force: bool) -> None:
    """Write the config to ``output`` (zenflow.outputs: a file atomically, a FIFO or
    character device into it, anything else refused); an existing file needs --force."""
    from zenflow.outputs import output_target, write_json_atomic

    if output.is_dir():
        raise user_error(
            f"--output {output} is a directory; give a file path, e.g. --output "
            f"{output / DEFAULT_OUTPUT}."
        )
    target = output_target(output, "--output: cannot write")
    if target.exists and not target.direct and not force:
        raise user_error(
            f"{output} already exists; pass --force to overwrite it, or --output PATH to "
            "write elsewhere."
        )
    write_json_atomic(output, data, "--output: cannot write")


def describe(console: Console, config, output: Path | None, template: str) -> None:
    """What was written (``output``; None: stdout) and the settings that matter, then the
    next command."""
    where = "the config to stdout" if output is None else str(output)
    console.print(f"[green]wrote[/] {escape(where)} (template {template})")
    if config.zenflow is not None:
        zf = config.zenflow
        console.print(
            f"  zenflow: topk_ratio={zf.topk_ratio} update_interval={zf.update_interval} "
            f"select={zf.select_strategy}/{zf.select_interval} overlap_step={zf.overlap_step} "
            f"warm-up={zf.full_warm_up_rounds}"
        )
    console.print(
        f"  optimizer {config.optimizer.type} lr={config.optimizer.lr} "
        f"micro-batch={config.train_micro_batch_size_per_gpu} "
        f"grad-accum={config.gradient_accumulation_steps} bf16={config.bf16}"
    )
    for name in ("tensorboard", "csv_monitor"):
        block = getattr(config.monitor, name)
        if block.enabled:
            where = block.output_path or f"<run dir>/{name}"
            console.print(f"  {name}: {escape(where)}/{escape(block.job_name or '<run name>')}")
    if config.ignored:
        console.print(
            "[yellow]note:[/] not used by the zenflow engine (kept for DeepSpeed): "
            + escape(", ".join(config.ignored))
        )
    file = "FILE" if output is None else str(output)
    console.print(f"next: zfctl tune-hw --config {escape(file)} --write")
