"""DeepSpeed's monitors for a fine-tuning run: TensorBoard, CSV files and Weights & Biases.

``MonitorSink(config.monitor)`` is a sink of the trainer's events (``RunStarted``,
``StepEvent``, ``EvalEvent``, ``RunFinished``, ``RunInterrupted``). The trainer builds it
before training starts (so a block that cannot be honoured, e.g. W&B without the package,
stops the run before anything is loaded), passes it every event through ``tee`` and closes
it at the end, also on Ctrl-C.

What is logged, with the optimizer step as the x-axis (DeepSpeed's own tags are
``Train/Samples/<name>`` over samples; the middle part names the axis, so these are
``Train/Steps/<name>``):

- every step, ``Train/Steps/``: loss, lr, step_ms, forward_ms, backward_ms, device_opt_ms,
  stall_ms, transfer_ms, samples_per_s, tokens_per_s, bytes_per_step (d2h + h2d), d2h_bytes,
  h2d_bytes, host_update (1 when a host step was applied or submitted), selection_changed,
  epoch; grad_norm and device_bytes when the engine reports them;
- every evaluation, ``Eval/Steps/``: the task metric(s), eval_loss, eval_samples.

Where (``zenflow.config.LogDirConfig``): ``<output_path>/<job_name>/``; an empty
output_path means ``<run_dir>/tensorboard`` or ``<run_dir>/csv_monitor``, an absent job_name
the run directory's name. The CSV layout is DeepSpeed's csv_monitor: one file per tag, the
tag's ``/`` replaced by ``_`` (``Train_Steps_loss.csv``), header ``step,<name>``, one row
per step. A resumed run first drops what was logged after its checkpoint (CSV rows past the
resume step; TensorBoard's ``purge_step``), so the logs match metrics.jsonl exactly.

W&B runs only when the ``wandb`` package is importable, in offline mode unless the
environment sets WANDB_MODE.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zenflow.errors import UserInputError
from zenflow.outputs import open_append, write_file
from zenflow.train.events import (
    EvalEvent,
    RunDiverged,
    RunFinished,
    RunInterrupted,
    RunStarted,
    StepEvent,
)

TRAIN_PREFIX = "Train/Steps/"
EVAL_PREFIX = "Eval/Steps/"
# StepStats fields logged as they are (bools as 0/1).
_STATS_FIELDS = (
    "loss", "lr", "step_ms", "forward_ms", "backward_ms", "device_opt_ms", "stall_ms",
    "transfer_ms", "d2h_bytes", "h2d_bytes", "host_update", "selection_changed",
)  # fmt: skip
# Logged only when the engine reports them (None otherwise).
_OPTIONAL_STATS_FIELDS = ("grad_norm", "device_bytes")


def _number(value: Any) -> float | int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


def step_scalars(event: StepEvent) -> dict[str, float | int]:
    """The scalars of one optimizer step, by tag (``Train/Steps/<name>``)."""
    stats = event.stats
    out: dict[str, float | int] = {}
    for name in _STATS_FIELDS + _OPTIONAL_STATS_FIELDS:
        value = _number(getattr(stats, name, None))
        if value is not None:
            out[TRAIN_PREFIX + name] = value
    out[TRAIN_PREFIX + "bytes_per_step"] = int(stats.d2h_bytes) + int(stats.h2d_bytes)
    out[TRAIN_PREFIX + "samples_per_s"] = event.samples_per_s
    out[TRAIN_PREFIX + "tokens_per_s"] = event.tokens_per_s
    out[TRAIN_PREFIX + "epoch"] = event.epoch
    return out


def eval_scalars(event: EvalEvent) -> dict[str, float | int]:
    """The numeric eval metrics, by tag (``Eval/Steps/<name>``)."""
    out: dict[str, float | int] = {}
    for name, value in event.metrics.items():
        number = _number(value)
        if number is not None:
            out[EVAL_PREFIX + name] = number
    return out


def csv_filename(tag: str) -> str:
    """DeepSpeed's csv_monitor file name of a tag (``Train/Steps/loss`` ->
    ``Train_Steps_loss.csv``)."""
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


def log_dir(block, kind: str, run_dir: Path) -> Path:
    """``<output_path>/<job_name>`` of a tensorboard/csv_monitor block (see module doc)."""
    base = Path(block.output_path).expanduser() if block.output_path else Path(run_dir) / kind
    return base / (block.job_name or Path(run_dir).name)


# ----------------------------------------------------------------------------- writers


class _TensorBoard:
    def __init__(self, directory: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        # purge_step: TensorBoard hides events at or after it from earlier event files, so
        # the steps a resumed run repeats appear once.
        self.writer = SummaryWriter(
            log_dir=str(directory), purge_step=start_step + 1 if start_step > 0 else None
        )

    def write(self, step: int, scalars: dict) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Csv:
    def __init__(self, directory: Path, start_step: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.files: dict[str, Any] = {}
        self.writers: dict[str, Any] = {}
        if start_step > 0:  # a resumed run: rows after the checkpoint are logged again
            for path in directory.glob("*.csv"):
                _truncate_csv(path, start_step)

    def write(self, step: int, scalars: dict) -> None:
        for tag, value in scalars.items():
            writer = self.writers.get(tag)
            if writer is None:
                path = self.directory / csv_filename(tag)
                new = not path.exists() or path.stat().st_size == 0
                fh = self.files[tag] = open_append(path, newline="", encoding="utf-8")
                writer = self.writers[tag] = csv.writer(fh)
                if new:
                    writer.writerow(["step", tag.rsplit("/", 1)[-1]])
            writer.writerow([step, value])

    def flush(self) -> None:
        for fh in self.files.values():
            fh.flush()

    def close(self) -> None:
        for fh in self.files.values():
            fh.close()
        self.files.clear()
        self.writers.clear()


def _truncate_csv(path: Path, last_step: int) -> None:
    """Keep the header and the rows with step <= last_step (rewritten atomically)."""
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    keep = rows[:1] + [r for r in rows[1:] if r and int(r[0]) <= last_step]
    if len(keep) == len(rows):
        return
    write_file(path, lambda fh: csv.writer(fh).writerows(keep), newline="")


class _Wandb:
    def __init__(self, wandb, block, run_dir: Path, header: dict):
        self.wandb = wandb
        self.run = wandb.init(
            project=block.project,
            group=block.group,
            entity=block.team,
            name=Path(run_dir).name,
            dir=str(run_dir),
            config={k: v for k, v in header.items() if isinstance(v, (str, int, float, bool))},
            # Offline unless the user chose a mode: this machine may have no network.
            mode=os.environ.get("WANDB_MODE") or "offline",
        )

    def write(self, step: int, scalars: dict) -> None:
        self.wandb.log(dict(scalars), step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.wandb.finish()


# -------------------------------------------------------------------------------- sink


def _import_wandb():
    import wandb

    return wandb


class MonitorSink:
    """Writes the run's events to the enabled monitors of a ``MonitorConfig``.

    Construction checks that every enabled monitor can run (its package importable) and
    raises UserInputError otherwise; the writers open at ``RunStarted`` (the run directory
    exists then). A sink with nothing enabled does nothing.
    """

    def __init__(self, monitor, source: str = "the DeepSpeed config"):
        self.config = monitor
        self.writers: list[Any] = []
        self.paths: dict[str, Path] = {}
        self._wandb = None
        if monitor.tensorboard.enabled:
            try:
                import torch.utils.tensorboard  # noqa: F401 - needs the tensorboard package
            except ImportError as exc:
                raise UserInputError(
                    f"tensorboard.enabled is true in {source}, but TensorBoard cannot be "
                    f"imported ({exc}). Fix: pip install tensorboard (a zfctl dependency: "
                    'run `make setup`), or set "tensorboard": {"enabled": false}.'
                ) from exc
        if monitor.wandb.enabled:
            try:
                self._wandb = _import_wandb()
            except ImportError as exc:
                raise UserInputError(
                    f"wandb.enabled is true in {source}, but the package 'wandb' is not "
                    "installed. Fix: pip install wandb (zfctl then logs offline, "
                    'WANDB_MODE=offline, unless you set WANDB_MODE), or set "wandb": '
                    '{"enabled": false}.'
                ) from exc

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def tee(self, on_event: Callable[[object], None]) -> Callable[[object], None]:
        """``on_event`` that also feeds this sink (first, so a renderer that raises
        KeyboardInterrupt does not keep an event from the logs)."""
        if not self.enabled:
            return on_event

        def both(event) -> None:
            self(event)
            on_event(event)

        return both

    def __call__(self, event) -> None:
        if isinstance(event, RunStarted):
            self._open(event.header)
        elif isinstance(event, StepEvent):
            self._write(event.stats.step, step_scalars(event))
        elif isinstance(event, EvalEvent):
            self._write(event.step, eval_scalars(event))
            self.flush()
        elif isinstance(event, (RunFinished, RunInterrupted, RunDiverged)):
            self.flush()

    def _open(self, header: dict) -> None:
        self.close()  # a sink serves one run
        run_dir = Path(header["run_dir"])
        start = int(header.get("start_step") or 0)
        cfg = self.config
        if cfg.tensorboard.enabled:
            self.paths["tensorboard"] = log_dir(cfg.tensorboard, "tensorboard", run_dir)
            self.writers.append(_TensorBoard(self.paths["tensorboard"], start))
        if cfg.csv_monitor.enabled:
            self.paths["csv_monitor"] = log_dir(cfg.csv_monitor, "csv_monitor", run_dir)
            self.writers.append(_Csv(self.paths["csv_monitor"], start))
        if cfg.wandb.enabled and self._wandb is not None:
            self.writers.append(_Wandb(self._wandb, cfg.wandb, run_dir, header))
            self.paths["wandb"] = run_dir / "wandb"

    def _write(self, step: int, scalars: dict) -> None:
        for writer in self.writers:
            writer.write(step, scalars)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        """Flush and close every writer (safe to call more than once)."""
        writers, self.writers = self.writers, []
        for writer in writers:
            writer.close()
