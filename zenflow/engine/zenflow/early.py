"""ZenFlow's early schedule (``zfctl.early``): over the first steps after warm-up, shorter
windows (the ramp) or host steps applied at their own window's end (overlap off), so that
the non-selected columns are less stale while the model moves fastest.

A pure function of the step: the window length that ends a window at step ``t`` and whether
that window's host step overlaps the next window; ``ZenFlowMode`` asks it at every step.
The reference schedule (``reference_schedule.run_reference``) states the same rule on its
own, so the tests compare two statements of it. A resumed run continues the same schedule
(nothing here is checkpointed).
"""

from __future__ import annotations

from zenflow.errors import EngineError


def ramp_length(early_step: int, interval: int, steps: int) -> int:
    """The ramp's window length at early step ``early_step`` (1-based, counted after
    warm-up) of a ``steps``-step phase, growing to ``interval``:
    min(S, 2^floor(log2(S t / steps))), at least 1. S 4 over 100 steps: 1 up to step 49,
    2 from step 50, 4 from step 100."""
    x = interval * early_step // steps  # floor(log2(y)) == floor(log2(floor(y))) for y >= 1
    if x < 1:
        return 1
    return min(interval, 1 << (x.bit_length() - 1))


class EarlySchedule:
    """``options``: the ``zfctl.early`` block (steps, windows, overlap); ``update_interval``:
    S, None with "auto"; ``overlap``: overlap_step; ``warmup_rounds``: full_warm_up_rounds
    (the phase starts after them)."""

    def __init__(self, options, update_interval: int | None, overlap: bool, warmup_rounds: int):
        self.steps = int(options.steps)
        self.ramp = options.windows == "ramp" and self.steps > 0
        if self.ramp and update_interval is None:
            raise EngineError(
                'zfctl.early.windows "ramp" ramps the window length up to '
                'update_interval, which is "auto": set an integer '
                'update_interval or early.windows "fixed"'
            )
        self.early_overlap = bool(options.overlap)
        self.update_interval = update_interval
        self.overlap_step = overlap
        self.warmup_rounds = warmup_rounds

    def early_step(self, t: int) -> int | None:
        """``t``'s place in the early phase (1-based), None outside it."""
        e = t - self.warmup_rounds
        return e if 0 < e <= self.steps else None

    def interval(self, t: int) -> int | None:
        """The length a window ending at step ``t`` has (None: "auto", the vote decides)."""
        e = self.early_step(t)
        if e is None or not self.ramp:
            return self.update_interval
        return ramp_length(e, self.update_interval, self.steps)

    def overlap(self, t: int) -> bool:
        """Whether the host step of a window ending at step ``t`` overlaps the next window."""
        return self.overlap_step and (self.early_overlap or self.early_step(t) is None)

    def describe(self) -> dict | None:
        """The resolved settings' entry (None when off)."""
        if self.steps == 0:
            return None
        return {"steps": self.steps, "windows": "ramp" if self.ramp else "fixed",
                "overlap": self.early_overlap and self.overlap_step}  # fmt: skip
