"""The fine-tuning run: data, model, engine, run directory, metrics, eval, checkpoints, resume.

``run_finetune(spec, on_event)`` does the whole run and reports through plain event objects
(``RunStarted``, ``StepEvent``, ``EvalEvent``, ``CheckpointSaved``, ``RunFinished``,
``RunInterrupted``); the CLI decides how to show them. Nothing here prints.

Exact resume: a checkpoint is taken at an optimizer-step boundary and holds the model, the
engine (optimizer/ZenFlow state), the data position (epoch, index into that epoch's
order), the RNG states (torch, python; cuda when used) and the number of metrics lines
written. The epoch order is a function of (seed, epoch) only, so a resumed run sees the
same batches, the same dropout masks and the same optimizer state as an uninterrupted one.

Ctrl-C: the first SIGINT is deferred to the next step boundary (the step finishes, the
in-flight host work is drained by the checkpoint), a checkpoint is saved, ``RunInterrupted``
is emitted and raised; a second SIGINT interrupts at once. A ``KeyboardInterrupt`` raised
by ``on_event`` (or anywhere in the loop) is handled the same way.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zenflow import runs
from zenflow.data import batches as data_batches
from zenflow.data import compute_metrics, encode, eval_batches, get_task, load_task
from zenflow.data import steps_per_epoch as data_steps_per_epoch
from zenflow.errors import UserInputError
from zenflow.stats import TIMING_FIELDS, StepStats

ENGINE_MODES = ("zenflow", "offload", "device")
KEEP_CHECKPOINTS = 2  # the latest and one previous
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class RunSpec:
    """What to fine-tune and how. ``None`` means "from the config / the default"."""

    model: str  # hub id or local directory
    task: str  # GLUE task name (see zenflow.data.GLUE_TASKS)
    config: Any  # zenflow.config.Config
    init: str = "pretrained"  # pretrained | random
    data_dir: str | None = None  # GLUE root holding <task>/train.tsv; None: the hub
    engine_mode: str = "zenflow"  # zenflow | offload | device
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


# Fields that define the trajectory: a resumed run takes them from the saved run.
_TRAJECTORY_FIELDS = ("model", "task", "init", "data_dir", "engine_mode", "micro_batch",
                      "seq_len", "lr", "seed")  # fmt: skip
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSpec)}


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class RunStarted:
    header: dict  # everything worth showing before the first step (see _header)


@dataclass(frozen=True)
class StepEvent:
    stats: StepStats
    samples_per_s: float
    tokens_per_s: float  # input positions (micro_batch x seq_len x accumulation) per second
    progress: float  # 0..1 of total_steps
    eta_s: float | None
    epoch: float  # fractional epoch at the end of this step
    total_steps: int


@dataclass(frozen=True)
class EvalEvent:
    step: int
    metrics: dict  # task metric(s), "eval_loss", "eval_samples"


@dataclass(frozen=True)
class CheckpointSaved:
    step: int
    path: Path


@dataclass(frozen=True)
class RunFinished:
    summary: dict


class RunInterrupted(Exception):  # noqa: N818 - also the event's name
    """The run was interrupted (Ctrl-C). Emitted as an event, then raised.

    ``checkpoint`` is the saved checkpoint to resume from (None if none could be saved) and
    ``resume_command`` the command line that continues the run.
    """

    def __init__(self, step: int, checkpoint: Path | None, resume_command: str | None):
        self.step = step
        self.checkpoint = checkpoint
        self.resume_command = resume_command
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        super().__init__(f"Interrupted after step {step}; {where}. Resume: {resume_command}")


# ------------------------------------------------------------------------ helpers


def _noop(_event) -> None:
    pass


def _effective_config(spec: RunSpec):
    """The spec's config with --lr / --micro-batch applied (validated again)."""
    from zenflow.config import load_config

    config = spec.config
    overrides: dict[str, Any] = {}
    if spec.lr is not None:
        overrides["optimizer.params.lr"] = spec.lr
        sched = (config.raw.get("scheduler") or {}).get("params") or {}
        if "warmup_max_lr" in sched:  # the scheduler's peak is the lr the user means
            overrides["scheduler.params.warmup_max_lr"] = spec.lr
    if spec.micro_batch is not None and spec.micro_batch != config.train_micro_batch_size_per_gpu:
        overrides["train_micro_batch_size_per_gpu"] = spec.micro_batch
        overrides["gradient_accumulation_steps"] = config.gradient_accumulation_steps
        overrides["train_batch_size"] = None  # re-derived (null = not given)
    if not overrides:
        return config
    new = load_config(config.raw, overrides=overrides)
    return dataclasses.replace(new, source=config.source)


def _resolve_resume(spec: RunSpec) -> tuple[Path, Path]:
    """(run_dir, checkpoint file) for ``spec.resume``; UserInputError when there is none."""
    if spec.resume == "auto":
        run_dir = runs.latest_run(spec.runs_root, spec.model, spec.task, with_checkpoint=True)
        if run_dir is None:
            raise UserInputError(
                f"--resume auto: no run of {spec.model!r} on {spec.task} with a checkpoint "
                f"under {spec.runs_root}. Start a new run (omit --resume) or pass --resume "
                "RUN_DIR."
            )
        return run_dir, runs.latest_checkpoint(run_dir)
    p = Path(spec.resume).expanduser()
    if p.is_file():
        return p.parent.parent, p
    if p.is_dir():
        ckpt = runs.latest_checkpoint(p)
        if ckpt is None:
            raise UserInputError(
                f"--resume {p}: the run directory has no checkpoint in {p / 'checkpoints'}. "
                "Start a new run, or pass --resume auto to pick the latest resumable run."
            )
        return p, ckpt
    raise UserInputError(
        f"--resume {spec.resume}: no such run directory or checkpoint file. Pass a directory "
        "under runs/ or --resume auto."
    )


def _merge_resumed_spec(spec: RunSpec, run_dir: Path) -> RunSpec:
    """Take the trajectory fields from the saved run; refuse explicit conflicting values."""
    saved_cfg = runs.read_json(run_dir / runs.CONFIG_FILE) or {}
    saved = saved_cfg.get("run") or {}
    if not saved:
        raise UserInputError(f"{run_dir / runs.CONFIG_FILE} has no run spec; cannot resume it.")
    changes: dict[str, Any] = {"run_dir": run_dir}
    conflicts = []
    for name in _TRAJECTORY_FIELDS:
        mine, theirs = getattr(spec, name), saved.get(name)
        if name == "model" and runs._same_model(theirs, mine):
            continue
        if mine != theirs and mine != _DEFAULTS[name]:
            conflicts.append(f"{name}: run has {theirs!r}, given {mine!r}")
        changes[name] = theirs
    if saved.get("config_input") is not None and dict(spec.config.raw) != saved["config_input"]:
        conflicts.append("config: the given DeepSpeed config differs from the run's")
    if conflicts:
        raise UserInputError(
            f"Cannot resume {run_dir} with different settings ({'; '.join(conflicts)}). A "
            "resumed run continues exactly; omit those options or pass the run's values "
            "(its config.json 'run' section), or start a new run."
        )
    from zenflow.config import load_config

    if saved.get("config_input") is not None:
        changes["config"] = dataclasses.replace(
            load_config(saved["config_input"]), source=saved.get("config_source", "<dict>")
        )
    for name in ("max_steps", "epochs", "eval_every", "max_eval_samples", "checkpoint_every"):
        if getattr(spec, name) is None and saved.get(name) is not None:
            changes[name] = saved[name]
    if spec.max_steps is not None or spec.epochs is not None:  # a new extent replaces the old
        changes["max_steps"], changes["epochs"] = spec.max_steps, spec.epochs
    return dataclasses.replace(spec, **changes)


def resume_command(spec: RunSpec, run_dir: Path) -> str:
    """The ``zfctl finetune`` command line that continues ``run_dir``."""
    args = ["zfctl", "finetune", spec.model, "--task", spec.task, "--resume", str(run_dir)]
    if spec.init != "pretrained":
        args += ["--init", spec.init]
    if spec.data_dir is not None:
        args += ["--data-dir", str(spec.data_dir)]
    if getattr(spec.config, "source", "<dict>") not in ("<dict>", None, ""):
        args += ["--config", str(spec.config.source)]
    if spec.engine_mode != "zenflow":
        args += ["--engine", spec.engine_mode]
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


def _spec_record(spec: RunSpec) -> dict:
    """The spec as JSON (config by its input dict and source)."""
    out = {}
    for f in dataclasses.fields(RunSpec):
        if f.name in ("config", "resume"):
            continue
        v = getattr(spec, f.name)
        out[f.name] = str(v) if isinstance(v, Path) else v
    out["config_input"] = dict(spec.config.raw)
    out["config_source"] = spec.config.source
    return out


class _SigintDeferral:
    """First SIGINT sets ``requested`` (handled at the next step boundary); the second one
    raises KeyboardInterrupt at once. Only installable in the main thread."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _rng_state(torch, device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(torch, device, state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _finite_mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


# ---------------------------------------------------------------------------- the run


class _Run:
    """State of one fine-tuning session (one process; a resumed run is a new session)."""

    def __init__(self, spec: RunSpec, on_event: Callable[[object], None]):
        self.t_session = time.perf_counter()
        self.on_event = on_event
        self.resumed_from: Path | None = None
        if spec.engine_mode not in ENGINE_MODES:
            raise UserInputError(
                f"engine mode {spec.engine_mode!r} is not allowed; use one of "
                f"{', '.join(ENGINE_MODES)} (--engine)."
            )
        if spec.resume:
            run_dir, self.resumed_from = _resolve_resume(spec)
            spec = _merge_resumed_spec(spec, run_dir)
        for name in ("max_steps", "micro_batch", "eval_every", "max_eval_samples", "seq_len"):
            v = getattr(spec, name)
            if v is not None and v < 1:
                raise UserInputError(f"{name} must be at least 1, got {v}.")
        if spec.epochs is not None and not spec.epochs > 0:
            raise UserInputError(f"epochs must be positive, got {spec.epochs}.")
        self.spec = spec

    # -- setup
    def setup(self) -> None:
        import torch

        from zenflow.models import count_params, resolve_model

        spec = self.spec
        self.torch = torch
        self.config = _effective_config(spec)
        self.micro_batch = spec.micro_batch or self.config.train_micro_batch_size_per_gpu or 8
        # Record the effective value: a resumed run compares against it.
        self.spec = spec = dataclasses.replace(spec, micro_batch=self.micro_batch)
        self.gas = int(self.config.gradient_accumulation_steps)
        self.task = get_task(spec.task)
        self.task_data = load_task(self.task, spec.data_dir)
        resolved = resolve_model(
            spec.model, task_num_labels=self.task.num_labels, init=spec.init, seed=spec.seed
        )
        self.sources = {**resolved.sources, "data": self.task_data.source}
        self.tokenizer = resolved.tokenizer
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = resolved.model.to(self.device)
        self.params = count_params(self.model)
        self.encoded = encode(self.task_data, resolved.tokenizer, spec.seq_len)
        self.spe = data_steps_per_epoch(len(self.task_data.train), self.micro_batch, self.gas)
        self.epoch_samples = self.spe * self.gas * self.micro_batch
        if spec.max_steps is not None and spec.epochs is not None:
            self.total_steps = min(spec.max_steps, math.ceil(spec.epochs * self.spe))
        elif spec.max_steps is not None:
            self.total_steps = spec.max_steps
        else:
            self.total_steps = max(1, math.ceil((spec.epochs or 1.0) * self.spe))
        self.eval_batch = 2 * self.micro_batch

    # -- checkpoint
    def checkpoint_state(self, step, epoch, index, rng, wall_s, *, snapshot=False) -> dict:
        """Everything a resumed run needs; ``snapshot`` clones the model weights so the
        state stays valid while the model keeps changing (the final flush)."""
        model_state = self.model.state_dict()
        if snapshot:
            model_state = {k: v.detach().clone() for k, v in model_state.items()}
        return {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "model": model_state,
            "engine": self.engine.state_dict(),
            "position": {"epoch": epoch, "index": index},
            "rng": rng,
            "metrics_lines": self.metrics_lines,
            "wall_s": wall_s,
            "run": _spec_record(self.spec),
        }

    def save_checkpoint(self, step, epoch, index, rng, wall_s, *, state=None) -> Path:
        """Write a checkpoint atomically (temp file + rename); keep the newest few."""
        if state is None:
            state = self.checkpoint_state(step, epoch, index, rng, wall_s)
        state["metrics_lines"] = self.metrics_lines
        d = self.run_dir / runs.CHECKPOINT_DIR
        d.mkdir(exist_ok=True)
        path = d / f"step-{step:07d}.pt"
        tmp = d / f".{path.name}.tmp"
        self.torch.save(state, tmp)
        os.replace(tmp, path)
        for old in runs.checkpoints(self.run_dir)[:-KEEP_CHECKPOINTS]:
            old.unlink(missing_ok=True)
        self.last_checkpoint = path
        self.on_event(CheckpointSaved(step, path))
        return path

    def load_checkpoint(self, path: Path) -> dict:
        try:
            state = self.torch.load(path, map_location=self.device, weights_only=False)
        except Exception as exc:
            raise UserInputError(f"Cannot read checkpoint {path}: {exc}.") from exc
        if state.get("format") != CHECKPOINT_FORMAT:
            raise UserInputError(f"{path} is not a zfctl checkpoint of format {CHECKPOINT_FORMAT}.")
        self.model.load_state_dict(state["model"])
        self.engine.load_state_dict(state["engine"])
        return state

    def save_final_model(self) -> None:
        """Save the fine-tuned model (and tokenizer) in Hugging Face format under model/."""
        out = self.run_dir / runs.MODEL_DIR
        self.model.save_pretrained(out)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)

    # -- eval
    def evaluate(self, step: int) -> dict:
        torch = self.torch
        model = self.model
        was_training = model.training
        model.eval()
        preds, labels, loss_sum, n = [], [], 0.0, 0
        try:
            with torch.no_grad():
                for batch in eval_batches(
                    self.encoded.dev, self.eval_batch, self.spec.max_eval_samples
                ):
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    with self.engine.autocast():
                        out = model(**batch)
                    b = batch["labels"].shape[0]
                    loss_sum += float(out.loss.float()) * b
                    n += b
                    logits = out.logits.float()
                    if self.task.is_regression:
                        preds += logits[:, 0].tolist()
                    else:
                        preds += logits.argmax(-1).tolist()
                    labels += batch["labels"].tolist()
        finally:
            model.train(was_training)
        metrics = compute_metrics(self.task, preds, labels)
        metrics["eval_loss"] = loss_sum / n
        metrics["eval_samples"] = n
        self.write_metrics({"type": "eval", "step": step, **metrics})
        self.last_eval = {"step": step, **metrics}
        self.on_event(EvalEvent(step, metrics))
        return metrics

    def write_metrics(self, record: dict) -> None:
        import json

        self.metrics_file.write(json.dumps(record, default=str) + "\n")
        self.metrics_file.flush()
        self.metrics_lines += 1

    # -- header / summary
    def header(self, start_step: int) -> dict:
        cfg = self.config
        zf = dataclasses.asdict(cfg.zenflow) if cfg.zenflow is not None else None
        if zf is not None:
            zf.update({k: v for k, v in self.engine.resolved.items() if k in zf})
        return {
            "run_dir": str(self.run_dir),
            "model": self.spec.model,
            "task": self.task.name,
            "init": self.spec.init,
            "engine_mode": self.spec.engine_mode,
            "sources": self.sources,
            "params": self.params,
            "model_bytes": self.engine.model_bytes,
            "device": str(self.device),
            "train_examples": len(self.task_data.train),
            "dev_examples": len(self.task_data.dev),
            "eval_examples": min(
                len(self.task_data.dev), self.spec.max_eval_samples or len(self.task_data.dev)
            ),
            "micro_batch": self.micro_batch,
            "gradient_accumulation_steps": self.gas,
            "seq_len": self.spec.seq_len,
            "steps_per_epoch": self.spe,
            "total_steps": self.total_steps,
            "start_step": start_step,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "lr": cfg.optimizer.lr,
            "scheduler": cfg.scheduler.type,
            "bf16": cfg.bf16,
            "gradient_clipping": cfg.gradient_clipping,
            "zenflow": zf,
            "engine_resolved": dict(self.engine.resolved),
            "config_source": cfg.source,
            "config_ignored": list(cfg.ignored),
            "metrics": list(self.task.metrics),
            "seed": self.spec.seed,
        }

    def summary(self, wall_s: float, status: str) -> dict:
        lines = runs.read_metrics(self.run_dir / runs.METRICS_FILE)
        steps = [m for m in lines if m.get("type") == "step"]
        evals = [m for m in lines if m.get("type") == "eval"]
        n = len(steps)
        model_bytes = self.engine.model_bytes
        d2h = sum(int(m.get("d2h_bytes", 0)) for m in steps)
        h2d = sum(int(m.get("h2d_bytes", 0)) for m in steps)
        samples = n * self.micro_batch * self.gas
        tokens = samples * self.spec.seq_len
        train_s = sum(float(m.get("wall_ms", 0.0)) for m in steps) / 1e3
        losses = [m.get("loss") for m in steps]
        timing = {f: _finite_mean(m.get(f) for m in steps) for f in TIMING_FIELDS}
        windows = [m["window_len"] for m in steps if m.get("window_len")]
        last_eval = {k: v for k, v in evals[-1].items() if k != "type"} if evals else None
        cfg = self.config
        return {
            "status": status,
            "run_dir": str(self.run_dir),
            "model": self.spec.model,
            "task": self.task.name,
            "engine_mode": self.spec.engine_mode,
            "steps": n,
            "total_steps": self.total_steps,
            "epochs": n / self.spe,
            "final_loss": losses[-1] if losses else None,
            "final_loss_mean_last_10": _finite_mean(losses[-10:]),
            "eval": last_eval,
            "validation": {k: last_eval[k] for k in self.task.metrics} if last_eval else None,
            "validation_accuracy": (last_eval or {}).get("accuracy"),
            "non_finite_steps": sum(
                1
                for m in steps
                if m.get("skipped") or m.get("loss") is None or not math.isfinite(m["loss"])
            ),
            "timing_ms_mean": timing,
            "stall_fraction": (
                timing["stall_ms"] / timing["wall_ms"]
                if timing["stall_ms"] is not None and timing["wall_ms"]
                else None
            ),
            "d2h_bytes_total": d2h,
            "h2d_bytes_total": h2d,
            "bytes_per_step": (d2h + h2d) / n if n else None,
            "bytes_per_step_x_model": (d2h + h2d) / n / model_bytes if n else None,
            "d2h_per_step_x_model": d2h / n / model_bytes if n else None,
            "h2d_per_step_x_model": h2d / n / model_bytes if n else None,
            "host_updates": sum(1 for m in steps if m.get("host_update")),
            "mean_window_len": sum(windows) / len(windows) if windows else None,
            "selection_changes": sum(int(m.get("selection_changed", 0)) for m in steps),
            "samples": samples,
            "tokens": tokens,
            "train_s": train_s,
            "samples_per_s": samples / train_s if train_s > 0 else None,
            "tokens_per_s": tokens / train_s if train_s > 0 else None,
            "wall_s": wall_s,
            "model_bytes": model_bytes,
            "params": self.params,
            "sources": self.sources,
            "config": {
                "source": cfg.source,
                "lr": cfg.optimizer.lr,
                "optimizer": cfg.optimizer.type,
                "weight_decay": cfg.optimizer.weight_decay,
                "scheduler": cfg.scheduler.type,
                "micro_batch": self.micro_batch,
                "gradient_accumulation_steps": self.gas,
                "seq_len": self.spec.seq_len,
                "gradient_clipping": cfg.gradient_clipping,
                "bf16": cfg.bf16,
                "zenflow": self.header(0)["zenflow"],
                "engine_resolved": dict(self.engine.resolved),
            },
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        }

    # -- the loop
    def run(self) -> dict:
        torch = self.torch
        from zenflow.engine import ZenFlowEngine

        spec = self.spec
        self.engine = ZenFlowEngine(
            self.model, self.config, mode=spec.engine_mode, steps_per_epoch=self.spe
        )
        self.last_checkpoint: Path | None = None
        self.last_eval: dict | None = None
        try:
            return self._run_with_engine(torch)
        finally:
            self.engine.close()

    def _prepare_run_dir(self) -> tuple[int, int, int, float]:
        """Create or reopen the run dir; returns (start step, epoch, index, prior wall s)."""
        spec, torch = self.spec, self.torch
        if self.resumed_from is not None:
            self.run_dir = Path(spec.run_dir)
            state = self.load_checkpoint(self.resumed_from)
            # Lines written after the checkpoint belong to steps that run again.
            mpath = self.run_dir / runs.METRICS_FILE
            lines = mpath.read_text(encoding="utf-8").splitlines(True) if mpath.exists() else []
            keep = lines[: state["metrics_lines"]]
            mpath.write_text("".join(keep), encoding="utf-8")
            self.metrics_lines = len(keep)
            _set_rng_state(torch, self.device, state["rng"])
            pos = state["position"]
            self.last_checkpoint = self.resumed_from
            start = (state["step"], pos["epoch"], pos["index"], float(state.get("wall_s", 0.0)))
        else:
            if spec.run_dir is not None:
                self.run_dir = Path(spec.run_dir)
                self.run_dir.mkdir(parents=True, exist_ok=True)
            else:
                self.run_dir = runs.create_run_dir(spec.runs_root, spec.model, self.task.name)
            (self.run_dir / runs.METRICS_FILE).write_text("", encoding="utf-8")
            self.metrics_lines = 0
            torch.manual_seed(spec.seed)
            random.seed(spec.seed)
            start = (0, 0, 0, 0.0)
        cfg_json = self.config.to_json_dict(self.engine.resolved)
        cfg_json["run"] = _spec_record(spec)
        cfg_json["sources"] = self.sources
        cfg_json["engine_resolved"] = dict(self.engine.resolved)
        cfg_json["config_ignored"] = list(self.config.ignored)
        runs.write_json_atomic(self.run_dir / runs.CONFIG_FILE, cfg_json)
        hw = spec.hw_json if spec.hw_json is not None else Path("hw.json")
        if Path(hw).is_file():
            shutil.copyfile(hw, self.run_dir / runs.HW_FILE)
        return start

    def _run_with_engine(self, torch) -> dict:
        spec = self.spec
        step, epoch, index, wall_before = self._prepare_run_dir()
        self.metrics_file = open(self.run_dir / runs.METRICS_FILE, "a", encoding="utf-8")
        cuda = self.device.type == "cuda"

        def sync():
            if cuda:
                torch.cuda.synchronize(self.device)

        def session_wall() -> float:
            return wall_before + time.perf_counter() - self.t_session

        # The consistent state at the last step boundary (what a checkpoint holds).
        boundary = {"step": step, "epoch": epoch, "index": index}
        boundary["rng"] = _rng_state(torch, self.device)
        in_engine_step = False
        it = None
        step_times: list[float] = []
        per_step_samples = self.micro_batch * self.gas
        try:
            with self.metrics_file, _SigintDeferral() as sigint:
                self.on_event(RunStarted(self.header(step)))
                while step < self.total_steps:
                    t_step = time.perf_counter()
                    fwd_ms = bwd_ms = 0.0
                    losses = []
                    for _ in range(self.gas):
                        if index >= self.epoch_samples:
                            epoch, index, it = epoch + 1, 0, None
                        if it is None:
                            it = data_batches(
                                self.encoded.train, self.micro_batch, spec.seed, epoch, index
                            )
                        index, batch = next(it)
                        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                        sync()
                        t0 = time.perf_counter()
                        with self.engine.autocast():
                            out = self.model(**batch)
                        loss = out.loss.float()
                        sync()
                        t1 = time.perf_counter()
                        (loss / self.gas).backward()
                        sync()
                        t2 = time.perf_counter()
                        fwd_ms += (t1 - t0) * 1e3
                        bwd_ms += (t2 - t1) * 1e3
                        losses.append(loss.detach())
                    mean_loss = torch.stack(losses).mean()
                    in_engine_step = True
                    stats = self.engine.step(mean_loss)
                    in_engine_step = False
                    self.engine.zero_grad()
                    step += 1
                    wall_ms = (time.perf_counter() - t_step) * 1e3
                    step_times.append(wall_ms / 1e3)
                    stats = dataclasses.replace(
                        stats,
                        step=step,
                        forward_ms=fwd_ms,
                        backward_ms=bwd_ms,
                        loss=float(mean_loss),
                    )
                    sps = per_step_samples / (wall_ms / 1e3)
                    ep = epoch + index / self.epoch_samples
                    self.write_metrics(
                        {
                            "type": "step",
                            **stats.to_dict(),
                            "wall_ms": wall_ms,
                            "samples_per_s": sps,
                            "tokens_per_s": sps * spec.seq_len,
                            "epoch": ep,
                        }
                    )
                    boundary = {"step": step, "epoch": epoch, "index": index}
                    boundary["rng"] = _rng_state(torch, self.device)
                    recent = step_times[-20:]
                    eta = (self.total_steps - step) * sum(recent) / len(recent)
                    self.on_event(
                        StepEvent(
                            stats=stats,
                            samples_per_s=sps,
                            tokens_per_s=sps * spec.seq_len,
                            progress=step / self.total_steps,
                            eta_s=eta,
                            epoch=ep,
                            total_steps=self.total_steps,
                        )
                    )
                    if sigint.requested:
                        raise KeyboardInterrupt
                    evaluated = False
                    if spec.eval_every and step % spec.eval_every == 0 and step < self.total_steps:
                        self.evaluate(step)
                        evaluated = True
                    if evaluated or (spec.checkpoint_every and step % spec.checkpoint_every == 0):
                        self.save_checkpoint(step, epoch, index, boundary["rng"], session_wall())
                    if sigint.requested:
                        raise KeyboardInterrupt
                # The final checkpoint holds the engine exactly as an uninterrupted longer run
                # would have it (host work possibly in flight), so `--resume` with more steps
                # continues bit for bit; it is captured before the flush. The flush applies
                # what is still in a host window, so the final weights (evaluated and saved)
                # include every gradient.
                final_state = self.checkpoint_state(
                    step, epoch, index, boundary["rng"], session_wall(), snapshot=True
                )
                self.engine.flush()
                self.evaluate(step)
                self.save_checkpoint(step, epoch, index, None, 0.0, state=final_state)
                self.save_final_model()
        except KeyboardInterrupt:
            return self._interrupted(boundary, in_engine_step, session_wall())
        summary = self.summary(session_wall(), "finished")
        runs.write_json_atomic(self.run_dir / runs.SUMMARY_FILE, summary)
        self.on_event(RunFinished(summary))
        return summary

    def _interrupted(self, boundary: dict, in_engine_step: bool, wall_s: float):
        """Save a checkpoint at the last step boundary, emit and raise RunInterrupted."""
        ckpt = self.last_checkpoint
        step = boundary["step"]
        if not in_engine_step:
            # Mid-step work (forward/backward) is discarded: gradients dropped, data position
            # and RNG rewound to the boundary, so the resumed run redoes this step exactly.
            self.engine.zero_grad()
            if not self.metrics_file.closed:
                self.metrics_file.flush()
            if ckpt is None or not ckpt.name.endswith(f"{step:07d}.pt"):
                ckpt = self.save_checkpoint(
                    step, boundary["epoch"], boundary["index"], boundary["rng"], wall_s
                )
        # else: the engine was interrupted inside its step; its state may be half-updated, so
        # the last checkpoint on disk (if any) is the one to resume from.
        cmd = resume_command(self.spec, self.run_dir) if ckpt is not None else None
        ckpt_step = int(ckpt.stem.split("-")[1]) if ckpt is not None else 0
        event = RunInterrupted(ckpt_step, ckpt, cmd)
        self.on_event(event)
        raise event


def run_finetune(spec: RunSpec, on_event: Callable[[object], None] = _noop) -> dict:
    """Fine-tune ``spec.model`` on ``spec.task``; returns the summary (also summary.json).

    Emits RunStarted, then StepEvent per optimizer step, EvalEvent, CheckpointSaved, and
    finally RunFinished, or RunInterrupted (then raised) on Ctrl-C.
    """
    run = _Run(spec, on_event)
    run.setup()
    return run.run()
