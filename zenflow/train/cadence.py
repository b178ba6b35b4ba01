"""When a run evaluates and checkpoints between its steps.

``--eval-every N`` evaluates after every N-th step except the last (the final evaluation
follows the final save); a checkpoint follows every evaluation and every
``--checkpoint-every M``-th step. A resumed run whose checkpoint's evaluation is missing
(the stop came between the checkpoint's step and its evaluation) owes it, and does it
first.

Decisions only: the trainer runs the evaluation and the save (and skips a due checkpoint
while the loss is non-finite: ``zenflow.train.divergence``).
"""

from __future__ import annotations


class Cadence:
    """The evaluation and checkpoint schedule of a run of ``total_steps`` steps."""

    def __init__(self, eval_every: int | None, checkpoint_every: int | None, total_steps: int):
        self.eval_every = eval_every
        self.checkpoint_every = checkpoint_every
        self.total_steps = total_steps

    def eval_due(self, step: int) -> bool:
        """Whether the periodic evaluation follows step ``step``."""
        every = self.eval_every
        return bool(every and step % every == 0 and step < self.total_steps)

    def checkpoint_due(self, step: int, evaluated: bool) -> bool:
        """Whether a checkpoint follows step ``step`` (``evaluated``: an evaluation did)."""
        return bool(evaluated or (self.checkpoint_every and step % self.checkpoint_every == 0))

    def eval_owed(self, kept: list[dict], step: int) -> bool:
        """Whether the periodic evaluation due at ``step`` (a resumed run's checkpoint) is
        not in the kept metrics: a stop that came during that step or its evaluation saved
        the boundary before it. The resumed run does it first, so its metrics.jsonl equals
        an uninterrupted run's."""
        if step <= 0 or not self.eval_due(step):
            return False
        return not any(r.get("type") == "eval" and r.get("step") == step for r in kept)
