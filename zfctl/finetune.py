"""`zfctl finetune MODEL --task TASK`: parse, call zenflow.train.trainer, render its events.

The command reads as its steps: check the flags (``zfctl.finetune_flags``), start the
ranks of ``--nproc``, load the config, build the ``RunSpec``, check that it fits
(``zenflow.hardware.estimate.preflight``), choose a renderer (``zfctl.progress``: the live
dashboard, plain lines or ``--json``), run, print the summary. A run that diverges exits
``EXIT_DIVERGED`` (3) after one message naming the likely causes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from zenflow.config.architectures import architecture_names
from zfctl import panels
from zfctl.dashboard import render_summary
from zfctl.errors import (
    EXIT_DIVERGED,
    EXIT_USER_ERROR,
    check_config_file,
    err_console,
    print_user_error,
    user_error,
)
from zfctl.finetune_flags import (
    check_flags,
    check_positive,
    check_sim_profile,
    data_location,
    lora_flags,
)
from zfctl.progress import LiveRenderer, choose_renderer, quiet_hugging_face

# Generated from the registry `zfctl estimate` reads too (zenflow.config.architectures).
MODEL_HELP = (
    "Hugging Face model id, a local directory, minilm, or a built-in architecture: "
    + ", ".join(architecture_names()) + "."
)  # fmt: skip


def finetune(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    # -- Data: what is trained on
    task: Annotated[
        str | None,
        typer.Option(
            "--task", help="GLUE task, e.g. sst2; --data: run's name.", rich_help_panel=panels.DATA
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data", help="Your training table, or a hub dataset.", rich_help_panel=panels.DATA
        ),
    ] = None,
    eval_data: Annotated[
        Path | None,
        typer.Option(
            "--eval-data",
            help="Evaluation table; default 10% of --data.",
            rich_help_panel=panels.DATA,
        ),
    ] = None,
    text_field: Annotated[
        list[str] | None,
        typer.Option(
            "--text-field",
            help="Text column(s) of --data (default: text).",
            rich_help_panel=panels.DATA,
        ),
    ] = None,
    label_field: Annotated[
        str | None,
        typer.Option(
            "--label-field",
            help="Label column of --data (default: label).",
            rich_help_panel=panels.DATA,
        ),
    ] = None,
    tsv_quoting: Annotated[
        str | None,
        typer.Option(help="Quoting of a .tsv --data: csv or none.", rich_help_panel=panels.DATA),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(envvar="GLUE_DIR", help="GLUE data folder.", rich_help_panel=panels.DATA),
    ] = None,
    sample_data: Annotated[
        bool,
        typer.Option(help="A synthetic SST-2 sample (offline demo).", rich_help_panel=panels.DATA),
    ] = False,
    objective: Annotated[
        str, typer.Option(help="classification or causal-lm.", rich_help_panel=panels.DATA)
    ] = "classification",
    pack: Annotated[
        bool,
        typer.Option(
            "--pack", help="causal-lm: pack short examples into rows.", rich_help_panel=panels.DATA
        ),
    ] = False,
    prompt_field: Annotated[
        str | None, typer.Option(help="causal-lm: prompt field.", rich_help_panel=panels.DATA)
    ] = None,
    completion_field: Annotated[
        str | None, typer.Option(help="causal-lm: completion field.", rich_help_panel=panels.DATA)
    ] = None,
    messages_field: Annotated[
        str | None,
        typer.Option(help="causal-lm: chat messages field.", rich_help_panel=panels.DATA),
    ] = None,
    # -- Model: which weights
    init: Annotated[
        str,
        typer.Option(
            help="pretrained, or random (the architecture only).", rich_help_panel=panels.MODEL
        ),
    ] = "pretrained",
    gradient_checkpointing: Annotated[
        bool,
        typer.Option(
            "--gradient-checkpointing",
            help="Recompute activations in backward.",
            rich_help_panel=panels.MODEL,
        ),
    ] = False,
    # -- Training: how long, how fast, how often evaluated
    max_steps: Annotated[
        int | None, typer.Option(min=1, help="Stop after N steps.", rich_help_panel=panels.TRAINING)
    ] = None,
    epochs: Annotated[
        float | None, typer.Option(help="Stop after N epochs.", rich_help_panel=panels.TRAINING)
    ] = None,
    micro_batch: Annotated[
        int | None, typer.Option(min=1, help="Micro-batch size.", rich_help_panel=panels.TRAINING)
    ] = None,
    seq_len: Annotated[
        int, typer.Option(min=2, help="Tokens per example.", rich_help_panel=panels.TRAINING)
    ] = 128,
    lr: Annotated[
        float | None, typer.Option(help="Peak learning rate.", rich_help_panel=panels.TRAINING)
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            help="Random seed (init, data order, dropout).", rich_help_panel=panels.TRAINING
        ),
    ] = 42,
    eval_every: Annotated[
        int | None,
        typer.Option(min=1, help="Also evaluate every N steps.", rich_help_panel=panels.TRAINING),
    ] = None,
    max_eval_samples: Annotated[
        int | None,
        typer.Option(
            min=1, help="Evaluate on the first N validation rows.", rich_help_panel=panels.TRAINING
        ),
    ] = None,
    checkpoint_every: Annotated[
        int | None,
        typer.Option(min=1, help="Also checkpoint every N steps.", rich_help_panel=panels.TRAINING),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="auto, a run directory, or a checkpoint file.", rich_help_panel=panels.TRAINING
        ),
    ] = None,
    # -- Engine: the optimizer engine and its config
    engine: Annotated[
        str,
        typer.Option(
            help="zenflow, offload, device, deepspeed or lora.", rich_help_panel=panels.ENGINE
        ),
    ] = "zenflow",
    lora_rank: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65536,
            help="--engine lora: adapter rank (default 8).",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    lora_alpha: Annotated[
        float | None,
        typer.Option(
            help="--engine lora: adapter alpha (default 8).", rich_help_panel=panels.ENGINE
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="DeepSpeed JSON config (default: templates/zenflow.json).",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override a config key: dotted.json.path=value.",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    hw_json: Annotated[
        Path | None,
        typer.Option(
            help="tune-hw result saved with the run (default ./hw.json).",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    # -- Devices: where it runs
    device: Annotated[
        str | None,
        typer.Option(
            help="cpu, cuda or sim (default: cuda when present).", rich_help_panel=panels.DEVICES
        ),
    ] = None,
    nproc: Annotated[
        int,
        typer.Option(
            min=1, help="Data-parallel processes on this machine.", rich_help_panel=panels.DEVICES
        ),
    ] = 1,
    sim_profile: Annotated[
        str | None,
        typer.Option(
            help="--device sim: match a GPU box's compute:link.", rich_help_panel=panels.DEVICES
        ),
    ] = None,
    device_mem: Annotated[
        str | None,
        typer.Option(
            envvar="ZFCTL_DEVICE_MEM",
            help="Device memory for the preflight check.",
            rich_help_panel=panels.DEVICES,
        ),
    ] = None,
    host_mem: Annotated[
        str | None,
        typer.Option(
            envvar="ZFCTL_HOST_MEM",
            help="Host memory for the preflight check (default: MemAvailable).",
            rich_help_panel=panels.DEVICES,
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Skip the preflight memory check.", rich_help_panel=panels.DEVICES
        ),
    ] = False,
    # -- Output: the run directory and what is shown
    run_dir: Annotated[
        Path | None,
        typer.Option(
            help="Run directory (default: a new one under --runs-root).",
            rich_help_panel=panels.OUTPUT,
        ),
    ] = None,
    runs_root: Annotated[
        Path, typer.Option(help="Where new run directories go.", rich_help_panel=panels.OUTPUT)
    ] = Path("runs"),
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Start --run-dir's zfctl run over.", rich_help_panel=panels.OUTPUT
        ),
    ] = False,
    reference: Annotated[
        Path | None,
        typer.Option(
            help="An earlier run to show beside each evaluation.", rich_help_panel=panels.OUTPUT
        ),
    ] = None,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON object per step/event on stdout.",
            rich_help_panel=panels.OUTPUT,
        ),
    ] = False,
    no_dashboard: Annotated[
        bool,
        typer.Option(
            "--no-dashboard",
            help="Plain progress lines, no live dashboard.",
            rich_help_panel=panels.OUTPUT,
        ),
    ] = False,
) -> None:
    """Fine-tune MODEL on a GLUE task (--task) or your own table (--data) with the ZenFlow
    engine (or a comparison engine). Every option: README.md, "Option reference".

    Exits 3 when the run diverges (loss non-finite 5 steps running); the good checkpoint stays.
    """
    flags = SimpleNamespace(**locals())  # the options as given, for the steps below
    # The trainer loads first, before any check, as it always has: what it imports (torch,
    # datasets) is in sys.modules when quiet_hugging_face looks.
    from zenflow.train.spec import resume_or_new
    from zenflow.train.trainer import run_finetune

    task = check_flags(flags)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:  # start the ranks; each runs this again
        raise typer.Exit(_launch_ranks(nproc, engine))
    rank = int(os.environ.get("RANK", "0") or 0)
    check_positive("--epochs", epochs)
    check_positive("--lr", lr)
    cfg = _load_run_config(config, [*(set_ or []), *lora_flags(engine, lora_rank, lora_alpha)])
    check_sim_profile(sim_profile, device)
    device_mem_bytes = _device_mem_bytes(device_mem)
    out = Console(highlight=False, emoji=False)
    if sample_data:
        data_dir = _sample_data_dir(task, runs_root, json_output, out)
    if cfg.ignored and not json_output:
        out.print(
            "[yellow]note:[/] config keys not used by the zenflow engine: "
            + escape(", ".join(cfg.ignored))
        )
    spec = _run_spec(flags, cfg, task, data_dir, device_mem_bytes)
    # A resumed run keeps the settings it was checked with; --resume auto without an earlier
    # run is a new run (resume_or_new) and is checked like one.
    if not force and resume_or_new(spec)[0].resume is None:
        fitted, host_peak = _preflight(flags, spec, cfg, task)
        # what the run fits with (FITTED_NOTES), and the host peak it was checked at
        spec = dataclasses.replace(spec, **fitted, host_peak_estimate=host_peak)
        if rank == 0 and not json_output:
            for key, value in fitted.items():
                out.print(FITTED_NOTES[key, value])
    renderer = choose_renderer(rank, json_output, no_dashboard, out, cfg.steps_per_print)
    if reference is not None and rank == 0:  # checked with --json too, shown where drawn
        ref_name, ref_evals = _reference_evals(reference, runs_root)
        if hasattr(renderer, "state"):
            renderer.state.reference_name, renderer.state.reference = ref_name, ref_evals
    if not isinstance(renderer, LiveRenderer):
        quiet_hugging_face(errors_only=json_output or rank != 0)
    summary = _run(run_finetune, spec, renderer, rank)
    if rank == 0 and not json_output:
        _print_end(out, renderer, summary)


def _launch_ranks(nproc: int, engine: str) -> int:
    """--nproc N: start N ranks of this same command line (torch.distributed.run); the
    exit code is theirs."""
    from zfctl.launch import launch

    if engine == "deepspeed":
        raise user_error("--nproc with --engine deepspeed is not supported; use torchrun "
                         "with DeepSpeed's own launcher, or --engine zenflow.")  # fmt: skip
    return launch(nproc, sys.argv[1:])


def _load_run_config(config: Path | None, set_: list[str] | None):
    """--config (default: the zenflow template) with the --set overrides, validated."""
    from zenflow.config import load_config, parse_set_args
    from zfctl.init_cmd import template_path

    check_config_file(config)
    return load_config(config or template_path("zenflow"), overrides=parse_set_args(set_ or []))


def _device_mem_bytes(device_mem: str | None) -> int | None:
    if device_mem is None:
        return None
    from zenflow.hardware.estimate import parse_size

    return parse_size(device_mem, "--device-mem")


def _sample_data_dir(task: str | None, runs_root: Path, json_output: bool, out: Console):
    """--sample-data: write the synthetic SST-2 sample under --runs-root and say so; the
    folder it is in stands for --data-dir."""
    if task != "sst2":
        raise user_error(f"--sample-data provides SST-2 only, not {task!r}; pass --data-dir.")
    from zenflow.train.data import write_sst2_sample

    data_dir = write_sst2_sample(Path(runs_root) / ".sample-data")
    if not json_output:
        out.print(
            "[yellow]note:[/] using a synthetic SST-2-format sample written by zfctl "
            f"({escape(str(data_dir))}), not GLUE data."
        )
    return data_dir


def _run_spec(flags: SimpleNamespace, cfg, task: str | None, data_dir, device_mem_bytes):
    """The RunSpec the trainer runs: the options, with the checked task name, the config,
    the data folder (--sample-data's, or --data-dir) and --device-mem in bytes."""
    from zenflow.train.trainer import RunSpec

    f = flags
    return RunSpec(
        model=f.model, task=task, config=cfg, init=f.init,
        data_dir=str(data_dir) if data_dir is not None else None, engine_mode=f.engine,
        max_steps=f.max_steps, epochs=f.epochs, micro_batch=f.micro_batch, seq_len=f.seq_len,
        lr=f.lr, seed=f.seed, run_dir=f.run_dir, runs_root=f.runs_root, resume=f.resume,
        eval_every=f.eval_every, max_eval_samples=f.max_eval_samples, hw_json=f.hw_json,
        checkpoint_every=f.checkpoint_every, overwrite=f.overwrite, device=f.device,
        config_given=f.config is not None or bool(f.set_) or f.lora_rank is not None
        or f.lora_alpha is not None,
        gradient_checkpointing=f.gradient_checkpointing, sim_profile=f.sim_profile,
        device_mem=device_mem_bytes,
        # absolute: a resumed run (from any folder) reads the same files
        data_file=data_location(f.data), eval_file=data_location(f.eval_data),
        text_fields=tuple(f.text_field) if f.text_field else None, label_field=f.label_field,
        tsv_quoting=f.tsv_quoting, objective=f.objective, pack=f.pack,
        prompt_field=f.prompt_field, completion_field=f.completion_field,
        messages_field=f.messages_field,
    )  # fmt: skip


# Said when the preflight fits a run by a setting the config left to it, by (field, value):
# none changes the run's arithmetic except "q8", per-step clipping from 8-bit copies.
FITTED_NOTES = {
    ("return_image", "never"): (
        '[yellow]note:[/] zfctl.return_image runs as "never": the early '
        "phase's bf16 images of the host results do not fit this host's memory "
        "(`zfctl estimate` shows them), so its return sends the fp32 masters "
        "(slower early steps, the same weights)"
    ),
    ("step_store", "off"): (
        '[yellow]note:[/] zfctl.step_store runs as "off": the step store (a step\'s '
        "gradient pieces kept until its clipping coefficient is known) does not fit this "
        "host's memory and this run does not clip, so each piece is added as it arrives (the "
        "same weights; the backward waits for the host's adds when they are slower)"
    ),
    ("step_store", "q8"): (
        '[yellow]note:[/] zfctl.step_store runs as "q8": the step store (a step\'s '
        "gradient pieces kept until its clipping coefficient is known) does not fit this "
        "host's memory, so each piece is added as it arrives, scaled by the previous step's "
        "coefficient, and corrected from an 8-bit copy once its own is known (per-step "
        "clipping within the copy's rounding; more host work, and the backward waits for the "
        "host's adds when they are slower). --set zfctl.step_store=on refuses instead"
    ),
}


def _preflight(
    flags: SimpleNamespace, spec, cfg, task: str | None
) -> tuple[dict[str, str], int | None]:
    """A new run's memory check (zfctl estimate's numbers): the device at a step's peak, the
    host at the whole run's peak (default: this machine's MemAvailable). It runs here, after
    the flags, the config and the data table's labels are read and before the model loads
    or anything model-sized is allocated (the model's config only, on the meta device):
    exit 2 when it cannot fit, naming the fixes (--force skips it). Returns the settings
    the run fits with where they are not the config's, as RunSpec fields (``return_image``
    "never": the early phase's images do not fit; ``step_store`` "off" or "q8": the step
    store does not fit, without clipping or with it; ``zenflow.hardware.estimate.fallbacks``),
    and the whole-run host peak it checked the run's engine at (None on a CPU device, whose
    memory is the host's too, and for DeepSpeed's engine, which is not ours to lay out)."""
    from zenflow.engine.accelerator import default_kind
    from zenflow.hardware.preflight import preflight
    from zenflow.train.data import get_task

    f = flags
    if f.objective == "causal-lm":  # the records need the tokenizer: read by the run
        num_labels = 2
    elif f.data is not None:  # its labels, read now: a bad file stops before anything starts
        from zenflow.train.spec import load_data

        num_labels = load_data(spec).task.num_labels
    else:
        num_labels = get_task(task).num_labels
    kind = f.device or default_kind()
    est = preflight(f.model, mode=f.engine, config=cfg, micro_batch=f.micro_batch,
                    seq_len=f.seq_len, num_labels=num_labels, head=f.objective,
                    device_mem=f.device_mem, host_mem=f.host_mem,
                    gradient_checkpointing=f.gradient_checkpointing,
                    separate_device=kind != "cpu", device_kind=kind)  # fmt: skip
    if est is None:
        return {}, None
    row = est.engines.get(f.engine)
    peak = row.host_peak_bytes if row is not None and kind != "cpu" else None
    if f.engine != "zenflow":
        return {}, peak
    checked = {"return_image": row.return_image, "step_store": row.step_store}
    return {k: v for k, v in checked.items() if v != getattr(cfg.engine, k)}, peak


def _run(run_finetune, spec, renderer, rank: int) -> dict:
    """Run the fine-tuning with ``renderer`` showing its events; an interrupted run says
    where its checkpoint is and how to resume (exit 130/143), a diverged one why (exit 3)."""
    from zenflow.train.parallel import RankLost
    from zenflow.train.trainer import RunDiverged, RunInterrupted

    try:
        with renderer:
            return run_finetune(spec, renderer)
    except RunInterrupted as exc:
        if rank != 0:
            raise typer.Exit(exc.exit_code) from None
        console = err_console()
        why = "stopped by SIGTERM" if exc.signal == "SIGTERM" else "interrupted"
        console.print(f"[yellow]{why} after step {exc.step}[/]")
        if exc.resume_command:
            console.print(f"checkpoint: {escape(str(exc.checkpoint))}")
            console.print(f"resume with: [bold]{escape(exc.resume_command)}[/]")
        raise typer.Exit(exc.exit_code) from None
    except RunDiverged as exc:
        if rank == 0:
            print_user_error(exc)
        raise typer.Exit(EXIT_DIVERGED) from None
    except RankLost as exc:  # another rank ended the job: rank 0 says so, once
        if rank == 0:
            print_user_error(exc)
        raise typer.Exit(EXIT_USER_ERROR) from None


def _print_end(out: Console, renderer, summary: dict) -> None:
    """The run's summary table (or that it had already finished) and the report command."""
    if renderer.already_finished:
        out.print(
            f"run {escape(str(summary.get('run_dir')))} already finished "
            f"({summary.get('steps')} steps); nothing to do."
        )
    else:
        out.print(render_summary(summary))
    out.print(f"report: zfctl report {escape(str(summary['run_dir']))}")


def _reference_evals(reference: Path, runs_root: Path) -> tuple[str, dict]:
    """--reference: the run's name and its evaluations by step (exit 2 for a path that is
    not a run, or a run without evaluations)."""
    from zenflow.train.runs import read_run
    from zfctl.report import resolve_runs

    (run_dir,) = resolve_runs([reference], runs_root)
    evals = {e["step"]: e for e in read_run(run_dir)["evals"] if isinstance(e.get("step"), int)}
    if not evals:
        raise user_error(
            f"--reference {reference}: that run has no evaluations to compare with; pass a "
            "run that evaluated (--eval-every), or leave it out."
        )
    return run_dir.name, evals
