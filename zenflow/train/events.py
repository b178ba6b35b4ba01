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


class RunDiverged(Exception):  # noqa: N818 - also the event's name
    """The run diverged and stopped (``zenflow.train.divergence``). Emitted as an event,
    then raised.

    ``step`` is the step it stopped at, ``reason`` what was seen there, ``last_good_step``
    the last step whose loss was finite and not skipped, ``skipped_steps`` the steps
    skipped as non-finite in the whole run, ``checkpoint`` the newest checkpoint (taken
    before the run diverged; None when none was written) and ``lr`` the peak learning rate.
    No checkpoint and no model of the diverged weights is written.
    """

    def __init__(
        self,
        step: int,
        reason: str,
        last_good_step: int,
        skipped_steps: int,
        checkpoint: Path | None,
        lr: float | None = None,
        resume_command: str | None = None,
        restart: str | None = None,
    ):
        self.step = step
        self.reason = reason
        self.last_good_step = last_good_step
        self.skipped_steps = skipped_steps
        self.checkpoint = checkpoint
        self.lr = lr
        # the command that goes on from ``checkpoint`` at a lower lr; None without one
        self.resume_command = resume_command
        lr_now = f" (now {lr:g})" if lr is not None else ""
        if checkpoint is not None:
            kept = f"The last good checkpoint, {checkpoint}, is kept"
        else:
            kept = "No checkpoint was written before it diverged"
        if resume_command is not None:
            then = f" Go on from that checkpoint at a tenth of the lr with: {resume_command}"
        elif restart is not None and checkpoint is None:
            then = f" With a lower --lr: {restart}"
        else:
            then = ""
        super().__init__(
            f"training diverged at step {step}: {reason}. Likely causes: a learning rate too "
            f"high{lr_now}: lower --lr or optimizer.params.lr; bad input data (NaN or "
            "extreme regression labels, garbled rows); or bf16/fp16 overflow: train in fp32 with "
            f"--set bf16.enabled=false. Last good step: {last_good_step}; {skipped_steps} "
            f"step(s) skipped as non-finite in all. {kept}; no checkpoint or model of the "
            f"diverged weights was written.{then}"
        )
