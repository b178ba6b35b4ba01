"""When a fine-tuning run has diverged, and when a bad step is only a blip.

A step is *non-finite* when its loss is NaN or infinite or the engine skipped it (a
non-finite loss or gradient: ``ZenFlowEngine`` then changes no state at all; the DeepSpeed
adapter reports the steps DeepSpeed skipped, and DeepSpeed with CPU offload may apply a
non-finite step instead, which the loss of the next steps then shows). A few such steps in a
run that goes on are reported and nothing more: the dashboard counts them, summary.json has
"skipped_steps". While the newest step is non-finite no periodic checkpoint is taken (the
last good one stays the newest; a run that recovers is checkpointed at its next due step).

A run *diverges* when

- ``DIVERGED_AFTER`` consecutive optimizer steps are non-finite: the loss does not come
  back (a learning rate far too high drives the weights to where every forward overflows;
  bad data or a bf16/fp16 overflow does the same), so every further step is wasted; or
- the model's parameters hold NaN or inf (checked before every checkpoint and before the
  final model is written: an engine that applied a non-finite update).

It then stops: ``RunDiverged`` (``zenflow.train.events``) is emitted and raised, summary.json
says "diverged", and no checkpoint or model of the diverged weights is written, so the
newest checkpoint on disk is the last good one. The count starts again in each session (a
resumed run starts from a checkpoint's good weights).
"""

from __future__ import annotations

import math

from zenflow.engine.stats import StepStats

# Consecutive non-finite optimizer steps that end a run. A transient NaN (one bad batch, a
# bf16 overflow spike) is skipped and the next step is finite again. A skipped step changes
# no state, so five in a row are the same weights failing on five different batches: the
# weights (or most of the data) are broken, not one batch; the run has wasted 5 steps.
DIVERGED_AFTER = 5


def non_finite(stats: StepStats) -> bool:
    """Whether the step was skipped or its loss is NaN/inf (or not reported)."""
    return bool(stats.skipped) or stats.loss is None or not math.isfinite(stats.loss)


class DivergenceWatch:
    """Counts the non-finite steps of a session; ``observe`` says when the run diverged."""

    def __init__(self, start_step: int, limit: int = DIVERGED_AFTER):
        self.limit = limit
        self.streak = 0  # consecutive non-finite steps up to the last one observed
        self.last_good_step = start_step  # the newest step with a finite, applied update

    def observe(self, stats: StepStats) -> bool:
        """Count step ``stats``; True when it makes ``limit`` non-finite steps in a row."""
        if non_finite(stats):
            self.streak += 1
        else:
            self.streak = 0
            self.last_good_step = stats.step
        return self.streak >= self.limit

    def reason(self) -> str:
        first = self.last_good_step + 1
        return (
            f"the loss or gradient was non-finite (NaN or inf) for {self.streak} consecutive "
            f"optimizer steps ({first} to {first + self.streak - 1})"
        )
