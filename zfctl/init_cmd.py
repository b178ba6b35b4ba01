"""`zfctl init`: write a DeepSpeed JSON config (ZeRO-2, CPU offload, zenflow block).

Loads a template from templates/, applies the flags as dotted overrides, validates the
result with the engine's own parser and only then writes it (atomically).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from zenflow import jsonout
from zfctl.errors import user_error

TEMPLATES = ("zenflow", "offload")
ZF = "zero_optimization.zenflow."


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


def _doc(field: str) -> str:
    from zenflow.config import FIELD_DOCS

    return FIELD_DOCS[field]


def init(
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Where to write the config.")
    ] = Path("ds_config.json"),
    template: Annotated[
        str,
        typer.Option(help="Template: zenflow (ZeRO-2 + CPU offload + zenflow) or offload."),
    ] = "zenflow",
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    print_only: Annotated[
        bool, typer.Option("--print", help="Print the config to stdout instead of writing.")
    ] = False,
    topk_ratio: Annotated[float | None, typer.Option(help=_doc("topk_ratio"))] = None,
    select_strategy: Annotated[str | None, typer.Option(help=_doc("select_strategy"))] = None,
    select_interval: Annotated[str | None, typer.Option(help=_doc("select_interval"))] = None,
    update_interval: Annotated[str | None, typer.Option(help=_doc("update_interval"))] = None,
    full_warm_up_rounds: Annotated[
        int | None, typer.Option(help=_doc("full_warm_up_rounds"))
    ] = None,
    overlap_step: Annotated[
        bool | None, typer.Option("--overlap-step/--no-overlap-step", help=_doc("overlap_step"))
    ] = None,
    auto_ratio: Annotated[float | None, typer.Option(help=_doc("auto_ratio"))] = None,
    pt_reserved_cores_perc: Annotated[
        float | None, typer.Option(help=_doc("pt_reserved_cores_perc"))
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate.")] = None,
    weight_decay: Annotated[float | None, typer.Option(help="AdamW weight decay.")] = None,
    micro_batch: Annotated[int | None, typer.Option(help="train_micro_batch_size_per_gpu.")] = None,
    grad_accum: Annotated[
        int | None, typer.Option(help="gradient_accumulation_steps (micro-batches per step).")
    ] = None,
    gradient_clipping: Annotated[
        float | None, typer.Option(help="Global gradient-norm clipping (0 = off).")
    ] = None,
    bf16: Annotated[
        bool | None,
        typer.Option(
            "--bf16/--no-bf16",
            help='bf16 weights, gradients and autocast (default: the template\'s "auto": on '
            "for a CUDA GPU with bf16 and for sim, off on the CPU).",
        ),
    ] = None,
    scheduler: Annotated[
        str | None,
        typer.Option(help="LR scheduler: WarmupLR, WarmupDecayLR, WarmupCosineLR or none."),
    ] = None,
    warmup_steps: Annotated[int | None, typer.Option(help="Scheduler warmup_num_steps.")] = None,
    total_steps: Annotated[
        int | None,
        typer.Option(help="Scheduler total_num_steps (WarmupDecayLR, WarmupCosineLR)."),
    ] = None,
    tensorboard: Annotated[
        str | None,
        typer.Option(
            metavar="DIR",
            help="Log every step and eval to TensorBoard under DIR/<job name> (DeepSpeed's "
            'tensorboard block; "" = inside the run directory).',
        ),
    ] = None,
    csv_monitor: Annotated[
        str | None,
        typer.Option(
            metavar="DIR",
            help="Log every step and eval to CSV files under DIR/<job name> (DeepSpeed's "
            'csv_monitor block; "" = inside the run directory).',
        ),
    ] = None,
    job_name: Annotated[
        str | None,
        typer.Option(
            help="job_name of the tensorboard/csv_monitor blocks (default: each run's "
            "directory name, so runs do not share files)."
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override any key: --set dotted.json.path=value (repeatable)."),
    ] = None,
) -> None:
    """Write a DeepSpeed JSON config with a zenflow block, validated before it is written."""
    from zenflow.config import ConfigError, load_config, parse_set_args

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
    given = {ZF + k: v for k, v in zenflow_flags.items() if v is not None}
    if given and template != "zenflow":
        flags = ", ".join("--" + k[len(ZF) :].replace("_", "-") for k in given)
        raise user_error(
            f"{flags} set zenflow fields, but --template {template} has no zenflow block; "
            "use --template zenflow."
        )
    overrides: dict[str, Any] = dict(given)
    sched = "scheduler.params."
    common = {
        "optimizer.params.lr": lr,
        "optimizer.params.weight_decay": weight_decay,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": gradient_clipping,
        "bf16.enabled": bf16,
        sched + "warmup_num_steps": warmup_steps,
        sched + "total_num_steps": total_steps,
    }
    overrides.update({k: v for k, v in common.items() if v is not None})
    if lr is not None:
        overrides[sched + "warmup_max_lr"] = lr  # the schedule's peak follows --lr
    if scheduler is not None:
        if scheduler.lower() == "none":
            raw.pop("scheduler", None)
            overrides = {k: v for k, v in overrides.items() if not k.startswith(sched)}
        else:
            overrides["scheduler.type"] = scheduler
    if job_name is not None and tensorboard is None and csv_monitor is None:
        raise user_error("--job-name names the logs of --tensorboard or --csv-monitor; pass one.")
    for block, folder in (("tensorboard", tensorboard), ("csv_monitor", csv_monitor)):
        if folder is not None:
            overrides[f"{block}.enabled"] = True
            overrides[f"{block}.output_path"] = folder
            if job_name is not None:
                overrides[f"{block}.job_name"] = job_name
    overrides.update(parse_set_args(set_ or []))
    # Validate exactly what will be written; raises ConfigError listing every problem.
    try:
        config = load_config(raw, overrides=overrides)
    except ConfigError as exc:  # name what the user gave, not an anonymous dict
        raise ConfigError(exc.problems, f"zfctl init (template {template} + flags)") from None
    data = config.raw
    if print_only:
        typer.echo(jsonout.dumps(data, indent=2))
        return
    if output.is_dir():
        raise user_error(
            f"--output {output} is a directory; give a file path, e.g. --output "
            f"{output / 'ds_config.json'}."
        )
    if output.exists() and not force:
        raise user_error(
            f"{output} already exists; pass --force to overwrite it, or --output PATH to "
            "write elsewhere."
        )
    from zenflow.train.runs import write_json_atomic, writing

    with writing(output, "--output: cannot write"):
        write_json_atomic(output, data)
    console = Console(highlight=False)
    console.print(f"[green]wrote[/] {escape(str(output))} (template {template})")
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
    console.print(f"next: zfctl tune-hw --config {escape(str(output))} --write")
