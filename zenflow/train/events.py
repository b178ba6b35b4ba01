"""What a fine-tuning run reports: plain event objects (the CLI decides how to show them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zenflow.engine.stats import StepStats


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


@dataclass(frozen=True)
class RunAlreadyFinished:
    """A resumed run had already finished everything asked of it: nothing was done."""

    summary: dict  # its summary.json


class RunInterrupted(Exception):  # noqa: N818 - also the event's name
    """The run was interrupted (Ctrl-C or SIGTERM). Emitted as an event, then raised.

    ``checkpoint`` is the saved checkpoint to resume from (None if none could be saved),
    ``resume_command`` the command line that continues the run, ``signal`` what stopped it
    ("SIGINT" or "SIGTERM") and ``exit_code`` the matching process status (130 or 143).
    """

    def __init__(
        self,
        step: int,
        checkpoint: Path | None,
        resume_command: str | None,
        signal: str = "SIGINT",
        exit_code: int = 130,
    ):
        self.step = step
        self.checkpoint = checkpoint
        self.resume_command = resume_command
        self.signal = signal
        self.exit_code = exit_code
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        super().__init__(
            f"Interrupted ({signal}) after step {step}; {where}. Resume: {resume_command}"
        )
