"""What a fine-tuning run is: ``RunSpec``, the config it trains with, and resuming one.

``check_paths`` refuses run locations that cannot work before anything is loaded;
``read_hw_json`` reads the hardware probe a run keeps; ``resolve_resume`` finds the run
directory and checkpoints of ``--resume`` (``--resume auto``: ``run_match.find_resumable``);
``merge_resumed_spec`` takes the trajectory-defining fields from the saved run (and refuses
conflicting ones; a data file that moved with the same sha256, and a new ``--lr`` for a run
that diverged, are accepted); ``resume_command`` is the command line that continues a run,
``restart_hint`` what to do with a run that has no checkpoint. ``spec_record`` saves local
paths absolute, so a run resumes from any folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zenflow.errors import UserInputError
from zenflow.train import run_match, runs

ENGINE_MODES = ("zenflow", "offload", "device", "deepspeed", "lora")


@dataclass(frozen=True)
class RunSpec:
    """What to fine-tune and how. ``None`` means "from the config / the default"."""

    model: str  # hub id or local directory
    task: str  # GLUE task name (zenflow.train.data.GLUE_TASKS), or the name of a data_file run
    config: Any  # zenflow.config.Config
    init: str = "pretrained"  # pretrained | random
    data_dir: str | None = None  # GLUE root holding <task>/train.tsv; None: the hub
    engine_mode: str = "zenflow"  # zenflow | offload | device | deepspeed | lora
    max_steps: int | None = None  # stop after this many optimizer steps
    epochs: float | None = None  # or after this many epochs; neither: 1 epoch; both: first hit
    micro_batch: int | None = None  # None: config.train_micro_batch_size_per_gpu, else 8
    seq_len: int = 128  # tokens per example (truncated / padded)
    lr: float | None = None  # overrides optimizer lr (and the scheduler's warmup_max_lr)
    seed: int = 42
    run_dir: Path | None = None  # None: runs_root/<timestamp>-<model>-<task>
    runs_root: Path = Path("runs")
    resume: str | None = None  # "auto", a run directory or a checkpoint file
    eval_every: int | None = None  # also evaluate every N steps (always at the end)
    max_eval_samples: int | None = None  # evaluate on the first N validation rows only
    hw_json: Path | None = None  # copied into the run dir (default: ./hw.json if present)
    checkpoint_every: int | None = None  # also checkpoint every N steps (always at eval/end)
    overwrite: bool = False  # run_dir holds a run: remove its files and start clean
    device: str | None = None  # cpu | cuda | sim (a simulated GPU); None: cuda if present
    nproc: int = 1  # data-parallel ranks (torchrun's WORLD_SIZE): recorded for the resume
    config_given: bool = True  # False: no --config/--set (a resume then takes the run's)
    gradient_checkpointing: bool = False  # recompute activations in backward (transformers')
    sim_profile: str | None = None  # sim: scale the link to a named GPU box
    device_mem: int | None = None  # sim: the simulated device's memory budget (bytes)
    # The user's own table (zenflow.train.data.tables) instead of a GLUE task's files: train rows,
    # eval rows (None: a seeded split of data_file), the text column(s) and the label column.
    data_file: str | None = None
    eval_file: str | None = None
    text_fields: tuple[str, ...] | None = None
    label_field: str | None = None
    tsv_quoting: str | None = None  # .tsv tables: "csv" (quotes honoured, the default) or "none"
    # What is trained (zenflow.train.objective): a classification head on the table / GLUE task, or
    # a causal LM on the data_file's records (text, prompt/completion or chat messages),
    # optionally packed; the records' field names (None: prompt, completion, messages; the
    # text field is text_fields[0], default "text").
    objective: str = "classification"  # classification | causal-lm
    pack: bool = False
    prompt_field: str | None = None
    completion_field: str | None = None
    messages_field: str | None = None
    # zfctl.return_image as the preflight fitted it ("never": the early phase's images do
    # not fit the host), over the config's; None: the config's. A resumed run keeps it.
    return_image: str | None = None
    # zfctl.step_store as the preflight fitted it from "auto" ("off": a run without clipping
    # whose step store does not fit the host; "q8": one with clipping), over the config's;
    # None: the config's. Kept on resume.
    step_store: str | None = None
    # The preflight's whole-run host peak of this run's engine on a separate device (bytes,
    # ``zfctl estimate``'s ``host_peak_bytes``): summary.json sets the measured peak beside
    # it. None: not checked (--force, a CPU device, a model the estimate cannot read). Kept
    # on resume.
    host_peak_estimate: int | None = None


# Fields that define the trajectory: a resumed run takes them from the saved run.
_TRAJECTORY_FIELDS = ("model", "task", "init", "data_dir", "engine_mode", "micro_batch",
                      "seq_len", "lr", "seed", "data_file", "eval_file", "text_fields",
                      "label_field", "tsv_quoting", "objective", "pack", "prompt_field",
                      "completion_field", "messages_field")  # fmt: skip
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSpec)}


def effective_config(spec: RunSpec):
    """The spec's config with --lr / --micro-batch (and the preflight's return_image and
    step_store) applied (validated again)."""
    from zenflow.config import load_config

    config = spec.config
    overrides: dict[str, Any] = {}
    if spec.lr is not None:
        overrides["optimizer.params.lr"] = spec.lr
        sched = (config.raw.get("scheduler") or {}).get("params") or {}
        if "warmup_max_lr" in sched:  # the scheduler's peak is the lr the user means
            overrides["scheduler.params.warmup_max_lr"] = spec.lr
    for key in ("return_image", "step_store"):  # the preflight's fitted settings
        fitted = getattr(spec, key)
        if fitted is not None and fitted != getattr(config.engine, key):
            overrides[f"zfctl.{key}"] = fitted
    if spec.micro_batch is not None and spec.micro_batch != config.train_micro_batch_size_per_gpu:
        overrides["train_micro_batch_size_per_gpu"] = spec.micro_batch
        overrides["gradient_accumulation_steps"] = config.gradient_accumulation_steps
        overrides["train_batch_size"] = None  # re-derived (null = not given)
    if not overrides:
        return config
    new = load_config(config.raw, overrides=overrides)
    return dataclasses.replace(new, source=config.source)


def check_paths(spec: RunSpec) -> None:
    """Refuse run locations that cannot work, before any model or data is loaded."""
    if spec.overwrite and spec.resume:
        raise UserInputError(
            "--overwrite and --resume contradict each other: --resume continues the run in "
            "its directory, --overwrite deletes it. Pass one of them."
        )
    if spec.overwrite and spec.run_dir is None:
        raise UserInputError(
            "--overwrite needs --run-dir: it names the run directory to start clean (new "
            "runs under --runs-root always get a new directory)."
        )
    for flag, path in (("--runs-root", spec.runs_root), ("--run-dir", spec.run_dir)):
        if path is None:
            continue
        p = Path(path)
        for part in (p, *p.parents):
            if part.exists() and not part.is_dir():
                what = "is a file" if part == p else f"is inside {part}, which is a file"
                raise UserInputError(
                    f"{flag} {p} {what}, not a directory; pass a directory (it is created "
                    "when missing)."
                )


def read_hw_json(spec: RunSpec) -> dict | None:
    """The hardware probe to keep with the run: ``spec.hw_json`` (must exist and be a JSON
    object), else ./hw.json when present (optional, but refused when broken)."""
    explicit = spec.hw_json is not None
    path = Path(spec.hw_json) if explicit else Path(runs.HW_FILE)
    if not path.exists():
        if explicit:
            raise UserInputError(
                f"--hw-json {path}: no such file. Write it with `zfctl tune-hw --output "
                f"{path}`, or omit --hw-json."
            )
        return None
    flag = f"--hw-json {path}" if explicit else f"{path} (read by default from the current folder)"
    try:
        data = runs.read_json(path)
    except UserInputError as exc:
        raise UserInputError(
            f"{flag} cannot be used: {exc} Write it again with `zfctl tune-hw`, or "
            + ("pass another file." if explicit else "remove it, or pass --hw-json FILE.")
        ) from None
    except OSError as exc:
        raise UserInputError(f"{flag} cannot be read: {exc.strerror or exc}.") from None
    if not isinstance(data, dict):
        raise UserInputError(
            f"{flag} holds a JSON {type(data).__name__}, not the object `zfctl tune-hw` writes."
        )
    return data


def resume_or_new(spec: RunSpec) -> tuple[RunSpec, str | None]:
    """``--resume auto`` is safe to pass always: with no earlier run of the model on the
    task (holding a checkpoint) under ``runs_root`` it means a new run. Returns the spec to
    run (``resume`` None then) and the note that says so, else ``spec`` unchanged and None."""
    if spec.resume != "auto":
        return spec, None
    if run_match.find_resumable(spec) is not None:
        return spec, None
    note = (
        f"no earlier run of {spec.model} on {run_match.describe(spec)} under "
        f"{spec.runs_root} to resume; starting a new run"
    )
    return dataclasses.replace(spec, resume=None), note


def resolve_resume(spec: RunSpec) -> tuple[Path, list[Path], bool]:
    """(run_dir, checkpoints to try newest first, whether one file was named) for
    ``spec.resume``; UserInputError when there is none."""
    if spec.resume == "auto":
        run_dir = run_match.find_resumable(spec)
        if run_dir is None:  # resume_or_new made this a new run
            raise UserInputError(
                f"--resume auto: no run of {spec.model!r} on {run_match.describe(spec)} with a "
                f"checkpoint under {spec.runs_root}. Start a new run (omit --resume) or pass "
                "--resume RUN_DIR."
            )
        return run_dir, runs.checkpoints(run_dir)[::-1], False
    p = Path(spec.resume).expanduser()
    if p.is_file():
        run_dir = p.parent.parent
        if p.parent.name != runs.CHECKPOINT_DIR or not runs.holds_run(run_dir):
            raise UserInputError(
                f"--resume {p}: the checkpoint is not inside a zfctl run directory "
                f"(runs/<run>/{runs.CHECKPOINT_DIR}/step-NNNNNNN.pt beside the run's "
                f"{runs.CONFIG_FILE}); a checkpoint alone does not say how its run was set "
                "up. Pass the run directory (--resume runs/<run>), or put the file back in "
                f"its run's {runs.CHECKPOINT_DIR}/ folder."
            )
        return run_dir, [p], True
    if p.is_dir():
        ckpts = runs.checkpoints(p)[::-1]
        if not ckpts:
            raise UserInputError(
                f"--resume {p}: the run directory has no checkpoint in {p / 'checkpoints'} "
                f"(it stopped before its first one), so there is nothing to resume. "
                f"{restart_hint(p)}"
            )
        return p, ckpts, False
    raise UserInputError(
        f"--resume {spec.resume}: no such run directory or checkpoint file. Pass a directory "
        "under runs/ or --resume auto."
    )


def merge_resumed_spec(spec: RunSpec, run_dir: Path, notes: list[str] | None = None) -> RunSpec:
    """Take the trajectory fields from the saved run; refuse explicit conflicting values.
    What was accepted though it differs (a moved data file, a diverged run's new --lr) is
    said in ``notes``."""
    saved_cfg = runs.read_json(run_dir / runs.CONFIG_FILE) or {}
    saved = saved_cfg.get("run") or {}
    if not saved:
        raise UserInputError(f"{run_dir / runs.CONFIG_FILE} has no run spec; cannot resume it.")
    notes = [] if notes is None else notes
    accepted = _accepted_changes(spec, run_dir, saved_cfg, notes)
    changes: dict[str, Any] = {"run_dir": run_dir}
    conflicts = []
    for name in _TRAJECTORY_FIELDS:
        # a run saved before a field existed ran with its default
        mine, theirs = getattr(spec, name), saved.get(name, _DEFAULTS[name])
        if isinstance(theirs, list):  # a tuple, as JSON saved it
            theirs = tuple(theirs)
        if name in accepted:
            changes[name] = mine
            continue
        if name == "model" and runs.same_model(theirs, mine):
            continue
        if name == "data_dir" and mine is not None and run_match.same_path(theirs, mine):
            continue
        if name == "task" and _derived_name(spec, saved, accepted):
            mine = theirs  # --data without --task: the run keeps its own name
        if mine != theirs and mine is not None and mine != _DEFAULTS[name]:
            conflicts.append(f"{name}: {_saved_setting(saved, name)}, given {mine!r}")
        changes[name] = theirs
    if (
        spec.config_given
        and saved.get("config_input") is not None
        and dict(spec.config.raw) != saved["config_input"]
    ):
        conflicts.append("config: the given DeepSpeed config differs from the run's")
    if conflicts:
        raise UserInputError(
            f"Cannot resume {run_dir} with different settings ({'; '.join(conflicts)}). A "
            "resumed run continues exactly; omit those options or pass the run's values "
            "(its config.json 'run' section), or start a new run."
        )
    for role in run_match.DATA_ROLES:  # taken from the run (not given): still there?
        missing = run_match.missing_data_file(run_dir, role, changes[role])
        if getattr(spec, role) is None and missing is not None:
            raise missing
    from zenflow.config import load_config

    if saved.get("config_input") is not None:
        changes["config"] = dataclasses.replace(
            load_config(saved["config_input"]), source=saved.get("config_source", "<dict>")
        )
    for name in ("max_steps", "epochs", "eval_every", "max_eval_samples", "checkpoint_every",
                 "sim_profile", "device_mem", "return_image", "step_store",
                 "host_peak_estimate"):  # fmt: skip
        if getattr(spec, name) is None and saved.get(name) is not None:
            changes[name] = saved[name]
    if not spec.gradient_checkpointing and saved.get("gradient_checkpointing"):
        changes["gradient_checkpointing"] = True
    if spec.max_steps is not None or spec.epochs is not None:  # a new extent replaces the old
        changes["max_steps"], changes["epochs"] = spec.max_steps, spec.epochs
    return dataclasses.replace(spec, **changes)


def _accepted_changes(spec: RunSpec, run_dir: Path, saved_cfg: dict, notes: list[str]) -> set:
    """The trajectory fields ``spec`` may change though they differ from the run's: a data
    file that moved (the sha256 the run saved), and --lr when the run diverged (its last
    good checkpoint goes on at a lower lr). Each is said in ``notes``."""
    accepted = set()
    for role, (old, new) in run_match.moved_data_files(spec, saved_cfg).items():
        flag = "--data" if role == "data_file" else "--eval-data"
        notes.append(f"{flag} {old} moved to {new} (the same sha256 the run saved); read there")
        accepted.add(role)
    theirs = (saved_cfg.get("run") or {}).get("lr")
    if spec.lr is not None and spec.lr != theirs:
        try:
            summary = runs.read_json(run_dir / runs.SUMMARY_FILE)
        except (UserInputError, OSError):
            summary = None
        if isinstance(summary, dict) and summary.get("status") == "diverged":
            was = f"the run's {theirs:g}" if theirs is not None else "the config's lr"
            notes.append(
                f"--lr {spec.lr:g} replaces {was}: the run diverged at step "
                f"{(summary.get('divergence') or {}).get('step')}, and goes on from its last "
                "good checkpoint at the new lr"
            )
            accepted.add("lr")
    return accepted


def _derived_name(spec: RunSpec, saved: dict, accepted: set) -> bool:
    """Whether ``spec.task`` is only the name a --data run gets from its file (no --task
    given) and the file is the run's (the same path, or moved): not a change of task."""
    data, theirs = spec.data_file, saved.get("data_file")
    if data is None or theirs is None:
        return False
    same = "data_file" in accepted or run_match.same_path(data, theirs)
    return same and spec.task == run_match.data_run_name(data)


def _saved_setting(saved: dict, name: str) -> str:
    """What the saved run had for ``name``, in words (never "run has None")."""
    if name not in saved:
        return f"the run's {runs.CONFIG_FILE} does not record it"
    if saved[name] is None:
        return "the run did not set it (it took the config's value)"
    return f"run has {saved[name]!r}"


def restart_hint(run_dir: Path) -> str:
    """What to do with a run that stopped before its first checkpoint."""
    return (
        f"Start it again in that folder with --run-dir {run_dir} --overwrite (it removes only "
        "the files zfctl wrote there), or start a new run in another folder."
    )


def resume_command(spec: RunSpec, run_dir: Path) -> str:
    """The ``zfctl finetune`` command line that continues ``run_dir``."""
    args = ["zfctl", "finetune", spec.model, "--task", spec.task, "--resume", str(run_dir)]
    if spec.init != "pretrained":
        args += ["--init", spec.init]
    if spec.data_dir is not None:
        args += ["--data-dir", str(spec.data_dir)]
    if spec.data_file is not None:
        args += ["--data", str(spec.data_file)]
        if spec.eval_file is not None:
            args += ["--eval-data", str(spec.eval_file)]
        for field in spec.text_fields or ():
            args += ["--text-field", field]
        if spec.label_field is not None:
            args += ["--label-field", spec.label_field]
        if spec.tsv_quoting is not None:
            args += ["--tsv-quoting", spec.tsv_quoting]
        if spec.objective != _DEFAULTS["objective"]:
            args += ["--objective", spec.objective]
        if spec.pack:
            args += ["--pack"]
        for flag, name in (("--prompt-field", "prompt_field"),
                           ("--completion-field", "completion_field"),
                           ("--messages-field", "messages_field")):  # fmt: skip
            if getattr(spec, name) is not None:
                args += [flag, getattr(spec, name)]
    if getattr(spec.config, "source", "<dict>") not in ("<dict>", None, ""):
        args += ["--config", str(spec.config.source)]
    if spec.engine_mode != "zenflow":
        args += ["--engine", spec.engine_mode]
    if spec.device is not None:
        args += ["--device", spec.device]
    if spec.nproc > 1:
        args += ["--nproc", str(spec.nproc)]
    if spec.gradient_checkpointing:
        args += ["--gradient-checkpointing"]
    if spec.sim_profile is not None:
        args += ["--sim-profile", spec.sim_profile]
    for flag, name in (
        ("--max-steps", "max_steps"), ("--epochs", "epochs"), ("--micro-batch", "micro_batch"),
        ("--lr", "lr"), ("--eval-every", "eval_every"),
        ("--max-eval-samples", "max_eval_samples"), ("--checkpoint-every", "checkpoint_every"),
    ):  # fmt: skip
        if getattr(spec, name) is not None:
            args += [flag, str(getattr(spec, name))]
    if spec.seq_len != _DEFAULTS["seq_len"]:
        args += ["--seq-len", str(spec.seq_len)]
    if spec.seed != _DEFAULTS["seed"]:
        args += ["--seed", str(spec.seed)]
    return shlex.join(args)


def config_digest(record: dict) -> str:
    """SHA-256 of a spec record's config input (canonical JSON): what a checkpoint keeps
    of the config to prove, at resume, that config.json still describes its run."""
    text = json.dumps(record.get("config_input"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


DEFAULT_TEXT_FIELDS = ("text",)
DEFAULT_LABEL_FIELD = "label"


def data_digests(spec: RunSpec) -> dict[str, str]:
    """sha256 of each ``--data`` / ``--eval-data`` file, by path (saved with the run: a
    resumed run continues exactly only on the same rows)."""
    return {
        str(path): run_match.data_digest(str(path))
        for path in (spec.data_file, spec.eval_file)
        if path is not None
    }


def data_source(spec: RunSpec):
    """The run's one source of rows (``zenflow.train.data.source.DataSource``): records for
    a causal LM, a ``--data`` table, or a GLUE task. The run (``objective``), the CLI's
    preflight and ``zfctl eval`` read their data through its ``load``."""
    from zenflow.train.data import GlueSource, RecordSource, TableSource, get_task

    if spec.objective == "causal-lm":
        return RecordSource(data_file=spec.data_file, eval_file=spec.eval_file,
                            seq_len=spec.seq_len, fields=record_fields(spec), pack=spec.pack,
                            seed=spec.seed, name=spec.task)  # fmt: skip
    if spec.data_file is not None:
        return TableSource(train_path=spec.data_file, eval_path=spec.eval_file,
                           text_fields=tuple(spec.text_fields or DEFAULT_TEXT_FIELDS),
                           label_field=spec.label_field or DEFAULT_LABEL_FIELD, seed=spec.seed,
                           name=spec.task, tsv_quoting=spec.tsv_quoting or "csv")  # fmt: skip
    return GlueSource(task=get_task(spec.task), data_dir=spec.data_dir)


def load_data(spec: RunSpec, tokenizer=None):
    """``data_source(spec).load(tokenizer)``; a resumed run also checks that its
    ``--data``/``--eval-data`` files are those it was started with (their sha256,
    ``data_digests``). ``tokenizer``: the model's, for records (tokenised as read)."""
    data = data_source(spec).load(tokenizer)
    _check_files_unchanged(spec)
    return data


def _check_files_unchanged(spec: RunSpec) -> None:
    """A resumed run's --data/--eval-data files must be the ones it started with (their
    sha256, saved in config.json 'data_files' by ``data_digests``)."""
    from zenflow.errors import DataError

    if not spec.resume or spec.run_dir is None:
        return
    saved = runs.read_json(Path(spec.run_dir) / runs.CONFIG_FILE) or {}
    changed = run_match.changed_data_files(spec, saved)  # by role: a moved file too
    if changed:
        raise DataError(
            f"{', '.join(changed)} changed since the run in {spec.run_dir} started (its "
            f"{runs.CONFIG_FILE} 'data_files' holds the sha256 it trained on); a resumed "
            "run continues exactly only on the same rows. Restore the file, or start a "
            "new run."
        )


def record_fields(spec: RunSpec):
    """The ``data.RecordFields`` of a causal-LM spec (defaults where a field is None)."""
    from zenflow.train.data import RecordFields

    given = {
        "text": (spec.text_fields or (None,))[0],
        "prompt": spec.prompt_field,
        "completion": spec.completion_field,
        "messages": spec.messages_field,
    }
    return RecordFields(**{k: v for k, v in given.items() if v is not None})


def spec_record(spec: RunSpec) -> dict:
    """The spec as JSON (config by its input dict and source)."""
    out = {}
    for f in dataclasses.fields(RunSpec):
        if f.name in ("config", "resume", "overwrite", "config_given"):
            continue
        v = getattr(spec, f.name)
        out[f.name] = str(v) if isinstance(v, Path) else v
    out["config_input"] = dict(spec.config.raw)
    out["config_source"] = spec.config.source
    return run_match.record_paths(out)  # absolute: the run resumes from any folder
