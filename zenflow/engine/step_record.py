"""The per-step record: what the current step did (``StepRecord``, filled by the modes as
they work) and the ``StepStats`` the engine returns from it and the accelerator's counters.

The accelerator's per-step counters (traffic, syncs, peak) are read here and restarted
for the next step, whose figures then include the trainer's forward and backward. Must
not change engine or optimizer state; ``StepStats`` itself is plain data in ``stats``
(importable without torch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from zenflow.engine.stats import StepStats


@dataclass
class StepRecord:
    """What the current step did, filled by the modes (reset every step)."""

    stall_s: float = 0.0
    devopt_s: float = 0.0
    transfer_s: float = 0.0
    host_update: bool = False
    window_ended: int = 0
    moved: int = 0
    warmup: bool = False


def step_stats(
    engine, t: int, lr: float, loss: float | None, t_start: float, grad_norm: float, skipped: bool
) -> StepStats:
    """The finished step ``t`` as plain data: the engine's record, the accelerator's
    traffic, memory and sync counts since the last step, and the time since ``t_start``."""
    rec = engine.rec
    accel = engine.accel
    syncs = accel.syncs
    return StepStats(
        step=t,
        lr=lr,
        loss=loss,
        step_ms=(time.perf_counter() - t_start) * 1e3,
        device_opt_ms=rec.devopt_s * 1e3,
        stall_ms=rec.stall_s * 1e3,
        transfer_ms=rec.transfer_s * 1e3,
        d2h_bytes=accel.traffic.d2h_bytes,
        h2d_bytes=accel.traffic.h2d_bytes,
        device_bytes=accel.device_bytes(),
        device_peak_bytes=accel.peak_bytes(),
        pinned_host_bytes=accel.pinned_bytes(),
        host_bytes=sum(accel.host_held().values()),
        host_peak_bytes=accel.host_peak_bytes(),
        full_syncs=syncs.full,
        d2h_reads=syncs.reads,
        overlap_share=accel.overlap_share(),
        host_update=rec.host_update,
        window_len=rec.window_ended,
        selection_changed=rec.moved,
        grad_norm=grad_norm,
        skipped=skipped,
        warmup=rec.warmup,
        mode=engine.mode,
    )


def restart_counters(accel) -> dict[str, int]:
    """Start the next step's figures here (the trainer's forward/backward included) ->
    the device bytes per holder at the peak just ended."""
    peak_held = accel.peak_held()
    accel.traffic.reset()
    accel.syncs.reset()
    accel.reset_peak()
    return peak_held
