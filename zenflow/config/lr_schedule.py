"""Learning rate per optimizer step, as DeepSpeed's engine would set it.

Implements DeepSpeed 0.19.6's ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR``
(deepspeed/runtime/lr_schedules.py) as one pure function of the config and the step.

Step numbering: ``step`` is the 1-based optimizer step about to be taken. DeepSpeed builds the
scheduler with ``last_batch_iteration = -1`` (which already writes an lr into the optimizer)
and calls ``scheduler.step()`` after each optimizer step, so optimizer step ``s`` runs with the
scheduler at iteration ``s - 2``. Consequences that this module reproduces on purpose, so runs
compare one-to-one with DeepSpeed:

- WarmupLR / WarmupDecayLR: steps 1 and 2 both use ``warmup_min_lr`` (iteration -1 returns
  the minimum, and log(0 + 1) = 0 at iteration 0).
- WarmupCosineLR: step 1 uses lr 0 (iteration -1 returns ratio 0), whatever
  ``warmup_min_ratio`` is; step 2 uses ``warmup_min_ratio * lr``.
- The warm-up length is ``max(2, warmup_num_steps)``.
"""

from __future__ import annotations

import math

from zenflow.config.schema import Config

__all__ = ["lr_at"]


def _warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at a scheduler iteration < warmup_steps (0 at iteration 0)."""
    if warmup_type == "linear":
        return iteration / warmup_steps
    # "log": log(iteration + 1) / log(warmup_steps); warmup_steps >= 2 so the log is > 0.
    return math.log(iteration + 1) / math.log(warmup_steps)


def lr_at(config: Config, step: int) -> float:
    """Learning rate for the 1-based optimizer step ``step`` under ``config.scheduler``.

    Without a scheduler this is ``config.optimizer.lr`` for every step.
    """
    if step < 1:
        raise ValueError(f"lr_at: step is 1-based, got {step}")
    sched = config.scheduler
    base_lr = config.optimizer.lr
    if sched.type is None:
        return base_lr
    p = sched.params
    iteration = step - 2  # the scheduler's last_batch_iteration during this step
    warmup_steps = max(2, int(p["warmup_num_steps"]))
    warmup_type = p["warmup_type"]

    if sched.type in ("WarmupLR", "WarmupDecayLR"):
        min_lr = float(p["warmup_min_lr"])
        max_lr = float(p["warmup_max_lr"])
        if iteration < 0:
            return min_lr
        if iteration < warmup_steps:
            gamma = _warmup_fraction(iteration, warmup_steps, warmup_type)
        elif sched.type == "WarmupLR":
            gamma = 1.0
        else:
            # Linear decay from max_lr at the end of warm-up to 0 at total_num_steps.
            total = int(p["total_num_steps"])
            gamma = max(0.0, (total - iteration) / max(1.0, total - warmup_steps))
        return min_lr + (max_lr - min_lr) * gamma

    if sched.type == "WarmupCosineLR":
        if iteration < 0:
            return 0.0
        warmup_min_ratio = float(p["warmup_min_ratio"])
        if iteration < warmup_steps:
            frac = _warmup_fraction(iteration, warmup_steps, warmup_type)
            ratio = warmup_min_ratio + frac * (1.0 - warmup_min_ratio)
        else:
            cos_min_ratio = float(p["cos_min_ratio"])
            total = int(p["total_num_steps"])
            # Progress through the cosine part, clamped so the lr stays at the floor after
            # total_num_steps (and when total_num_steps <= the warm-up length).
            progress = min(1.0, (iteration - warmup_steps + 1) / max(1, total - warmup_steps))
            cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
            ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * cosine)
        return base_lr * ratio

    raise ValueError(f"lr_at: unknown scheduler type {sched.type!r}")
