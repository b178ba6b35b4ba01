"""A run's metrics.jsonl and the figures of each step: the file and its line count, the step
line's throughput, epoch and ETA, and the ``StepEvent`` that reports the same step.

``MetricsLog`` appends one JSON line per optimizer step and per evaluation (rank 0; every
rank counts the lines, which checkpoints record so a resumed run drops what came after
them). ``StepMeter`` turns the engine's ``StepStats`` and the step's wall time into the
metrics record and the event. What a line holds is read back by ``zenflow.train.summary``,
``zfctl report`` and the dashboard: keys and their order are part of the run's format.
Nothing here steps the engine or decides when to evaluate.
"""

from __future__ import annotations

import os
from pathlib import Path

from zenflow import jsonout
from zenflow.engine.stats import StepStats
from zenflow.train import runs
from zenflow.train.events import StepEvent

ETA_STEPS = 20  # the ETA is the mean wall time of the newest steps, times the steps to go


class MetricsLog:
    """metrics.jsonl of a run (rank 0 writes it; every rank counts its lines)."""

    def __init__(self, par):
        self.par = par
        self.lines = 0  # lines written, on every rank: checkpoints record the count
        self.file = None
        self.path: Path | None = None

    def open(self, run_dir: Path) -> None:
        """Append to the run's metrics.jsonl (rank 0); the other ranks write nowhere."""
        if self.par.main:
            self.path = run_dir / runs.METRICS_FILE
            self.file = runs.open_append(self.path, encoding="utf-8")
        else:  # rank > 0 writes no metrics
            self.file = open(os.devnull, "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        if not self.par.main:  # counted on every rank: checkpoints record the count
            self.lines += 1
            return
        with runs.writing(self.path):
            self.file.write(jsonout.dumps(record) + "\n")  # NaN loss: null
            self.file.flush()
        self.lines += 1

    def flush(self) -> None:
        if not self.file.closed:
            self.file.flush()

    def __enter__(self) -> MetricsLog:
        self.file.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.file.__exit__(*exc)


class StepMeter:
    """The figures of each step beyond the engine's: samples and tokens per second, the
    fractional epoch, the ETA; as the metrics line and as the ``StepEvent``."""

    def __init__(self, samples_per_step: int, seq_len: int, total_steps: int):
        self.samples_per_step = samples_per_step  # every rank's: global micro-batch x gas
        self.seq_len = seq_len
        self.total_steps = total_steps
        self.step_times: list[float] = []  # wall seconds of this session's steps

    def step(self, stats: StepStats, wall_ms: float, epoch: float) -> tuple[dict, StepEvent]:
        """(the metrics line, the event) of step ``stats.step``, which took ``wall_ms``;
        ``epoch``: the fractional epoch at its end."""
        self.step_times.append(wall_ms / 1e3)
        sps = self.samples_per_step / (wall_ms / 1e3)
        record = {
            "type": "step",
            **stats.to_dict(),
            "wall_ms": wall_ms,
            "samples_per_s": sps,
            "tokens_per_s": sps * self.seq_len,
            "epoch": epoch,
        }
        recent = self.step_times[-ETA_STEPS:]
        eta = (self.total_steps - stats.step) * sum(recent) / len(recent)
        event = StepEvent(
            stats=stats,
            samples_per_s=sps,
            tokens_per_s=sps * self.seq_len,
            progress=stats.step / self.total_steps,
            eta_s=eta,
            epoch=epoch,
            total_steps=self.total_steps,
        )
        return record, event
