"""Per-step measurements the engine reports as plain data (ZENFLOW.md section 4)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The per-step timings a run records (metrics.jsonl) and summary.json averages: the
# StepStats times plus "wall_ms", the trainer's wall clock of the whole iteration.
TIMING_FIELDS = (
    "wall_ms", "step_ms", "forward_ms", "backward_ms", "device_opt_ms", "stall_ms", "transfer_ms",
)  # fmt: skip


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did and cost. Times in milliseconds, traffic in bytes.

    The engine fills everything it can observe; ``forward_ms`` and ``backward_ms`` are
    measured by the caller (the engine does not run the model) and merged with
    ``dataclasses.replace``.
    """

    step: int  # 1-based optimizer step
    lr: float
    loss: float | None = None
    step_ms: float = 0.0  # wall time of engine.step()
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    device_opt_ms: float = 0.0  # device-side optimizer work (selective AdamW, 1-D params)
    stall_ms: float = 0.0  # blocked on host optimizer work or copies
    transfer_ms: float = 0.0  # time spent issuing/awaiting copies
    d2h_bytes: int = 0  # counted at each device->host copy
    h2d_bytes: int = 0  # counted at each host->device copy
    # device memory of weights, grads and engine state (no activations; cuda: the caching
    # allocator's allocated bytes, everything the process holds); None: not reported
    device_bytes: int | None = 0
    # the largest device_bytes during the step, backward included (streamed gradients and
    # buckets in flight); cuda: the allocator's peak, activations included
    device_peak_bytes: int | None = None
    pinned_host_bytes: int | None = None  # page-locked host bytes (modelled on sim)
    host_bytes: int | None = None  # host bytes of engine state and buffers
    # the largest host_bytes since the engine was made (the whole run so far: set-up,
    # selections, hand-overs, checkpoints), as allocated
    host_peak_bytes: int | None = None
    # the process's resident set after the step, measured (VmRSS: pinned pages included;
    # sim: the simulated device's pool too); set by the trainer, None elsewhere
    process_rss_bytes: int | None = None
    host_available_bytes: int | None = None  # the machine's MemAvailable then (the trainer)
    full_syncs: int = 0  # full device synchronizations since the last step (training thread)
    d2h_reads: int = 0  # device-to-host reads since the last step (training thread)
    # share of the link bytes copied since the last step that moved while the device
    # computed (sim only; None elsewhere)
    overlap_share: float | None = None
    host_update: bool = False  # a host step was applied (or submitted) at this step
    window_len: int = 0  # length of the window that ended here, 0 if none ended
    selection_changed: int = 0  # columns that changed owner at this step
    grad_norm: float | None = None  # global norm of the whole gradient (before clipping)
    skipped: bool = False  # non-finite loss or gradient: no state changed
    warmup: bool = False  # a full synchronous warm-up step
    mode: str = "zenflow"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
